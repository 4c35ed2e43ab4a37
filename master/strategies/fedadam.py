"""FedAdam: v = β2·v + (1 − β2)·Δ² (Reddi et al. 2021)."""

from __future__ import annotations

import numpy as np

from master.strategies.fedopt import FedOpt


class FedAdam(FedOpt):
    """Adam on the server (no bias correction, as in the paper's Algorithm 2).

    Parameters
    ----------
    eta : float, default 0.1
    beta_1 : float, default 0.9
    beta_2 : float, default 0.99
    tau : float, default 1e-3
    """

    name = "fedadam"

    def __init__(self, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99,
                 tau: float = 1e-3) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau)

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return self.beta_2 * v + (1 - self.beta_2) * delta_sq
