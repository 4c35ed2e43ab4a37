"""FedAvg (McMahan et al. 2017): Θ = Σ n_i Θ_i / Σ n_i, weighted by local sample counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import BufferPool, weighted_average
from master.strategies.base import ClientResult, Strategy


class FedAvg(Strategy):
    """Sample-weighted mean of the clients' parameters."""

    name = "fedavg"

    def __init__(self) -> None:
        self._buffers = BufferPool()  # the global model's memory, recycled round to round

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        return weighted_average([r.arrays for r in results], [r.n_samples for r in results],
                                pool=self._buffers)
