"""Where a worker's training really ran: the share of its tensors on a GPU, the GPU memory a
round took, and CUDA running out of memory said in one line.

``device: cuda`` is a request; a tensor a family creates without ``device=`` still lands on the
CPU and trains there, slowly and silently. The round's metrics carry what was measured, so a
run's records (and ``benchmarks/gpu_check.py``) show it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

#: How deep to look for tensors from the family: its attributes (a model, a tensor of
#: documents) and theirs (a scikit-learn-style model's ``model_``, ``head_``).
SEARCH_DEPTH = 2
#: Items of a list looked at: lists of layers are short, and a list of documents must not
#: cost a round a pass over it.
LIST_ITEMS = 64
#: Rounds a worker trains between two looks (its first is looked at): a look walks the
#: family's tensors in Python, 0.4 ms on ProdLDA, 6 % of a synchronous worker's time when taken
#: every round.
CHECK_EVERY = 10


def check_due(trained: int) -> bool:
    """Whether the ``trained``-th round this worker trains (from 1) is one whose tensors
    :func:`tensors_on_gpu` counts."""
    return (trained - 1) % CHECK_EVERY == 0


def _tensors(obj: Any, depth: int, seen: set[int]) -> Iterator[Any]:
    torch = sys.modules["torch"]
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < SEARCH_DEPTH:
        for item in obj[:LIST_ITEMS]:
            yield from _tensors(item, depth + 1, seen)
    elif depth < SEARCH_DEPTH and hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from _tensors(value, depth + 1, seen)


def tensors_on_gpu(family: Any) -> float | None:
    """The share of the elements of ``family``'s torch tensors (model parameters, buffers,
    tensors it holds) that live on a CUDA device; None where it holds none (a family that
    does not use torch)."""
    if "torch" not in sys.modules:
        return None
    total = on_gpu = 0
    seen: set[int] = set()
    for value in vars(family).values():
        for t in _tensors(value, 1, seen):
            total += t.numel()
            on_gpu += t.numel() if t.is_cuda else 0
    return on_gpu / total if total else None


def reset_peak(device: str) -> None:
    """Start counting this round's peak GPU memory (nothing on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device: str) -> float | None:
    """The most GPU memory allocated since :func:`reset_peak`, in MiB; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / 2 ** 20


class GPUMemoryError(RuntimeError):
    """CUDA ran out of memory in a round; the message is one line saying what to lower."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA running out of memory."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def out_of_memory_message(worker_id: str, device: str, round_: int, family: str,
                          params: dict[str, Any], source: str) -> str:
    """One line: where memory ran out, and what to lower."""
    batch = params.get("batch_size")
    lower = (f"lower model.batch_size (now {batch}) in {source}" if batch is not None else
             f"make the model smaller in {source}")
    return (f"{worker_id}: CUDA out of memory on {device} in round {round_} ({family}): "
            f"{lower}, or set this worker's device: cpu")
