"""Which documents a worker holds: its own file, or its share of a dataset split among workers.

The worker and the master's centralized baseline both call :func:`local_data`, so a simulated
cluster and its baseline always see the very same rows.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from common.atomic import atomic_write_bytes
from common.config import ClusterConfig, ConfigError, WorkerConfig
from common.data.embedding import embed_texts
from common.data.partitions import holdout_split, partition
from common.data.reading import DataError, TextDataset, make_task, read_jsonl


@dataclass
class LocalData:
    """A worker's documents.

    Attributes
    ----------
    dataset : TextDataset
        The file the indices point into (the worker's own file, or the shared one).
    y : numpy.ndarray
        Task label of every row of ``dataset``.
    classes : list of str
        Class names, ``y`` indexes into them.
    train_index, test_index : numpy.ndarray
        Rows the worker trains on and the rows of its own held-out test split.
    shared : bool
        Whether these are the worker's share of the cluster's ``data.path`` (a simulated
        cluster), not a file of its own.
    """

    dataset: TextDataset
    y: np.ndarray
    classes: list[str]
    train_index: np.ndarray
    test_index: np.ndarray
    shared: bool = False

    @property
    def n_train(self) -> int:
        return len(self.train_index)

    @property
    def labelled(self) -> bool:
        """False for a file without labels: only the unsupervised families train on it, and
        the scores that need labels are skipped."""
        return self.dataset.labelled

    @property
    def train_texts(self) -> list[str]:
        """The texts of the training rows, in ``train_index`` order."""
        return [self.dataset.texts[i] for i in self.train_index]

    @property
    def test_texts(self) -> list[str]:
        """The texts of the held-out rows, in ``test_index`` order."""
        return [self.dataset.texts[i] for i in self.test_index]

    @property
    def y_train(self) -> np.ndarray:
        """Task labels of the training rows."""
        return np.asarray(self.y)[self.train_index]

    @property
    def y_test(self) -> np.ndarray:
        """Task labels of the held-out rows."""
        return np.asarray(self.y)[self.test_index]


def unlabelled_message(path: object, family: str) -> str:
    """The one-line error for a file without labels given to a family that needs them."""
    return (f"{path}: no 'label' on any row, but family {family} learns from labels "
            f"(the unsupervised families nmf, prodlda, combinedtm, fstc, lda and sentencelda "
            f"train on text alone)")


@lru_cache(maxsize=4)
def _load_task(path: str, limit: int | None, seed: int, task: str, positive: str | None
               ) -> tuple[TextDataset, np.ndarray, list[str]]:
    dataset = read_jsonl(path, limit=limit, seed=seed)
    y, classes = make_task(dataset.labels, task=task, positive=positive)
    return dataset, y, classes


def local_data(cfg: ClusterConfig, worker_id: str, data_path: str | None = None) -> LocalData:
    """The documents of worker ``worker_id``.

    With ``data_path`` (or ``workers[].data`` in the config) the worker holds that whole file.
    Otherwise ``data.path`` is partitioned among ``cfg.workers`` by ``data.partition`` and the
    worker takes the share at its position in the list.

    Raises
    ------
    ConfigError
        The worker is not in the config's worker list and has no file of its own.
    """
    d = cfg.data
    own = data_path
    if own is None and any(w.name == worker_id for w in cfg.workers):
        own = cfg.worker(worker_id).data
    if own is not None:
        dataset, y, classes = _load_task(str(own), d.limit, cfg.seed, d.task, d.positive)
        rows = np.arange(len(y))
        try:
            train, test = holdout_split(y, rows, d.test_fraction, cfg.seed)
        except DataError as exc:  # (it knows rows, not whose file they came from)
            raise DataError(f"{own} ({worker_id}'s data): {exc}") from None
        return LocalData(dataset, y, classes, train, test)

    names = [w.name for w in cfg.workers]
    if worker_id not in names:
        raise ConfigError(
            f"{cfg.source}: workers: {worker_id!r} is not a worker of this cluster and has no "
            f"data file of its own (known: {', '.join(names) or 'none'}; or pass --data)"
        )
    dataset, y, classes = _load_task(d.path, d.limit, cfg.seed, d.task, d.positive)
    # Skew by the documents' own labels, not the task's: with a one-vs-rest task that means
    # workers differ in which topics they hold, as readers of different subjects would.
    _, topic = np.unique(np.asarray(dataset.labels), return_inverse=True)
    parts = partition(topic, len(names), scheme=d.partition, alpha=d.alpha,
                      proportions=d.proportions, seed=cfg.seed)
    i = names.index(worker_id)
    try:
        train, test = holdout_split(y, parts[i], d.test_fraction, cfg.seed + i)
    except DataError as exc:
        raise DataError(f"{d.path}: {worker_id}'s share: {exc}") from None
    return LocalData(dataset, y, classes, train, test, shared=True)


def worker_seed(cfg: ClusterConfig, worker_id: str) -> int:
    """The seed of a worker's own randomness (its model's initialization, its batch order).

    The master's simulation baselines use it too, so they rebuild a worker's local-only model
    exactly.
    """
    names = [w.name for w in cfg.workers]
    return cfg.seed + 1000 + (names.index(worker_id) if worker_id in names else len(names))


def simulated(cfg: ClusterConfig) -> bool:
    """True when every worker takes a share of the shared dataset (so baselines can pool it)."""
    return bool(cfg.workers) and all(w.data is None for w in cfg.workers)


def sentence_features(cfg: ClusterConfig, dataset: TextDataset, device: str = "cpu",
                      progress: bool = False) -> np.ndarray:
    """Sentence-transformer features of every row of ``dataset`` (cached on disk).

    The whole file is embedded, not just one worker's rows, so that every process of a
    simulated cluster shares one cache entry and the model runs once per file.
    """
    return embed_texts(dataset.texts, model_path=cfg.data.embedding_model,
                       cache_dir=cfg.data.cache_dir, device=device, progress=progress,
                       backend=cfg.data.embedding_backend)


@dataclass
class ShardReport:
    """What :func:`write_shards` did: shard sizes, and which files changed."""

    sizes: dict[str, int] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


#: In a folder of shards, the files ``fedctl data shard`` wrote and their SHA-256: one it did
#: not write (a user's own documents) is never replaced without ``force``.
SHARD_MANIFEST = ".fedctl-shards.json"


def write_shards(cfg: ClusterConfig, out_dir: str | Path, names: list[str] | None = None,
                 among_named: bool = False, force: bool = False) -> ShardReport:
    """Cut ``data.path`` among workers into ``out_dir/<worker>.jsonl``, one file each.

    Each file holds exactly the documents (training and held-out rows) the worker would take
    from ``data.path`` in a simulated cluster of ``cfg.workers``, as ``{"text", "label"}``
    lines; a real cluster then gives each node its own file (``workers[].data``). ``names``
    picks whose files to write (default: every worker's); the cut is always among all of
    ``cfg.workers``, so one worker's file can be made again alone. A config without a worker
    list, or ``among_named``, cuts among ``names`` (a deployment whose other workers bring
    files of their own: ansible's shards mode). A file is rewritten, atomically, only when its
    content changed, so cutting again reports what changed; one this function did not write
    (``SHARD_MANIFEST``) only with ``force``.

    Raises
    ------
    ConfigError
        No workers, a name given twice, one that is not a plain file name, or one that is not
        among the config's workers.
    DataError
        The dataset cannot be read, a shard its worker could not use (a one-vs-rest shard
        without the positive class), or a file in the way that this function did not write;
        nothing is written then.
    """
    names = [w.name for w in cfg.workers] if names is None else list(names)
    if not names:
        raise ConfigError(f"{cfg.source}: workers: no workers to cut shards for")
    if len(set(names)) != len(names):
        raise ConfigError(f"{cfg.source}: workers: a name is given twice: {', '.join(names)}")
    for name in names:  # each names a file in out_dir, and nothing outside it
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ConfigError(f"{cfg.source}: workers: {name!r} cannot name a shard file")
    cut = copy.deepcopy(cfg)
    if cfg.workers:
        # A name outside the list used to become the list: its file then held every document.
        strangers = [n for n in names if n not in {w.name for w in cfg.workers}]
        if strangers:
            raise ConfigError(f"{cfg.source}: workers: {', '.join(strangers)} "
                              f"{'is' if len(strangers) == 1 else 'are'} not among the "
                              f"cluster's workers ({', '.join(w.name for w in cfg.workers)})")
        known = {w.name: w for w in cfg.workers}
        among = names if among_named else list(known)
        # each of them takes its share of data.path, whatever file of its own it has now
        cut.workers = [replace(known[n], data=None) for n in among]
    else:
        cut.workers = [WorkerConfig(name=n) for n in names]
    texts: dict[str, str] = {}
    report = ShardReport()
    for name in names:
        shard = local_data(cut, name)
        rows = sorted(int(i) for i in [*shard.train_index, *shard.test_index])
        labels = [shard.dataset.labels[i] for i in rows]
        try:  # what the worker will do with its file: fail here, not on its node
            make_task(labels, task=cfg.data.task, positive=cfg.data.positive)
        except DataError as exc:
            raise DataError(
                f"data: the shard of worker {name} ({len(rows)} documents, partition "
                f"{cfg.data.partition}) cannot be used: {exc} (more data with data.limit, "
                f"partition iid or a larger data.alpha would help)") from None
        report.sizes[name] = len(rows)
        texts[name] = "".join(
            json.dumps({"text": shard.dataset.texts[i], "label": shard.dataset.labels[i]},
                       ensure_ascii=False) + "\n" for i in rows)
    out = Path(out_dir)
    manifest = out / SHARD_MANIFEST
    try:
        ours = json.loads(manifest.read_text(encoding="utf-8"))
        ours = ours if isinstance(ours, dict) else {}
    except (OSError, ValueError):
        ours = {}
    changed = {}
    for name, text in texts.items():
        target = out / f"{name}.jsonl"
        if target.is_file():
            old = target.read_bytes()
            if old == text.encode("utf-8"):
                # What this cut writes, byte for byte: ours (one cut before the manifest
                # was kept, too), to rewrite when the cut changes.
                ours[target.name] = hashlib.sha256(old).hexdigest()
                report.unchanged.append(name)
                continue
            # A file of the user's (their own documents) is not ours to replace.
            if not force and ours.get(target.name) != hashlib.sha256(old).hexdigest():
                raise DataError(f"{target}: already there, and not as `fedctl data shard` "
                                f"left it (edited since, your own, or cut by a fedctl "
                                f"before 2026-11): move it away, or pass --force to replace "
                                f"it")
        elif target.exists():
            raise DataError(f"{target}: already there and not a file")
        changed[name] = text.encode("utf-8")
    for name, data in changed.items():
        atomic_write_bytes(out / f"{name}.jsonl", data)
        ours[f"{name}.jsonl"] = hashlib.sha256(data).hexdigest()
        report.written.append(name)
    kept = json.dumps(ours, indent=1, sort_keys=True).encode()
    if ours and (not manifest.is_file() or manifest.read_bytes() != kept):
        atomic_write_bytes(manifest, kept)
    return report
