"""Checks before anything starts: what ``fedctl check`` and ``fedctl run`` do, and what the
master does at its own start.

It opens what the run will open, with the same readers and the same family code, and stops
at the first problem with a one-line error naming the file and line or the field: the data
each worker will read (its own file when it is on this machine, else its share of
``data.path``), the family's requirements of that data (labels for a classifier, documents
for each worker's train and test splits, a vocabulary that survives the filters, enough
rounds for one unit of training) and the master's ports, when it binds them on this host.
Nothing is embedded, so it stays quick.
"""

from __future__ import annotations

import errno
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ClusterConfig, ConfigError
from common.data.reading import DataError
from common.data.shards import LocalData, local_data, unlabelled_message
from master.families import ServerFamily, make_server_family
from master.privacy import PrivacyLedger, batching

#: Hosts a master reached at which binds on this machine.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "*")


@dataclass
class Preflight:
    """What the checks found (for ``fedctl check``'s summary)."""

    family: ServerFamily
    documents: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> train, test
    labelled: bool = True
    not_here: list[str] = field(default_factory=list)  # workers whose own file is elsewhere
    ports_checked: bool = False


def preflight(cfg: ClusterConfig, ports: bool = True, worker: str | None = None,
              data: str | None = None) -> Preflight:
    """Run every check on ``cfg``; raise ConfigError / DataError (one line) at the first
    problem. ``ports``: also check that the master's ports are free on this host. ``worker``:
    read that worker's documents alone (a worker's node), from ``data`` when given (its
    ``--data``)."""
    if cfg.workers and cfg.min_workers > len(cfg.workers):  # it would wait out join_timeout
        raise ConfigError(f"{cfg.source}: min_workers: {cfg.min_workers}, more than the "
                          f"{len(cfg.workers)} worker(s) listed")
    shared = Path(cfg.data.path)
    readers = ([w for w in cfg.workers if w.name == worker] if worker is not None
               else cfg.workers)
    if data is None and any(w.data is None for w in readers) and not shared.is_file():
        raise ConfigError(f"{cfg.source}: data.path: {shared}: "
                          + ("a folder; expected a JSONL file" if shared.is_dir() else
                             "no such file (a relative path is read from the config's folder)"))
    model = cfg.data.embedding_model
    if model is not None and not (Path(model) / "config.json").is_file():
        raise ConfigError(f"{cfg.source}: data.embedding_model: {model}: not a sentence model's "
                          f"folder (one saved on this machine, with its config.json: nothing "
                          f"is downloaded)")
    folders = [("data.cache_dir", cfg.data.cache_dir)]
    if worker is None:  # the master's node writes the run
        folders.append(("output_dir", cfg.output_dir))
    for key, folder in folders:
        check_folder(cfg, key, folder)
    family = make_server_family(cfg)
    found = Preflight(family)
    shards = ({worker: local_data(cfg, worker, data)} if worker is not None
              else worker_shards(cfg, found))
    for wid, shard in shards.items():
        if family.needs_labels and not shard.labelled:
            raise DataError(unlabelled_message(shard.dataset.path, cfg.family))
        if shard.n_train < 1 or (cfg.data.test_fraction > 0 and len(shard.test_index) < 1):
            raise ConfigError(f"{cfg.source}: workers: {wid} gets {shard.n_train} training and "
                              f"{len(shard.test_index)} test document(s) of "
                              f"{shard.dataset.path}; it needs at least one of each (fewer "
                              f"workers, more data, or another data.test_fraction)")
        found.documents[wid] = (shard.n_train, len(shard.test_index))
        found.labelled = found.labelled and shard.labelled
    # One worker's documents alone say nothing of the union's (the classes, the vocabulary
    # the workers will agree on), nor do those here when some workers' files are elsewhere.
    if shards and worker is None and not found.not_here:
        family.check_shards(shards)
        # (the master said this only once every worker had started and registered)
        why = PrivacyLedger(cfg.privacy, cfg.client_fraction).first_round_refusal(
            {w: n for w, (n, _) in found.documents.items()}, *batching(family))
        if why is not None:
            raise ConfigError(f"{cfg.source}: {why}")
    if ports and binds_here(cfg):
        check_ports_free(cfg)
        found.ports_checked = True
    return found


def check_folder(cfg: ClusterConfig, key: str, folder: str | None) -> None:
    """ConfigError naming ``key`` when ``folder`` (None: the default, not checked) is, or
    lies under, a file, or when nothing can be written where the run will write it (the
    output folder is written beside itself, as ``<folder>.partial``, and renamed): `check`
    passed these and the run then failed with the system's bare words."""
    if folder is None:
        return
    path = Path(folder)
    for at in (path, *path.parents):
        # (A link to nothing is absent: runs/latest may name a run deleted since.)
        if at.exists():
            if not at.is_dir():
                where = "is a file" if at == path else f"lies under {at}, a file"
                raise ConfigError(f"{cfg.source}: {key}: {path} {where}; expected a folder")
            break
    written = path.parent if key == "output_dir" else path
    at = next(a for a in (written, *written.parents) if a.exists())
    try:  # (tried, not os.access: a read-only mount, /proc, a quota answer only to a try)
        tempfile.TemporaryDirectory(dir=at, prefix=".fedctl-check-").cleanup()
    except OSError as exc:
        raise ConfigError(f"{cfg.source}: {key}: {path}: nothing can be written in {at} "
                          f"({exc.strerror or exc}); choose another folder") from None


def worker_shards(cfg: ClusterConfig, found: Preflight | None = None) -> dict[str, LocalData]:
    """Every worker's documents that can be read on this machine, read as the worker will."""
    shards: dict[str, LocalData] = {}
    for w in cfg.workers:
        if w.data is not None and not Path(w.data).is_file():
            if found is not None:  # on its own node, not this one: its worker checks it
                found.not_here.append(w.name)
            continue
        shards[w.name] = local_data(cfg, w.name)
    return shards


def binds_here(cfg: ClusterConfig) -> bool:
    """Whether the master of ``cfg`` runs on this machine (as with ``fedctl run``)."""
    host = cfg.master.host
    if host in LOCAL_HOSTS:
        return True
    try:
        return socket.gethostbyname(host) in {"127.0.0.1", *_own_addresses()}
    except OSError:
        return False


def _own_addresses() -> set[str]:
    try:
        return set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        return set()


def check_ports_free(cfg: ClusterConfig) -> None:
    """ConfigError naming ``master.pub_port`` / ``master.rep_port`` when one is taken here."""
    m = cfg.master
    bind = "" if m.bind in ("*", "0.0.0.0") else m.bind
    for key, port in (("pub_port", m.pub_port), ("rep_port", m.rep_port)):
        with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as s:
            # As ZeroMQ binds: a port left in TIME_WAIT by an earlier run is free to it.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((bind, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"{cfg.source}: master.{key}: port {port} is in use on "
                                      f"this host (another fedctl master, or another program: "
                                      f"pick a free port)") from None
                if exc.errno == errno.EACCES:
                    raise ConfigError(f"{cfg.source}: master.{key}: port {port} needs "
                                      f"privileges to bind (pick one above 1023)") from None
                # Not the port's fault: the address (a name that does not resolve, one that
                # is not this host's) was blamed on the port.
                raise ConfigError(f"{cfg.source}: master.bind: cannot bind {m.bind!r} on this "
                                  f"host ({exc.strerror or exc}): use an address of this host, "
                                  f"or '*' for all") from None
