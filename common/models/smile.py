"""The SMILE lower bound of mutual information and its critic (Song & Ermon, ICLR 2020).

For a batch of B matched pairs (x_j, z_j) drawn from the joint distribution, a critic T scores
every pair (x_j, z_j'); the off-diagonal pairs stand in for draws from the product of the
marginals. Then

    I_SMILE = mean_j T(x_j, z_j) - log mean_{j != j'} clip(exp T(x_j, z_j'), e^-tau, e^tau)

is the Donsker-Varadhan bound with the partition function's terms clipped, which bounds its
variance (at the price of a bias that vanishes as tau grows). The critic is trained to
maximize it.

The clipped value alone is a poor training signal: the first term is not clipped, so a critic
can raise every score at once and the "bound" grows without limit. Song & Ermon's own
implementation therefore takes its *gradient* from the Jensen-Shannon (f-GAN) bound, whose
optimal critic is the same log density ratio, and only its *value* from SMILE:
``js + (smile - js).detach()``. :func:`smile_lower_bound` does the same by default.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["smile_lower_bound", "SmileCritic"]


# hand-written: no maintained library has SMILE; follows Song & Ermon's own code
def smile_lower_bound(scores_matched: torch.Tensor | np.ndarray,
                      scores_all: torch.Tensor | np.ndarray, tau: float = 5.0,
                      js_gradient: bool = True) -> torch.Tensor:
    """I_SMILE from a critic's scores (natural log, so in nats).

    Parameters
    ----------
    scores_matched : tensor of shape (B,)
        T(x_j, z_j) of the matched pairs.
    scores_all : tensor of shape (B, B)
        T(x_j, z_j') of every pair; only the off-diagonal (j != j') entries are used.
    tau : float, default 5.0
        Clip of exp(T) to [e^-tau, e^tau] in the second term.
    js_gradient : bool, default True
        Return a tensor whose value is I_SMILE but whose gradient is that of the
        Jensen-Shannon bound (as Song & Ermon's code does); False: the gradient of I_SMILE
        itself.

    Returns
    -------
    torch.Tensor
        A 0-d tensor.
    """
    matched = torch.as_tensor(scores_matched)
    scores = torch.as_tensor(scores_all)
    b = scores.shape[0]
    if scores.shape != (b, b) or matched.shape != (b,) or b < 2:
        raise ValueError(f"expected scores of shape (B,) and (B, B) with B >= 2, got "
                         f"{tuple(matched.shape)} and {tuple(scores.shape)}")
    # clip(e^T, e^-tau, e^tau) = e^clip(T, -tau, tau); log-mean-exp over the off-diagonal
    # entries, computed stably.
    off = ~torch.eye(b, dtype=torch.bool, device=scores.device)
    clipped = scores.clamp(-tau, tau)[off]
    log_mean = torch.logsumexp(clipped, dim=0) - math.log(b * (b - 1))
    smile = matched.mean() - log_mean
    if not js_gradient:
        return smile
    js = -F.softplus(-matched).mean() - F.softplus(scores[off]).mean()
    return js + (smile - js).detach()


# hand-written: first layer split so the B x B pairs form after it; no torch layer does so
class SmileCritic(nn.Module):
    """T_theta(x, z): an MLP on the concatenation [x, z], two hidden layers (32 and 256 units
    by default, as in Si et al. 2022), ReLU.

    Scoring all B x B pairs of a batch would mean B^2 concatenations; the first layer is
    linear, so it is split into a part for x and a part for z computed once per row, and the
    pairs are formed after it.

    Parameters
    ----------
    x_dim, z_dim : int
    hidden : tuple of int, default (32, 256)
    """

    def __init__(self, x_dim: int, z_dim: int, hidden: tuple[int, ...] = (32, 256)) -> None:
        super().__init__()
        if len(hidden) < 1:
            raise ValueError("need at least one hidden layer")
        self.x_dim, self.z_dim = x_dim, z_dim
        self.first = nn.Linear(x_dim + z_dim, hidden[0])
        layers: list[nn.Module] = []
        for a, b in zip(hidden[:-1], hidden[1:], strict=True):
            layers += [nn.ReLU(), nn.Linear(a, b)]
        layers += [nn.ReLU(), nn.Linear(hidden[-1], 1)]
        self.rest = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Scores of every pair: entry (j, j') is T(x_j, z_j'); shape (B, B)."""
        wx, wz = self.first.weight[:, :self.x_dim], self.first.weight[:, self.x_dim:]
        hx = x @ wx.T + self.first.bias  # (B, h)
        hz = z @ wz.T  # (B, h)
        pairs = hx[:, None, :] + hz[None, :, :]  # (B, B, h)
        return self.rest(pairs).squeeze(-1)

    def bound(self, x: torch.Tensor, z: torch.Tensor, tau: float = 5.0) -> torch.Tensor:
        """I_SMILE of the matched rows of x and z under this critic."""
        scores = self.forward(x, z)
        return smile_lower_bound(scores.diagonal(), scores, tau)
