"""The ``mlp`` family's hyperparameters, apart from the network: reading them needs no torch.

``fedctl check`` reads a job's ``model`` section and never builds a network; importing torch
for that cost 1-2 s a check. The network itself is :class:`common.models.mlp.MLPClassifier`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.privacy.dp import DPSGDParams

if TYPE_CHECKING:
    from common.models.mlp import MLPClassifier

OPTIMIZERS = ("adam", "sgd", "adamw")


@dataclass
class MLPParams:
    """Hyperparameters of the ``mlp`` family (the ``model`` section of cluster.yaml).

    Parameters
    ----------
    hidden : int, default 256
        Width of the hidden layer.
    local_epochs : int, default 1
        Passes over a worker's data per round.
    batch_size : int, default 64
    optimizer : {"adam", "adamw", "sgd"}, default "adam"
    lr : float, default 1e-3
    weight_decay : float, default 0.0
    max_classes : int, default 1000
        Most classes the master accepts in the workers' class lists (their union included): a
        longer list is refused at registration, before it can reach every worker.
    """

    hidden: int = 256
    local_epochs: int = 1
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_classes: int = 1000

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        for name in ("hidden", "local_epochs", "batch_size", "max_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1")
        if self.lr <= 0:
            raise ValueError("lr: expected a number > 0")

    def n_parameters(self, input_dim: int, n_classes: int) -> int:
        """The network's parameter count (Linear-ReLU-Linear), without building it."""
        return input_dim * self.hidden + self.hidden + self.hidden * n_classes + n_classes

    def classifier(self, input_dim: int, n_classes: int, device: str = "cpu",
                   random_state: int = 0, dp: DPSGDParams | None = None) -> MLPClassifier:
        """A fresh classifier with these hyperparameters (trained by DP-SGD with ``dp``)."""
        from common.models.mlp import MLPClassifier  # torch, only once a network is wanted

        return MLPClassifier(input_dim, n_classes, hidden=self.hidden, epochs=self.local_epochs,
                             batch_size=self.batch_size, optimizer=self.optimizer, lr=self.lr,
                             weight_decay=self.weight_decay, device=device,
                             random_state=random_state, dp=dp)
