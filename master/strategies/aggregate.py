"""Math shared by the aggregation strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Arrays = Mapping[str, np.ndarray]


def weighted_average(arrays: Sequence[Arrays], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Σ w_i · Θ_i / Σ w_i, array by array, in each array's own dtype.

    Parameters
    ----------
    arrays : sequence of mappings of str to numpy.ndarray
        One mapping per client, all with the same names and shapes.
    weights : sequence of float
        One non-negative weight per client; at least one must be positive.
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
        first = arrays[0][name]
        acc = np.multiply(first, w[0], dtype=np.result_type(first.dtype, np.float32))
        for wi, a in zip(w[1:], arrays[1:], strict=True):
            acc += wi * a[name]
        out[name] = acc.astype(first.dtype, copy=False)
    return out
