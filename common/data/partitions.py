"""Splitting a dataset among workers (iid, Dirichlet label skew, the FedNMF paper's equal-size
skew, fixed proportions) and each worker's own train / test split.

:func:`dirichlet_equal` gives K clients the same number of documents each, with each client's
label proportions drawn from Dir(alpha * p), p the label distribution of the whole corpus (Si et
al. 2022 after Hsu et al. 2019).
"""

from __future__ import annotations

import numpy as np

from common.data.reading import DataError

SCHEMES = ("iid", "dirichlet", "dirichlet_equal", "proportions")
_DIRICHLET_TRIES = 100


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


def _split_by_shares(idx: np.ndarray, shares: np.ndarray) -> list[np.ndarray]:
    """Cut ``idx`` into consecutive pieces with sizes proportional to ``shares``."""
    cuts = np.round(np.cumsum(shares)[:-1] / shares.sum() * len(idx)).astype(int)
    return np.split(idx, cuts)


def partition(
    y: np.ndarray,
    n_parts: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    proportions: list[float] | None = None,
    seed: int = 0,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Split the rows of a dataset among ``n_parts`` workers.

    Parameters
    ----------
    y : np.ndarray
        Labels, one per row (only used by ``"dirichlet"``; elsewhere only its length matters).
    n_parts : int
        Number of parts, 1 <= n_parts <= len(y).
    scheme : str, default "iid"
        ``"iid"``: seeded shuffle, then near-equal parts.
        ``"dirichlet"``: label skew (Hsu et al. 2019, as Flower's ``DirichletPartitioner``): each
        class's shuffled rows are split by shares p ~ Dir(alpha * 1); redrawn until every part
        has at least ``min_size`` rows.
        ``"dirichlet_equal"``: the FedNMF paper's skew (Si et al. 2022): equal parts whose
        label proportions are drawn from Dir(alpha * p), p the corpus's label frequencies
        (:func:`common.data.partitions.dirichlet_equal`; the ``len(y) % n_parts`` rows left over
        go to no part).
        ``"proportions"``: seeded shuffle, then fixed shares given by ``proportions``.
    alpha : float, default 0.5
        Dirichlet concentration; small values give very skewed parts, large values near-iid.
    proportions : list of float or None, default None
        Shares for ``"proportions"``, e.g. ``[0.6, 0.4]`` or ``[9, 1]`` (normalised); one
        positive number per part.
    seed : int, default 0
    min_size : int, default 10
        Smallest part allowed by ``"dirichlet"``.

    Returns
    -------
    list of np.ndarray
        ``n_parts`` sorted int64 arrays of row indices, disjoint and together covering all rows
        (all but fewer than ``n_parts`` with ``"dirichlet_equal"``).

    Raises
    ------
    DataError
        Bad ``n_parts``, scheme, ``alpha`` or ``proportions``; an empty part; or no Dirichlet draw
        meeting ``min_size`` in 100 tries.
    """
    y = np.asarray(y)
    n = len(y)
    if scheme not in SCHEMES:
        raise DataError(f"unknown partition scheme '{scheme}'; allowed: {', '.join(SCHEMES)}")
    if not 1 <= n_parts <= n:
        raise DataError(f"{n_parts} workers cannot share {n} document(s): at most one worker "
                        f"a document (fewer workers, or more data: data.limit)")
    rng = np.random.default_rng(seed)

    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), n_parts)

    elif scheme == "dirichlet_equal":
        if not alpha > 0:
            raise DataError(f"dirichlet alpha must be > 0, got {alpha}")
        parts = dirichlet_equal(y, n_parts, alpha=alpha, seed=seed)

    elif scheme == "proportions":
        if proportions is None or len(proportions) != n_parts:
            got = "none" if proportions is None else len(proportions)
            raise DataError(f"proportions needs one share per part ({n_parts}), got {got}")
        shares = np.asarray(proportions, dtype=float)
        if not np.all(np.isfinite(shares)) or np.any(shares <= 0):
            raise DataError(f"proportions must all be positive numbers, got {list(proportions)}")
        parts = _split_by_shares(rng.permutation(n), shares)
        sizes = [len(p) for p in parts]
        if min(sizes) == 0:
            raise DataError(f"proportions {list(proportions)} of {n} rows leave a part empty")

    else:  # dirichlet
        if not alpha > 0:
            raise DataError(f"dirichlet alpha must be > 0, got {alpha}")
        if min_size * n_parts > n:
            raise DataError(
                f"cannot give {n_parts} parts at least {min_size} rows each from {n} rows"
            )
        by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
        for _ in range(_DIRICHLET_TRIES):
            buckets: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
            for rows in by_class:
                shares = rng.dirichlet(np.full(n_parts, alpha))
                for bucket, piece in zip(
                    buckets, _split_by_shares(rng.permutation(rows), shares), strict=True
                ):
                    bucket.append(piece)
            parts = [np.concatenate(b) for b in buckets]
            if min(len(p) for p in parts) >= min_size:
                break
        else:
            raise DataError(
                f"dirichlet partition (alpha={alpha}) of {n} rows among {n_parts} workers left "
                f"one with fewer than {min_size} rows in {_DIRICHLET_TRIES} tries: raise "
                f"data.alpha, use fewer workers, or data.partition: iid"
            )

    return [np.sort(p).astype(np.int64) for p in parts]


def holdout_split(
    y: np.ndarray,
    rows: np.ndarray,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out part of a worker's shard (rows ``rows`` of the dataset) for local testing.

    Stratified by label when every class in the shard has at least 2 rows (and the split sizes
    allow it); otherwise a plain random split.

    Parameters
    ----------
    y : np.ndarray
        Labels of the full dataset.
    rows : np.ndarray
        Rows that make up this worker's shard.
    test_fraction : float, default 0.2
        Share of the shard held out, 0 < test_fraction < 1.
    seed : int, default 0

    Returns
    -------
    train_index, test_index : np.ndarray
        Sorted row indices into the full dataset.

    Raises
    ------
    DataError
        If ``test_fraction`` is out of range or the shard has fewer than 2 rows.
    """
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) < 2:
        raise DataError(f"a shard of {len(rows)} row(s) cannot be split into train and test")
    from sklearn.model_selection import train_test_split  # ~1 s: not at `fedctl` start-up

    y_s = np.asarray(y)[rows]
    _, counts = np.unique(y_s, return_counts=True)
    stratify = y_s if counts.min() >= 2 else None
    try:
        train, test = train_test_split(rows, test_size=test_fraction, random_state=seed,
                                       stratify=stratify)
    except ValueError:
        if stratify is None:
            raise
        # Too few test (or train) rows to hold one of each class: fall back to a plain split.
        train, test = train_test_split(rows, test_size=test_fraction, random_state=seed)
    return np.sort(train), np.sort(test)
