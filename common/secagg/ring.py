"""Updates as elements of the ring Z/2^b (b = 32, or 16 with compression; 64 for the
synchronous steps' statistics), and sums of them back as floats.

A worker sends ``r * clip(x - g, -c, c)`` for each coordinate (``x`` its new model, ``g`` the
model of the round, ``r = n / n_max`` its weight, ``c`` the clipping range) and ``r`` itself,
each quantized to ``L + 1`` levels over ``[-c, c]``:

    q(v) = round((v + c) * L / (2c))                     in 0..L

``L = (2^b - 1) // n`` for a round of ``n`` participants, so that the sum of ``n`` quantized
values never wraps the ring: the masks cancel modulo 2^b and what is left is the plain sum.
Each value is off by at most ``c / L`` (half a level), so the sum of ``m`` contributions is off
by at most ``m * c / L`` per coordinate: for ``c`` = 8 (the default) and 10 workers, 1.9e-7
with b = 32; 1.2e-3 with b = 16 (then a smaller ``c``, near the largest change expected,
keeps it small: 7.6e-5 for ``c`` = 0.5).

A masked input is uniform on the ring, so no compressor can shrink it; what compression can
do is shrink the ring. ``compression: float16`` or ``int8`` give b = 16 (half the bytes of
b = 32); b = 8 would leave ``255 // n`` levels, too few for any model (:func:`ring_bits`).

b = 64 serves sums that must stay exact to float64's precision (the neural topic models'
synchronous steps: batch statistics and gradients, which Adam divides by their own size). Its
levels stop at ``L = (2^53 - 1) // n``, so that every quantized value and every sum is an integer
float64 holds exactly; the rounding of ``v + c`` in float64 adds at most ``c * 2^-52`` a value
(:func:`error_bound` counts it for every width; it matters only at b = 64).
"""

from __future__ import annotations

import numpy as np

#: The ring's modulus is 2^b: numpy's unsigned arithmetic of b bits wraps modulo it for free.
RING_DTYPES = {64: np.dtype("<u8"), 32: np.dtype("<u4"), 16: np.dtype("<u2")}
RING_DTYPE = RING_DTYPES[32]
#: The ring each ``compression.kind`` a secure round can compose with gives (top-k cannot:
#: a masked input must hold every coordinate).
COMPRESSION_BITS = {"none": 32, "float16": 16, "int8": 16}


def ring_bits(compression_kind: str) -> int:
    """The ring's width b for a job's ``compression.kind``; ValueError for top-k."""
    if compression_kind not in COMPRESSION_BITS:
        raise ValueError(f"compression {compression_kind} cannot compose with secure "
                         f"aggregation: a masked input holds every coordinate; use "
                         f"{', '.join(COMPRESSION_BITS)}")
    return COMPRESSION_BITS[compression_kind]


def levels(n_participants: int, bits: int = 32) -> int:
    """The number of quantization steps ``L`` for a round of ``n_participants`` on Z/2^bits."""
    if n_participants < 1:
        raise ValueError("a round has at least one participant")
    if bits == 64:  # beyond 2^53 float64 no longer holds every integer (module docstring)
        return (2**53 - 1) // n_participants
    return (2**bits - 1) // n_participants


#: Elements a pass over a long vector handles at a time: float64 blocks of 2 MiB stay in the
#: cache between the steps of a formula (a 25 M-parameter update is 200 MB in float64; whole-
#: vector numpy steps were most of a secure round's extra time, measured).
CHUNK = 1 << 18


def _blocks(size: int) -> range:
    return range(0, size, CHUNK)


def quantize(values: np.ndarray, clip: float, n_levels: int, bits: int = 32) -> np.ndarray:
    """``values`` (already within ``[-clip, clip]``; clipped again here) as elements of
    Z/2^bits."""
    v = np.asarray(values).reshape(-1)
    out = np.empty(v.size, dtype=RING_DTYPES[bits])
    scale = n_levels / (2.0 * clip)
    buf = np.empty(min(CHUNK, v.size), dtype=np.float64)
    for i in _blocks(v.size):
        b = buf[:min(CHUNK, v.size - i)]
        np.clip(v[i:i + CHUNK], -clip, clip, out=b)
        b += clip
        b *= scale
        np.rint(b, out=b)
        out[i:i + CHUNK] = b
    return out.reshape(np.shape(values))


def dequantize_sum(total: np.ndarray, count: int, clip: float, n_levels: int) -> np.ndarray:
    """The float sum of ``count`` values from the ring sum of their quantized forms."""
    t = np.asarray(total).reshape(-1)
    out = np.empty(t.size, dtype=np.float64)
    step, shift = 2.0 * clip / n_levels, count * clip
    for i in _blocks(t.size):
        b = out[i:i + CHUNK]
        b[:] = t[i:i + CHUNK]
        b *= step
        b -= shift
    return out.reshape(np.shape(total))


def error_bound(count: int, clip: float, n_levels: int) -> float:
    """The largest error of a dequantized sum of ``count`` values, per coordinate: half a
    level each, and float64's rounding of ``v + clip`` (module docstring)."""
    return count * (clip / n_levels + clip * 2.0**-52)


def to_vector(arrays: dict[str, np.ndarray], base: dict[str, np.ndarray], weight: float,
              clip: float) -> tuple[np.ndarray, float]:
    """A worker's contribution before quantization: ``weight * clip(x - g)`` for every
    coordinate of every array (in name order), then ``weight * clip`` (a weight is at most 1:
    scaled so, it fits the quantization range however small ``clip`` is; :func:`from_sum`
    divides it back); and the fraction of coordinates the clip changed."""
    if set(arrays) != set(base):
        raise ValueError(f"the update's arrays {sorted(arrays)} are not the model's "
                         f"{sorted(base)}")
    size = vector_size(base)
    out = np.empty(size, dtype=np.float64)
    at, clipped = 0, 0
    for name in sorted(base):
        x = np.asarray(arrays[name]).reshape(-1)
        g = np.asarray(base[name]).reshape(-1)
        for i in _blocks(x.size):
            d = out[at + i:at + min(i + CHUNK, x.size)]
            np.subtract(x[i:i + CHUNK], g[i:i + CHUNK], out=d, dtype=np.float64)
            clipped += int(np.count_nonzero(d > clip)) + int(np.count_nonzero(d < -clip))
            np.clip(d, -clip, clip, out=d)
            d *= weight
        at += x.size
    out[-1] = weight * clip
    return out, clipped / max(size - 1, 1)


def vector_size(base: dict[str, np.ndarray]) -> int:
    """The length of :func:`to_vector`'s output for a model."""
    return sum(int(np.asarray(a).size) for a in base.values()) + 1


def from_sum(total: np.ndarray, base: dict[str, np.ndarray], clip: float
             ) -> tuple[dict[str, np.ndarray], float]:
    """The weighted average model from the sum of the contributions: ``g + sum / weights``
    (each array in the model's dtype), and the sum of the weights."""
    weights = float(total[-1]) / clip
    if not weights > 0:
        raise ValueError("the weights sum to nothing")
    out, at = {}, 0
    for name in sorted(base):
        b = np.asarray(base[name])
        flat, new = b.reshape(-1), np.empty(b.size, dtype=b.dtype)
        for i in _blocks(b.size):
            step = total[at + i:at + min(i + CHUNK, b.size)] / weights
            step += flat[i:i + CHUNK]
            new[i:i + CHUNK] = step
        out[name] = new.reshape(b.shape)
        at += b.size
    return out, weights
