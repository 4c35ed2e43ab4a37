"""Partition schemes beyond ``common.data.partition``'s: the FedNMF paper's label skew.

:func:`dirichlet_equal` gives K clients the same number of documents each, with each client's
label proportions drawn from Dir(alpha * p), p the label distribution of the whole corpus (Si et
al. 2022 after Hsu et al. 2019). Small alpha: each client holds few labels; large alpha: every
client looks like the whole corpus.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dirichlet_equal"]


def dirichlet_equal(y: np.ndarray, n_parts: int, alpha: float = 1.0, seed: int = 0,
                    size: int | None = None) -> list[np.ndarray]:
    """K equal-sized parts whose label proportions are drawn from Dir(alpha * p).

    Each part k draws its proportions q_k ~ Dir(alpha * p), p the corpus's label frequencies.
    The parts then take documents in turns, one at a time: part k draws a label from q_k
    restricted to the labels with documents left (renormalized), and takes a random unused
    document of that label. Taking turns spreads the exhaustion of a popular label over all
    parts instead of starving the last ones.

    Parameters
    ----------
    y : numpy.ndarray
        One label per document (any hashable values).
    n_parts : int
        Number of parts K, 1 <= K <= len(y).
    alpha : float, default 1.0
        Concentration; the paper sweeps 0.1 to 100.
    seed : int, default 0
    size : int or None, default None
        Documents per part; default ``len(y) // n_parts`` (the remaining < K documents are
        left out).

    Returns
    -------
    list of numpy.ndarray
        ``n_parts`` sorted, disjoint int64 arrays of row indices, each of length ``size``.

    Raises
    ------
    ValueError
        Bad ``n_parts``, ``alpha`` or ``size``.
    """
    y = np.asarray(y)
    n = len(y)
    if not 1 <= n_parts <= n:
        raise ValueError(f"n_parts must be between 1 and the number of rows ({n}), got {n_parts}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    size = n // n_parts if size is None else size
    if not 1 <= size <= n // n_parts:
        raise ValueError(f"size must be between 1 and {n // n_parts}, got {size}")
    rng = np.random.default_rng(seed)
    labels, codes = np.unique(y, return_inverse=True)
    pools = [list(rng.permutation(np.flatnonzero(codes == c))) for c in range(len(labels))]
    left = np.array([len(p) for p in pools], dtype=np.float64)
    prior = left / n
    q = rng.dirichlet(alpha * prior, size=n_parts)
    # Dir with tiny concentrations can underflow to exact zeros (or NaN); any label may be
    # needed once others run out, so keep a floor far below any real proportion.
    q = np.nan_to_num(q, nan=0.0) + 1e-12
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    u = rng.random((size, n_parts))
    for t in range(size):
        for k in range(n_parts):
            w = q[k] * (left > 0)
            c = int(np.searchsorted(np.cumsum(w), u[t, k] * w.sum(), side="right"))
            c = min(c, len(labels) - 1)
            while left[c] == 0:  # float edge at the top of the cumulative sum
                c -= 1
            parts[k].append(pools[c].pop())
            left[c] -= 1
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
