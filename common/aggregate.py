"""Math shared by the aggregation strategies, the model families and their simulations."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.linalg import blas

Arrays = Mapping[str, np.ndarray]

#: Elements per block of the blocked loops below (1 MiB of float32: about an L2 cache).
CHUNK = 1 << 18

#: In-place y += a·x for the dtypes BLAS has; others take two numpy passes.
_AXPY = {np.dtype(np.float32): blas.saxpy, np.dtype(np.float64): blas.daxpy}


# hand-written: no library recycles arrays by refcount; fresh memory's page faults cost more
class BufferPool:
    """Model-sized output arrays, recycled once nothing else references them.

    An aggregate in fresh memory pays for first-touch page faults, which on a virtual machine
    whose host reclaims freed guest memory cost up to 250 ms per 100 MB (measured at 25 M
    parameters: aggregation 40 ms in recycled memory, 40-300 ms in fresh). A buffer is handed
    out again only when the pool holds the last reference to it: not while it is the global
    model, is being checkpointed, or sits in a zero-copy send that libzmq has not finished.

    Parameters
    ----------
    size : int, default 3
        Buffers kept per parameter: the global model's, the one still being checkpointed or
        sent, and the one to write into.
    """

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self._buffers: dict[str, list[np.ndarray]] = {}
        probe = [np.empty(0)]
        self._unreferenced = sys.getrefcount(probe[0])  # the list's and the call's own

    def take(self, name: str, n: int, dtype: np.dtype) -> np.ndarray:
        """A flat writable array of ``n`` elements of ``dtype`` for the parameter ``name``,
        that nobody else references."""
        bufs = self._buffers.setdefault(name, [])
        for i in range(len(bufs)):
            if (bufs[i].size == n and bufs[i].dtype == dtype
                    and sys.getrefcount(bufs[i]) <= self._unreferenced):
                buf = bufs.pop(i)
                bufs.append(buf)  # most recently used last
                return buf
        if len(bufs) >= self.size:  # all still held elsewhere: their holders will free them
            del bufs[0]
        buf = np.empty(n, dtype=dtype)
        bufs.append(buf)
        return buf


# hand-written: np.average makes model-sized temporaries; blocked axpy is ~3x faster, same bits
def weighted_average(arrays: Sequence[Arrays], weights: Sequence[float],
                     accumulate: np.dtype | type | None = None,
                     pool: BufferPool | None = None) -> dict[str, np.ndarray]:
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
    pool : BufferPool, optional
        Where the results' memory comes from (default: fresh arrays). The caller must treat
        the results as read-only: a later call may hand the same memory out again once
        nothing references it.
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
        acc = (pool.take(str(name), first.size, acc_dtype) if pool is not None
               else np.empty(first.size, dtype=acc_dtype))
        axpy = _AXPY.get(acc_dtype) if all(x.dtype == acc_dtype for x in flat) else None
        scratch = np.empty(min(first.size, CHUNK), dtype=acc_dtype) if axpy is None else None
        # Block by block, so that the running sum stays in cache and no model-sized
        # temporary is allocated; with BLAS's fused a += w·x, 25 M parameters from 3
        # clients average in 25 ms instead of 70.
        for lo in range(0, first.size, CHUNK):
            hi = min(lo + CHUNK, first.size)
            a = acc[lo:hi]
            np.multiply(flat[0][lo:hi], acc_dtype.type(w[0]), out=a, casting="unsafe")
            for wi, x in zip(w[1:], flat[1:], strict=True):
                if scratch is None:
                    axpy(x[lo:hi], a, a=wi)  # in place: a is contiguous and of its dtype
                else:
                    t = scratch[: hi - lo]
                    np.multiply(x[lo:hi], wi, out=t, casting="unsafe")
                    a += t
        out[name] = acc.reshape(first.shape).astype(first.dtype, copy=False)
        if pool is not None and out[name].base is acc:
            out[name].flags.writeable = False  # its memory will be handed out again
    return out


# hand-written: np.isfinite(a).all() allocates a mask the size of a; this uses one block
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


# --------------------------------------------------------------------------------------------
# Robust statistics of the clients' arrays (FedMedian, trimmed mean, Krum). Unweighted, as in
# Flower (flwr/server/strategy/aggregate.py): a robust rule must not let a client's claimed
# sample count buy it influence.
# --------------------------------------------------------------------------------------------
def coordinate_median(arrays: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """The coordinate-wise median of the clients' arrays, each in its own dtype."""
    if not arrays:
        raise ValueError("nothing to aggregate")
    return {name: np.median(np.stack([np.asarray(a[name]) for a in arrays]), axis=0)
            .astype(np.asarray(arrays[0][name]).dtype, copy=False) for name in arrays[0]}


