"""The message format: multipart frames ``[topic][msgpack header][raw array buffer]...``.

Transport-free: this module turns a message into frames and frames back into a message, and
knows nothing of sockets. See docs/PROTOCOL.md for the format and the message catalogue.

* Frame 0 is the topic: the PUB topic a subscriber filters on, or on REQ/REP the message kind.
* Frame 1 is a msgpack map ``{"v": version, "kind": str, "body": map, "arrays": [[name, dtype,
  shape], ...]}``.
* Frames 2... are the arrays' raw bytes, C order, one frame per array, in header order.

Arrays go out as views of their own memory (no copy here; the socket layer decides whether
ZeroMQ copies) and come back with :func:`numpy.frombuffer` on the received frame, so they are
read-only views. Nothing that comes off the network is ever unpickled: msgpack carries plain
data, and dtypes are limited to fixed-size numeric, boolean, byte-string and unicode types.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from common.constants import MAX_ARRAYS, MAX_HEADER_BYTES, MAX_HEADER_CONTAINERS, PROTOCOL_VERSION
from common.net import errors
from common.net.errors import ProtocolError

#: No array's declared size may reach this (numpy's own limit is 2**63 bytes); a real one is
#: bounded far lower by the message limit, which an empty array does not meet.
MAX_ARRAY_BYTES = 2**62
# Fixed-size dtypes only: 'O' (object) would need pickling and 'V' (void/structured) can smuggle
# objects, so neither is ever accepted.
_DTYPE_RE = re.compile(r"^[<>|=]?(?:[biufc]\d{1,2}|[SU]\d{1,9}|[mM]8(?:\[\d*[a-zA-Z]{1,2}\])?)$")


@dataclass
class Message:
    """A decoded message.

    Attributes
    ----------
    kind : str
        Message kind, e.g. ``"update"``.
    body : dict
        Plain metadata (msgpack types only).
    arrays : dict of str to numpy.ndarray
        Named arrays, in the order they were sent. Received arrays are read-only views of the
        frames they arrived in.
    topic : bytes
        Frame 0.
    """

    kind: str
    body: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    topic: bytes = b""

    @property
    def nbytes(self) -> int:
        """Bytes of array payload carried."""
        return sum(a.nbytes for a in self.arrays.values())


def check_dtype(dtype: str) -> np.dtype:
    """Parse a dtype string from the network, refusing anything that is not plain data.

    Raises
    ------
    ProtocolError
        With code ``"dtype"`` for an unsupported or unsafe dtype.
    """
    if not isinstance(dtype, str) or not _DTYPE_RE.fullmatch(dtype):
        raise ProtocolError(f"unsupported dtype {dtype!r}", code=errors.DTYPE)
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):  # matches the pattern, but numpy has no such type ("<f3")
        raise ProtocolError(f"unsupported dtype {dtype!r}", code=errors.DTYPE) from None
    if dt.itemsize == 0 or dt.hasobject:
        raise ProtocolError(f"unsupported dtype {dtype!r}", code=errors.DTYPE)
    return dt


def encode(
    kind: str,
    body: Mapping[str, Any] | None = None,
    arrays: Mapping[str, np.ndarray] | None = None,
    topic: bytes | None = None,
) -> list[Any]:
    """Turn a message into frames ready for ``socket.send_multipart(frames, copy=False)``.

    Parameters
    ----------
    kind : str
        Message kind.
    body : mapping, optional
        Metadata; must be msgpack-serializable (str, int, float, bool, None, bytes, list, dict).
    arrays : mapping of str to numpy.ndarray, optional
        Arrays to carry. Contiguous arrays are sent from their own memory without a copy, so they
        must not be modified until the send has completed.
    topic : bytes, optional
        Frame 0; defaults to the kind, encoded.

    Returns
    -------
    list
        ``[topic, header, buffer, ...]``.
    """
    specs = []
    buffers = []
    for name, arr in (arrays or {}).items():
        arr = np.asarray(arr)
        dt = check_dtype(arr.dtype.str)
        shape = list(arr.shape)  # taken first: ascontiguousarray turns 0-d arrays into 1-d
        arr = np.ascontiguousarray(arr)
        specs.append([str(name), dt.str, shape])
        # A flat byte view of the array's own memory: works for 0-d and empty arrays alike.
        buffers.append(arr.reshape(-1).view(np.uint8))
    header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": kind, "body": dict(body or {}), "arrays": specs},
        use_bin_type=True,
    )
    return [topic if topic is not None else kind.encode(), header, *buffers]


def _as_buffer(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer (no copy); bytes and memoryviews pass through.
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf)


class _ContainerBudget:
    """msgpack hook that counts the lists and maps a header builds and stops the decoding
    past ``limit``: a header's size alone does not bound its memory (one byte, one list)."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def __call__(self, obj: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _TooManyContainers
        return obj


