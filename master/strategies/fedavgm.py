"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import weighted_average
from master.strategies.base import ClientResult, Strategy


class FedAvgM(Strategy):
    """The sample-weighted mean as a pseudo-gradient, followed with momentum on the server.

    With Δ = x − mean (the direction the clients moved the model, negated):

        v = β·v + Δ        (v = Δ in the first round)
        x = x − η·v

    which is Flower's ``FedAvgM`` (no Nesterov). With the defaults it is FedAvg.

    Parameters
    ----------
    server_learning_rate : float, default 1.0
        η.
    server_momentum : float, default 0.0
        β; the paper's and Flower's examples use 0.9.

    Attributes
    ----------
    momentum_ : dict of str to numpy.ndarray
        v, one float64 array per parameter; empty before the first round.
    """

    name = "fedavgm"

    def __init__(self, server_learning_rate: float = 1.0, server_momentum: float = 0.0) -> None:
        if not server_learning_rate > 0:
            raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate}")
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum}")
        self.server_learning_rate = server_learning_rate
        self.server_momentum = server_momentum
        self.momentum_: dict[str, np.ndarray] = {}

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        mean = weighted_average([r.arrays for r in results], [r.n_samples for r in results],
                                accumulate=np.float64)
        out = {}
        for name, x in current.items():
            x64 = np.asarray(x, dtype=np.float64)
            delta = x64 - mean[name]
            v = self.momentum_.get(name)
            v = delta if v is None else self.server_momentum * v + delta
            self.momentum_[name] = v
            out[name] = (x64 - self.server_learning_rate * v).astype(x.dtype)
        return out

    def state(self) -> dict[str, np.ndarray]:
        return dict(self.momentum_)

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.momentum_ = {k: np.array(v) for k, v in state.items()}
