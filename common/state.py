"""State trees: nested dicts and lists of tensors, arrays and scalars, in an ``.npz`` archive.

A worker's local state (an optimizer's ``state_dict()``, a generator's state, a topic model's
assignments) is such a tree. :func:`pack` splits one into a JSON document, in which every array
or tensor is replaced by a reference, and the arrays themselves; :func:`save` and :func:`load`
put both in one ``.npz`` file read with ``allow_pickle=False``. ``torch.save`` would pickle,
and ``torch.load(weights_only=True)`` cannot take the numpy generator states and int-keyed
dicts these trees hold: this is the small piece that can.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from common.atomic import atomic_write

_META = "__tree__"


def pack(tree: Any, copy: bool = True) -> tuple[Any, dict[str, np.ndarray]]:
    """``tree`` as a JSON-able document and its arrays: copies, safe to keep while the
    objects they came from change, or with ``copy=False`` views of them (for a write that
    ends before they change).

    Dicts keep their keys' types (an optimizer's state is keyed by int), tuples come back as
    lists, tensors as tensors (on the CPU) and numpy arrays as numpy arrays.
    """
    arrays: dict[str, np.ndarray] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            name = f"a{len(arrays)}"
            arrays[name] = np.array(x, copy=True) if copy else x
            return {"a": name}
        if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
            name = f"a{len(arrays)}"
            a = x.detach().cpu().numpy()
            arrays[name] = a.copy() if copy else a
            return {"t": name}
        if isinstance(x, Mapping):
            return {"d": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"l": [walk(v) for v in x]}
        if isinstance(x, np.generic):
            x = x.item()
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        raise TypeError(f"cannot pack a {type(x).__name__} into a state tree")

    return walk(tree), arrays


def unpack(doc: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The tree :func:`pack` split into ``doc`` and ``arrays``."""

    def walk(x: Mapping[str, Any]) -> Any:
        if "a" in x:
            return np.array(arrays[x["a"]], copy=True)
        if "t" in x:
            import torch

            return torch.from_numpy(np.array(arrays[x["t"]], copy=True))
        if "d" in x:
            return {walk(k): walk(v) for k, v in x["d"]}
        if "l" in x:
            return [walk(v) for v in x["l"]]
        return x["v"]

    return walk(doc)


def save(path: str | Path, tree: Any, header: Mapping[str, Any] | None = None) -> None:
    """Write ``tree`` (and a JSON-able ``header``) to ``path`` atomically.

    Not fsynced: these files outlive a killed process (the page cache keeps them), which is
    what they are for; a power cut costs at most the newest one.
    """
    doc, arrays = pack(tree, copy=False)  # written at once: a snapshot of 200 MB copied twice
    meta = json.dumps({"header": dict(header or {}), "tree": doc}).encode()

    def write(fh: BinaryIO) -> None:
        np.savez(fh, **arrays, **{_META: np.frombuffer(meta, dtype=np.uint8)})

    atomic_write(path, write, durable=False)


def load(path: str | Path) -> tuple[dict[str, Any], Any]:
    """``(header, tree)`` from a file :func:`save` wrote; ValueError for any other file."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z[_META].tobytes().decode())
            arrays = {k: z[k] for k in z.files if k != _META}
        return dict(meta["header"]), unpack(meta["tree"], arrays)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a state file ({type(exc).__name__}: {exc})") from None


def generator_state(gen: Any) -> Any:
    """The state of a numpy ``Generator`` or a torch ``Generator``, as a tree."""
    if isinstance(gen, np.random.Generator):
        return {"numpy": gen.bit_generator.state}
    return {"torch": gen.get_state()}


def set_generator_state(gen: Any, state: Mapping[str, Any]) -> None:
    """Give ``gen`` back what :func:`generator_state` took."""
    if "numpy" in state:
        gen.bit_generator.state = state["numpy"]
    else:
        gen.set_state(state["torch"])
