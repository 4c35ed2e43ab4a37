"""Update compression: fewer bytes from each worker to the master.

Workers send the change of their parameters against the global model they started from
(Δ = Θ_i − Θ), compressed; the master rebuilds Θ_i = Θ + decode(Δ) before validating and
aggregating, so strategies never see compressed data.

=========  =============================================  ==================================
kind       what travels per float array                   bytes (float32 = 4 per value)
=========  =============================================  ==================================
none       Θ_i itself                                     4 per value
float16    Δ as float16                                   2 per value
int8       Δ as int8 with one float32 scale (symmetric)   1 per value
topk       the ``fraction`` largest |Δ| (indices+values)  8 per kept value
=========  =============================================  ==================================

int8 and top-k keep **error feedback** on the worker (Seide et al. 2014; Stich et al. 2018): what
was dropped this round is added to next round's Δ, so nothing is lost for good. Arrays that are
not floating point always travel as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from common.net import errors
from common.net.wire import ProtocolError

KINDS = ("none", "float16", "int8", "topk")
_IDX, _VAL, _SCALE = "#idx", "#val", "#scale"


@dataclass
class Compressor:
    """Worker side: compress updates, remembering what was dropped.

    Parameters
    ----------
    kind : {"none", "float16", "int8", "topk"}, default "none"
    fraction : float, default 0.01
        Share of each array's values top-k keeps (at least one).

    Attributes
    ----------
    residual_ : dict of str to numpy.ndarray
        Error-feedback memory (int8, top-k).
    """

    kind: str = "none"
    fraction: float = 0.01
    residual_: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"compression: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"compression fraction must be in (0, 1], got {self.fraction}")

    def compress(self, new: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]
                 ) -> dict[str, np.ndarray]:
        """Arrays to send for parameters ``new`` trained from the global ``base``."""
        if self.kind == "none":
            return dict(new)
        out: dict[str, np.ndarray] = {}
        for name, value in new.items():
            if value.dtype.kind != "f" or name not in base:
                out[name] = value
                continue
            delta = value.astype(np.float32) - base[name].astype(np.float32)
            if self.kind == "float16":
                out[name] = delta.astype(np.float16)
                continue
            delta += self.residual_.get(name, 0.0)
            if self.kind == "int8":
                scale = float(np.abs(delta).max()) / 127 or 1.0
                q = np.clip(np.rint(delta / scale), -127, 127).astype(np.int8)
                out[name] = q
                out[name + _SCALE] = np.float32(scale)
                self.residual_[name] = delta - q.astype(np.float32) * scale
            else:  # topk
                flat = delta.reshape(-1)
                k = max(1, int(round(self.fraction * flat.size)))
                idx = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
                idx = np.sort(idx).astype(np.int64)
                out[name + _IDX] = idx
                out[name + _VAL] = flat[idx]
                kept = np.zeros_like(flat)
                kept[idx] = flat[idx]
                self.residual_[name] = (flat - kept).reshape(delta.shape)
        return out


def decompress(kind: str, received: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]
               ) -> dict[str, np.ndarray]:
    """Master side: rebuild a worker's parameters from what it sent and the global ``base``.

    Raises
    ------
    ProtocolError
        ``bad_field`` for an unknown kind; ``shape`` / ``dtype`` for arrays that cannot be
        what the kind says (missing parts, indices out of range, wrong sizes).
    """
    if kind == "none":
        return dict(received)
    if kind not in KINDS:
        raise ProtocolError(f"update: unknown compression {kind!r}", code=errors.BAD_FIELD)
    out: dict[str, np.ndarray] = {}
    for name, ref in base.items():
        if ref.dtype.kind != "f":
            if name in received:
                out[name] = received[name]
            continue
        try:
            if kind == "float16":
                delta = _expect(received, name, ref.shape, "f2").astype(np.float32)
            elif kind == "int8":
                q = _expect(received, name, ref.shape, "i1")
                scale = _expect(received, name + _SCALE, (), "f4")
                delta = q.astype(np.float32) * np.float32(scale)
            else:
                idx = _expect(received, name + _IDX, None, "i8")
                if idx.ndim != 1 or idx.size > ref.size:
                    raise ProtocolError(f"array {name!r}: {idx.size} top-k pairs for "
                                        f"{ref.size} values", code=errors.SHAPE)
                val = _expect(received, name + _VAL, idx.shape, "f4")
                if idx.size and (idx.min() < 0 or idx.max() >= ref.size):
                    raise ProtocolError(f"array {name!r}: top-k indices out of range",
                                        code=errors.SHAPE)
                delta = np.zeros(ref.size, np.float32)
                delta[idx] = val
                delta = delta.reshape(ref.shape)
        except KeyError as exc:
            raise ProtocolError(f"update: compressed array {exc.args[0]!r} is missing",
                                code=errors.SHAPE) from None
        out[name] = (ref.astype(np.float32) + delta).astype(ref.dtype)
    return out


def _expect(arrays: Mapping[str, np.ndarray], name: str, shape: tuple | None, dtype: str
            ) -> np.ndarray:
    a = arrays[name]
    if a.dtype != np.dtype(dtype):
        raise ProtocolError(f"array {name!r}: dtype {a.dtype}, compression needs {dtype}",
                            code=errors.DTYPE)
    if shape is not None and a.shape != tuple(shape):
        raise ProtocolError(f"array {name!r}: shape {a.shape}, expected {tuple(shape)}",
                            code=errors.SHAPE)
    return a
