"""FedYogi: v = v − (1 − β2)·Δ²·sign(v − Δ²) (Reddi et al. 2021)."""

from __future__ import annotations

import numpy as np

from master.strategies.fedopt import FedOpt


class FedYogi(FedOpt):
    """Yogi on the server: v grows or shrinks additively, never faster than Δ² allows.

    Parameters
    ----------
    eta : float, default 1e-2
    beta_1 : float, default 0.9
    beta_2 : float, default 0.99
    tau : float, default 1e-3
    """

    name = "fedyogi"

    def __init__(self, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 1e-3) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau)

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return v - (1 - self.beta_2) * delta_sq * np.sign(v - delta_sq)
