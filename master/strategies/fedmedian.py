"""FedMedian (Yin et al. 2018): the coordinate-wise median of the clients' parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import coordinate_median
from master.strategies.base import ClientResult, Strategy, check_mixing, mixed_results


class FedMedian(Strategy):
    """Each parameter is the median of the clients' values, unweighted (Flower's
    ``FedMedian`` with the defaults): fewer than half of the clients cannot move it past the
    honest ones' range, whatever they send or claim.

    Parameters
    ----------
    num_malicious_clients : int, default 0
        f, the hostile clients to tolerate; only ``mixing`` uses it.
    mixing : bool, default False
        Replace each update by the mean of its ``n − f`` nearest before the median
        (nearest-neighbour mixing, Allouah et al. 2023; not in Flower). Under skewed data the
        median of five with one hostile update is an honest update one rank over, biased by
        how far apart the honest ones are; mixed, they sit close together. Needs f >= 1.
    """

    name = "fedmedian"
    secure_aggregation_refusal = "it must see each update to take their median"

    def __init__(self, num_malicious_clients: int = 0, mixing: bool = False) -> None:
        check_mixing(mixing, num_malicious_clients)
        self.num_malicious_clients = num_malicious_clients
        self.mixing = mixing

    def few_updates_note(self, n_updates: int) -> str | None:
        if n_updates > 2:
            return None
        return (f"strategy fedmedian with {n_updates} update(s) a round takes their mean: one "
                f"hostile update moves it as far as it likes (3 or more are needed)")

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        results = mixed_results(results, self.mixing, self.num_malicious_clients)
        return coordinate_median([r.arrays for r in results])