def trimmed_mean(arrays: Sequence[Arrays], beta: float) -> dict[str, np.ndarray]:
    """The coordinate-wise mean of what is left after cutting ``int(beta · n)`` of the ``n``
    values from each end (scipy's ``trim_mean``, as Flower's FedTrimmedAvg computes it)."""
    from scipy.stats import trim_mean

    if not arrays:
        raise ValueError("nothing to aggregate")
    if not 0 <= beta < 0.5:
        raise ValueError(f"beta must be in [0, 0.5), got {beta}")
    return {name: np.asarray(trim_mean(np.stack([np.asarray(a[name]) for a in arrays]), beta,
                                       axis=0))
            .astype(np.asarray(arrays[0][name]).dtype, copy=False) for name in arrays[0]}


def squared_distances(arrays: Sequence[Arrays]) -> np.ndarray:
    """The clients' pairwise squared Euclidean distances, all their arrays as one vector."""
    n = len(arrays)
    if n == 0:
        raise ValueError("nothing to aggregate")
    # ||x_i − x_j||² = |x_i|² + |x_j|² − 2 x_i·x_j, from the Gram matrix, array by array.
    gram = np.zeros((n, n))
    for name in arrays[0]:
        flat = np.stack([np.asarray(a[name], dtype=np.float64).reshape(-1) for a in arrays])
        gram += flat @ flat.T
    sq = np.diag(gram)
    return np.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)


def krum_scores(arrays: Sequence[Arrays], num_malicious: int) -> np.ndarray:
    """Krum's score of each client (Blanchard et al. 2017): the sum of the squared distances
    from its arrays (all of them, as one vector) to its ``n − f − 2`` nearest (at least 1)."""
    dist = squared_distances(arrays)
    n = len(arrays)
    closest = max(1, n - num_malicious - 2)
    return np.array([np.sort(np.delete(dist[i], i))[:closest].sum() for i in range(n)])


def nearest_neighbor_mixing(arrays: Sequence[Arrays], num_malicious: int
                            ) -> list[dict[str, np.ndarray]]:
    """Each client's arrays replaced by the unweighted mean of its ``n − f`` nearest clients'
    (itself among them): nearest-neighbour mixing (Allouah et al., AISTATS 2023).

    Under skewed data honest updates are far apart, and a median or a trimmed mean pushed one
    rank over by a single outlier is biased by that spread, round after round. Mixed, the
    honest updates move close together (each the mean of mostly honest ones) while an outlier
    stays out, so the robust rule applied next loses much less to a hostile minority; a
    mixed client can carry at most ``f / (n − f)`` of an outlier's pull. Ties in distance go
    to the client first in order, itself first.
    """
    n = len(arrays)
    dist = squared_distances(arrays)
    keep = max(1, n - num_malicious)
    mix = np.zeros((n, n))
    for i in range(n):
        order = np.argsort(dist[i], kind="stable")
        order = [i, *(j for j in order if j != i)][:keep]
        mix[i, order] = 1.0 / keep
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name in arrays[0]:
        first = np.asarray(arrays[0][name])
        dtype = first.dtype if first.dtype.kind == "f" else np.dtype(np.float64)
        flat = np.stack([np.asarray(a[name], dtype=dtype).reshape(-1) for a in arrays])
        mixed = mix.astype(dtype) @ flat
        for i in range(n):
            out[i][name] = mixed[i].reshape(first.shape)
    return out