class _TooManyContainers(Exception):
    pass


def decode(frames: Sequence[Any], max_header: int = MAX_HEADER_BYTES,
           max_containers: int = MAX_HEADER_CONTAINERS) -> Message:
    """Turn received frames back into a :class:`Message`, validating everything.

    Parameters
    ----------
    frames : sequence of bytes-like
    max_header : int, default constants.MAX_HEADER_BYTES
        Largest header accepted, in bytes.
    max_containers : int, default constants.MAX_HEADER_CONTAINERS
        Most lists and maps the header may build; decoding stops at the first one over.

    Raises
    ------
    ProtocolError
        With a one-line message and a code: ``"malformed"`` (truncated, not msgpack, bad
        header), ``"too_large"`` (a header over a limit), ``"version"`` (another protocol
        version), ``"dtype"`` or ``"shape"`` (an array spec that does not match its buffer).
    """
    if len(frames) < 2:
        raise ProtocolError(
            f"truncated message: {len(frames)} frame(s), expected at least 2 (topic, header)"
        )
    if len(frames) > MAX_ARRAYS + 2:
        raise ProtocolError(f"message of {len(frames)} frames: at most {MAX_ARRAYS} arrays",
                            code=errors.TOO_LARGE)
    topic = bytes(_as_buffer(frames[0]))
    raw = _as_buffer(frames[1])
    if raw.nbytes > max_header:
        raise ProtocolError(f"header of {raw.nbytes} bytes exceeds {max_header}",
                            code=errors.TOO_LARGE)
    budget = _ContainerBudget(max_containers)
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                                 list_hook=budget, object_hook=budget,
                                 max_array_len=max_containers, max_map_len=max_containers)
    except _TooManyContainers:
        raise ProtocolError(f"header builds more than {max_containers} lists and maps",
                            code=errors.TOO_LARGE) from None
    except ValueError as exc:
        if "exceeds max" in str(exc):  # msgpack's own length limits
            raise ProtocolError(f"header holds a list or map of more than {max_containers} "
                                "entries", code=errors.TOO_LARGE) from None
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__})") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1, 1.0 == 1
        raise ProtocolError(
            f"protocol version {version!r} not supported (this peer speaks {PROTOCOL_VERSION})",
            code=errors.VERSION,
        )
    kind, body, specs = header.get("kind"), header.get("body", {}), header.get("arrays", [])
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("header has no message kind")
    if not isinstance(body, dict):
        raise ProtocolError("header body is not a map")
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise ProtocolError("header array list is malformed or too long")
    if len(specs) != len(frames) - 2:
        raise ProtocolError(
            f"truncated message: header announces {len(specs)} array(s), "
            f"{len(frames) - 2} buffer frame(s) arrived"
        )
    arrays: dict[str, np.ndarray] = {}
    for spec, frame in zip(specs, frames[2:], strict=True):
        name, dt, shape = _check_spec(spec)
        if name in arrays:
            raise ProtocolError(f"array {name!r} appears twice")
        buf = _as_buffer(frame)
        expected = math.prod(shape) * dt.itemsize
        if buf.nbytes != expected:
            raise ProtocolError(
                f"array {name!r}: shape {tuple(shape)} of {dt.str} needs {expected} bytes, "
                f"frame has {buf.nbytes}",
                code=errors.SHAPE,
            )
        try:
            arr = np.frombuffer(buf, dtype=dt).reshape(shape)
        except ValueError as exc:  # whatever numpy still cannot make of it
            raise ProtocolError(f"array {name!r}: {exc}", code=errors.SHAPE) from None
        arr.flags.writeable = False  # a view of the received frame: nobody writes into it
        arrays[name] = arr
    return Message(kind=kind, body=body, arrays=arrays, topic=topic)


def _check_spec(spec: Any) -> tuple[str, np.dtype, list[int]]:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise ProtocolError("array spec is not [name, dtype, shape]")
    name, dtype, shape = spec
    if not isinstance(name, str):
        raise ProtocolError("array name is not a string")
    dt = check_dtype(dtype)
    if not (
        isinstance(shape, list)
        and len(shape) <= 32
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
    ):
        raise ProtocolError(f"array {name!r}: shape {shape!r} is not a list of sizes",
                            code=errors.SHAPE)
    # An empty array may still name sizes numpy cannot hold ([2**39, 2**39, 0]): its other
    # sizes must multiply to something an array could have.
    if math.prod(d for d in shape if d) * dt.itemsize >= MAX_ARRAY_BYTES:
        raise ProtocolError(f"array {name!r}: shape {shape!r} is larger than any array",
                            code=errors.SHAPE)
    return name, dt, shape


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size of a list of frames, in bytes (what goes on the wire, less ZMTP framing)."""
    return sum(_as_buffer(f).nbytes for f in frames)
