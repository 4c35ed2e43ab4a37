"""Math shared by the aggregation strategies, the model families and their simulations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Arrays = Mapping[str, np.ndarray]

#: Elements per block of the blocked loops below (1 MiB of float32: about an L2 cache).
CHUNK = 1 << 18


def weighted_average(arrays: Sequence[Arrays], weights: Sequence[float],
                     accumulate: np.dtype | type | None = None) -> dict[str, np.ndarray]:
    """Σ w_i · Θ_i / Σ w_i, array by array, returned in each array's own dtype.

    Parameters
    ----------
    arrays : sequence of mappings of str to numpy.ndarray
        One mapping per client, all with the same names and shapes. Summed in the given
        order, so the same inputs always give the same bits.
    weights : sequence of float
        One non-negative weight per client; at least one must be positive.
    accumulate : dtype, optional
        Dtype of the running sum; default: the array's own, at least float32 (``float64``
        where the result must match a centralized computation closely).
    """
    if not arrays:
        raise ValueError("nothing to aggregate")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(arrays),) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be {len(arrays)} finite non-negative numbers with a "
                         "positive sum")
    w = w / w.sum()
    out: dict[str, np.ndarray] = {}
    for name in arrays[0]:
        first = np.asarray(arrays[0][name])
        acc_dtype = np.dtype(accumulate or np.result_type(first.dtype, np.float32))
        flat = [np.asarray(a[name]).reshape(-1) for a in arrays]
        acc = np.empty(first.size, dtype=acc_dtype)
        scratch = np.empty(min(first.size, CHUNK), dtype=acc_dtype)
        # Block by block, so that the running sum and its scratch stay in cache and no
        # model-sized temporary is allocated (at 25 M parameters: 3x faster).
        for lo in range(0, first.size, CHUNK):
            hi = min(lo + CHUNK, first.size)
            a, t = acc[lo:hi], scratch[: hi - lo]
            np.multiply(flat[0][lo:hi], w[0], out=a, casting="unsafe")
            for wi, x in zip(w[1:], flat[1:], strict=True):
                np.multiply(x[lo:hi], wi, out=t, casting="unsafe")
                a += t
        out[name] = acc.reshape(first.shape).astype(first.dtype, copy=False)
    return out


def all_finite(a: np.ndarray) -> bool:
    """``np.isfinite(a).all()`` without a mask the size of ``a`` (blocks of ``CHUNK``)."""
    flat = np.asarray(a).reshape(-1)
    if flat.dtype.kind not in "fc":
        return True
    mask = np.empty(min(flat.size, CHUNK), dtype=bool)
    for lo in range(0, flat.size, CHUNK):
        hi = min(lo + CHUNK, flat.size)
        if not np.isfinite(flat[lo:hi], out=mask[: hi - lo]).all():
            return False
    return True
