"""Krum and Multi-Krum (Blanchard et al. 2017): keep the updates closest to the others."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import krum_scores, weighted_average
from master.strategies.base import ClientResult, Strategy, check_mixing, mixed_results


class Krum(Strategy):
    """Score each update by the summed squared distances to its ``n − f − 2`` nearest ones;
    Krum takes the best-scored update as it is, Multi-Krum (``num_clients_to_keep`` > 0) the
    sample-weighted mean of the best ``num_clients_to_keep`` (Flower's ``Krum``, same
    parameters and defaults). Ties go to the worker first in worker order.

    Parameters
    ----------
    num_malicious_clients : int, default 0
        f, the hostile clients to tolerate; the guarantee needs n > 2f + 2.
    num_clients_to_keep : int, default 0
        0: Krum; m > 0: Multi-Krum over the best m.
    mixing : bool, default False
        Replace each update by the mean of its ``n − f`` nearest before scoring
        (nearest-neighbour mixing, Allouah et al. 2023; not in Flower): Krum then takes a
        mean of mostly honest updates rather than one worker's. Needs f >= 1.
    """

    name = "krum"
    secure_aggregation_refusal = "it must see each update to score their distances"

    def __init__(self, num_malicious_clients: int = 0, num_clients_to_keep: int = 0,
                 mixing: bool = False) -> None:
        for key, value in (("num_malicious_clients", num_malicious_clients),
                           ("num_clients_to_keep", num_clients_to_keep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
        check_mixing(mixing, num_malicious_clients)
        self.num_malicious_clients = num_malicious_clients
        self.num_clients_to_keep = num_clients_to_keep
        self.mixing = mixing
        self.last_kept_: list[str] = []

    def few_updates_note(self, n_updates: int) -> str | None:
        f = self.num_malicious_clients
        if n_updates > 2 * f + 2:
            return None
        return (f"strategy krum with {n_updates} update(s) a round cannot tell a hostile one "
                f"from the others: its guarantee needs more than 2 f + 2 = {2 * f + 2} "
                f"(num_malicious_clients {f}); scores that tie go to the worker first in "
                f"worker order")

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        results = mixed_results(results, self.mixing, self.num_malicious_clients)
        scores = krum_scores([r.arrays for r in results], self.num_malicious_clients)
        order = np.argsort(scores, kind="stable")
        if self.num_clients_to_keep > 0:
            best = [results[i] for i in order[:self.num_clients_to_keep]]
            self.last_kept_ = [r.worker_id for r in best]
            return weighted_average([r.arrays for r in best], [r.n_samples for r in best])
        chosen = results[int(order[0])]
        self.last_kept_ = [chosen.worker_id]
        return {name: np.array(a, copy=True) for name, a in chosen.arrays.items()}
