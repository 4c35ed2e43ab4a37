"""FedMedian (Yin et al. 2018): the coordinate-wise median of the clients' parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import coordinate_median
from master.strategies.base import ClientResult, Strategy


class FedMedian(Strategy):
    """Each parameter is the median of the clients' values, unweighted (Flower's
    ``FedMedian``): fewer than half of the clients cannot move it past the honest ones'
    range, whatever they send or claim."""

    name = "fedmedian"
    secure_aggregation_refusal = "it must see each update to take their median"

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        return coordinate_median([r.arrays for r in results])
