"""A copy of a torch optimizer's state kept in buffers of its own, for a step that may have
to be undone.

The master takes one before every synchronized step's Adam update (master/families/ntm.py:
an aggregate it refuses is undone). ``copy.deepcopy(optimizer.state_dict())`` allocated the
moments afresh each time: 1 ms a step idle at V 2,000, K 50, and 3-4 ms with the workers
beside it on two cores (page faults on new memory), on the critical path of every step. Here
the buffers are allocated once and written over in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OptimizerCopy"]


# hand-written: torch has no in-place save and restore of an optimizer's state
class OptimizerCopy:
    """Buffers holding an optimizer's per-parameter state, reused from one :meth:`take` to the
    next. One copy at a time: a :meth:`take` overwrites the last.

    Parameters are told apart by identity (``id``): tensors compare element-wise, so a list
    or set of them cannot be searched with ``in``.
    """

    def __init__(self) -> None:
        self._kept: dict[int, dict[str, Any]] = {}

    def take(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Copy ``optimizer``'s state now; returns what puts it back (valid until the next
        :meth:`take`)."""
        state = optimizer.state
        keys: dict[int, tuple[str, ...]] = {}  # what each parameter's state held then
        for p, entry in state.items():
            if not entry:
                continue
            kept = self._kept.setdefault(id(p), {})
            for key, value in entry.items():
                buf = kept.get(key)
                if (torch.is_tensor(value) and torch.is_tensor(buf)
                        and buf.shape == value.shape and buf.dtype == value.dtype):
                    buf.copy_(value)
                else:
                    kept[key] = value.detach().clone() if torch.is_tensor(value) else value
            keys[id(p)] = tuple(entry)

        def restore() -> None:
            for p in [p for p in state if id(p) not in keys]:
                del state[p]  # state its step created (an optimizer's first step)
            for p, live in state.items():
                held = keys[id(p)]
                for key in [k for k in live if k not in held]:
                    del live[key]  # a key the step added
                for key in held:
                    buf, now = self._kept[id(p)][key], live.get(key)
                    if (torch.is_tensor(buf) and torch.is_tensor(now)
                            and now.shape == buf.shape and now.dtype == buf.dtype):
                        now.copy_(buf)
                    else:
                        live[key] = buf.clone() if torch.is_tensor(buf) else buf

        return restore
