"""FedProx's proximal term (Li et al. 2020), shared by the families trained by gradient."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def proximal_term(params: Iterable[torch.Tensor], anchor: Sequence[torch.Tensor], mu: float
                  ) -> torch.Tensor:
    """``μ/2 · Σ ‖p − a‖²`` over the parameters and their values at the round's start."""
    return (mu / 2) * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))


def anchor_of(params: Iterable[torch.Tensor], mu: float) -> list[torch.Tensor] | None:
    """Copies of ``params`` to keep near, or None when ``mu`` is 0 (FedProx off)."""
    return [p.detach().clone() for p in params] if mu > 0 else None
