"""Trimmed mean (Yin et al. 2018): the coordinate-wise mean without the extremes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import trimmed_mean
from master.strategies.base import ClientResult, Strategy


class FedTrimmedAvg(Strategy):
    """Each parameter is the mean of the clients' values after cutting ``int(beta · n)`` from
    each end, unweighted (Flower's ``FedTrimmedAvg``). With 5 clients and the default β = 0.2
    one value is cut from each end: one hostile client is never counted.

    Parameters
    ----------
    beta : float, default 0.2
        Share cut from each end, in [0, 0.5).
    """

    name = "fedtrimmedavg"
    secure_aggregation_refusal = "it must see each update to trim the extremes"

    def __init__(self, beta: float = 0.2) -> None:
        if not 0 <= beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5), got {beta}")
        self.beta = beta

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        return trimmed_mean([r.arrays for r in results], self.beta)
