"""Mean pooling: Θ = 1/N Σ Θ_i, every client counting the same (the seed system's rule)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import BufferPool, weighted_average
from master.strategies.base import ClientResult, Strategy


class MeanPooling(Strategy):
    """Unweighted mean of the clients' parameters."""

    name = "mean"
    secure_aggregation_refusal = ("it weights every worker the same; secure rounds weight by "
                                  "documents: use fedavg")

    def __init__(self) -> None:
        self._buffers = BufferPool()  # the global model's memory, recycled round to round

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        return weighted_average([r.arrays for r in results], [1.0] * len(results),
                                pool=self._buffers)
