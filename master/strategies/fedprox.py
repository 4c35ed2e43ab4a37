"""FedProx (Li et al. 2020): FedAvg whose workers keep near the global model."""

from __future__ import annotations

from typing import Any

from master.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """The master aggregates as FedAvg does; each worker adds the proximal term
    ``μ/2 · ‖w − w_global‖²`` to its local objective, so that on skewed data its local steps
    cannot drift far from the model they started from. μ reaches the workers in every round's
    ``meta`` (``proximal_mu``), as Flower's ``FedProx`` sends it in the fit config.

    Parameters
    ----------
    proximal_mu : float, default 0.01
        μ >= 0 (0: FedAvg). Flower's ``FedProx`` has no default; the paper tunes μ among
        0.001, 0.01, 0.1 and 1.
    """

    name = "fedprox"

    def __init__(self, proximal_mu: float = 0.01) -> None:
        super().__init__()
        if not (isinstance(proximal_mu, (int, float)) and proximal_mu >= 0):
            raise ValueError(f"proximal_mu must be a number >= 0, got {proximal_mu!r}")
        self.proximal_mu = float(proximal_mu)

    def client_settings(self) -> dict[str, Any]:
        return {"proximal_mu": self.proximal_mu}
