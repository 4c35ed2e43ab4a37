"""State trees: nested dicts and lists of tensors, arrays and scalars, in a safetensors file.

A worker's local state (an optimizer's ``state_dict()``, a generator's state, a topic model's
assignments) is such a tree. :func:`pack` splits one into a JSON document, in which every array
or tensor is replaced by a reference, and the arrays themselves; :func:`save` and :func:`load`
put both in one file in the safetensors layout (the arrays raw, the document in its metadata).
``torch.save`` would pickle, and ``torch.load(weights_only=True)`` cannot take the numpy
generator states and int-keyed dicts these trees hold: this is the small piece that can.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from common.atomic import atomic_write

#: The metadata entry that holds the tree's document and the caller's header.
_META = "fedctl_state"
#: The largest header safetensors reads (its own limit): beyond it, a file saves but won't load.
MAX_HEADER = 100_000_000
#: numpy's dtypes as the safetensors format names them (those state trees hold).
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32",
           "uint16": "U16", "uint8": "U8", "bool": "BOOL"}


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


def save(path: str | Path, tree: Any, header: Mapping[str, Any] | None = None,
         reuse: str | Path | None = None) -> None:
    """Write ``tree`` (and a JSON-able ``header``) to ``path`` atomically, over the file
    ``reuse`` if given (:func:`common.atomic.atomic_write`: an unwanted older file, whose pages
    are written over in place).

    Not fsynced: these files outlive a killed process (the page cache keeps them), which is
    what they are for. A power cut can leave the newest one wrong, all the more when it was
    written over an old file in place (its blocks are not ordered before the rename).
    """
    # hand-written writer (the reader is safetensors'): safetensors' save_file makes a new file,
    # and an old one written over is what makes a snapshot cheap (200 MB: 36 ms against 454)
    doc, arrays = pack(tree, copy=False)  # written at once: a snapshot of 200 MB copied twice
    entries: dict[str, Any] = {}
    raw: list[np.ndarray] = []
    offset = 0
    for name, a in arrays.items():
        a = np.asarray(a, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        kind = _DTYPES.get(a.dtype.name)  # (numpy's dtype.name is a slow property)
        if kind is None:
            raise TypeError(f"cannot save an array of {a.dtype} in a state file")
        entries[name] = {"dtype": kind, "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        raw.append(a.reshape(-1).view(np.uint8))
    entries["__metadata__"] = {_META: json.dumps({"header": dict(header or {}), "tree": doc})}
    head = json.dumps(entries).encode()
    head += b" " * (-len(head) % 8)  # the arrays start 8-byte aligned, as the format asks
    if len(head) > MAX_HEADER:
        raise ValueError(f"a state tree's document of {len(head):,} bytes: safetensors reads "
                         f"at most {MAX_HEADER:,} (put large data in arrays)")

    def write(fh: BinaryIO) -> None:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for a in raw:
            fh.write(a)

    atomic_write(path, write, durable=False, reuse=reuse)


def load(path: str | Path) -> tuple[dict[str, Any], Any]:
    """``(header, tree)`` from a file :func:`save` wrote; ValueError for any other file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta = json.loads(f.metadata()[_META])
            arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        return dict(meta["header"]), unpack(meta["tree"], arrays)
    except (OSError, KeyError, ValueError, TypeError, SafetensorError) as exc:
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
