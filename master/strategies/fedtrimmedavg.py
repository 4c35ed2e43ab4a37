"""Trimmed mean (Yin et al. 2018): the coordinate-wise mean without the extremes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import trimmed_mean
from master.strategies.base import ClientResult, Strategy, check_mixing, mixed_results


class FedTrimmedAvg(Strategy):
    """Each parameter is the mean of the clients' values after cutting ``int(beta · n)`` from
    each end, unweighted (Flower's ``FedTrimmedAvg``). With 5 clients and the default β = 0.2
    one value is cut from each end: one hostile client is never counted.

    Parameters
    ----------
    beta : float, default 0.2
        Share cut from each end, in [0, 0.5).
    num_malicious_clients : int, default 0
        f, the hostile clients to tolerate; only ``mixing`` uses it.
    mixing : bool, default False
        Replace each update by the mean of its ``n − f`` nearest before trimming
        (nearest-neighbour mixing, Allouah et al. 2023; not in Flower): see
        :class:`~master.strategies.fedmedian.FedMedian`. Needs f >= 1.
    """

    name = "fedtrimmedavg"
    secure_aggregation_refusal = "it must see each update to trim the extremes"

    def __init__(self, beta: float = 0.2, num_malicious_clients: int = 0,
                 mixing: bool = False) -> None:
        if not 0 <= beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5), got {beta}")
        check_mixing(mixing, num_malicious_clients)
        self.beta = beta
        self.num_malicious_clients = num_malicious_clients
        self.mixing = mixing

    def few_updates_note(self, n_updates: int) -> str | None:
        if int(self.beta * n_updates) > 0:
            return None
        least = None
        if self.beta > 0:  # the fewest updates of which int(beta n) is one
            least = math.ceil(1 / self.beta - 1e-9)
            least += int(self.beta * least) < 1
        return (f"strategy fedtrimmedavg cuts int(beta n) = 0 of {n_updates} update(s) a round "
                f"from each end (beta {self.beta:g}): an unweighted FedAvg, which one hostile "
                f"update moves as far as it likes"
                + (f" (it cuts one from {least} updates)" if least else ""))

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        results = mixed_results(results, self.mixing, self.num_malicious_clients)
        return trimmed_mean([r.arrays for r in results], self.beta)
