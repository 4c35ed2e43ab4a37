"""FedAdagrad: v = v + Δ² (Reddi et al. 2021)."""

from __future__ import annotations

import numpy as np

from master.strategies.fedopt import FedOpt


class FedAdagrad(FedOpt):
    """Adagrad on the server.

    Parameters
    ----------
    eta : float, default 0.1
    beta_1 : float, default 0.0
        With 0, m is the latest pseudo-gradient itself (Flower's default).
    tau : float, default 1e-9
    """

    name = "fedadagrad"

    def __init__(self, eta: float = 0.1, beta_1: float = 0.0, tau: float = 1e-9) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=0.0, tau=tau)

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return v + delta_sq
