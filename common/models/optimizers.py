"""Options every family's torch optimizers are built with (fused on the CPU needs torch 2.4,
the floor setup.cfg sets)."""

from __future__ import annotations

from typing import Any

#: Optimizers with a fused kernel (one pass over each parameter, on the CPU too): at 1.6 M
#: parameters Adam's step takes 0.6 ms fused against 7.9 ms one tensor at a time, torch's
#: default on the CPU (1.9 ms with foreach). The same update, to float rounding.
FUSED = frozenset({"adam", "adamw"})


def fused_kwargs(name: str) -> dict[str, Any]:
    """Keyword arguments that make optimizer ``name`` (``adam``, ``adamw``, ``sgd``…) fused
    where torch has a fused kernel for it."""
    return {"fused": True} if name in FUSED else {}
