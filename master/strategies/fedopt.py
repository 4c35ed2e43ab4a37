"""FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): the server's optimizer.

The weighted mean of the clients' parameters minus the current global parameters is a
pseudo-gradient Δ; the server keeps moments of it and takes an adaptive step:

    m = β1·m + (1 − β1)·Δ
    v = <rule of the subclass>(v, Δ²)
    x = x + η · m / (√v + τ)

m and v start at zero (as in Flower) and are the strategy's state, saved in checkpoints.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from common.aggregate import BufferPool, weighted_average
from master.strategies.base import ClientResult, Strategy


class FedOpt(Strategy):
    """Base of FedAdagrad, FedYogi and FedAdam.

    Parameters
    ----------
    eta : float
        Server learning rate η.
    beta_1 : float
        First-moment decay β1.
    beta_2 : float
        Second-moment decay β2 (unused by FedAdagrad).
    tau : float
        Adaptivity τ: keeps the step finite where v is near zero.

    Attributes
    ----------
    m_, v_ : dict of str to numpy.ndarray
        The moments, one array per parameter (float64), empty before the first round.
    """

    def __init__(self, eta: float, beta_1: float, beta_2: float, tau: float) -> None:
        for name, value in (("eta", eta), ("tau", tau)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        self.eta, self.beta_1, self.beta_2, self.tau = eta, beta_1, beta_2, tau
        self.m_: dict[str, np.ndarray] = {}
        self.v_: dict[str, np.ndarray] = {}
        self._buffers = BufferPool()  # the clients' mean, needed only within a round

    @abstractmethod
    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        """The new v from the old one and Δ²."""

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        mean = weighted_average([r.arrays for r in results], [r.n_samples for r in results],
                                pool=self._buffers)
        out = {}
        for name, x in current.items():
            x64 = np.asarray(x, dtype=np.float64)
            delta = mean[name] - x64
            m = self.m_.get(name, np.zeros_like(x64))
            v = self.v_.get(name, np.zeros_like(x64))
            m = self.beta_1 * m + (1 - self.beta_1) * delta
            v = self.second_moment(v, delta * delta)
            self.m_[name], self.v_[name] = m, v
            out[name] = (x64 + self.eta * m / (np.sqrt(v) + self.tau)).astype(x.dtype)
        return out

    def state(self) -> dict[str, np.ndarray]:
        return {**{f"m/{k}": v for k, v in self.m_.items()},
                **{f"v/{k}": v for k, v in self.v_.items()}}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.m_ = {k[2:]: np.array(v) for k, v in state.items() if k.startswith("m/")}
        self.v_ = {k[2:]: np.array(v) for k, v in state.items() if k.startswith("v/")}
