"""`cluster.yaml`: load, validate, and give every field a typed home.

Errors name the file, the field and what was expected, in one line::

    cluster.yaml: rounds: expected an integer >= 1, got 'ten'

Relative paths (data, output) are resolved against the directory of the YAML file, so a config
works the same from wherever `fedctl` is started.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common import constants as C
from common.data.embedding_backends import BACKENDS
from common.data.partitions import SCHEMES
from common.data.reading import TASKS
from common.privacy.dp import ClientDPParams, DPSGDParams, PrivacyParams
from common.secagg.params import SecAggParams

#: What a worker may be called: its name is a file name as well (log, snapshots, keys), so no
#: separator and no leading dot ("..": the run's own folder); anything else goes.
WORKER_NAME = re.compile(r"(?!\.)[^/\\\x00-\x1f\x7f]{1,64}")
WORKER_NAME_RULE = ("1-64 characters, without '/', '\\' or control characters, not starting "
                    "with '.'")


class ConfigError(ValueError):
    """A cluster description that cannot be used; the message is one line naming the field."""


@dataclass
class MasterConfig:
    """Where the master listens. ``host`` is what workers connect to; ``bind`` what it binds."""

    host: str = "127.0.0.1"
    bind: str = "*"
    pub_port: int = C.DEFAULT_PUB_PORT
    rep_port: int = C.DEFAULT_REP_PORT

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.pub_port}"

    @property
    def rep_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.rep_port}"

    @property
    def pub_bind(self) -> str:
        return f"tcp://{self.bind}:{self.pub_port}"

    @property
    def rep_bind(self) -> str:
        return f"tcp://{self.bind}:{self.rep_port}"


@dataclass
class WorkerConfig:
    """One worker: its name, its host (optional: for the operator and the playbooks; a
    worker reaches the master at ``master.host`` wherever it runs), its own data file
    (optional) and device."""

    name: str
    host: str | None = None
    data: str | None = None
    device: str = "auto"


@dataclass
class DataConfig:
    """The dataset and how a simulated cluster splits it among workers.

    A worker started with its own data file (``--data`` or ``workers[].data``) uses that file
    whole; otherwise it takes its share of ``path`` by ``partition``.
    """

    path: str = "data/dbpedia_10k/dbpedia_10k.jsonl"
    task: str = "one_vs_rest"
    positive: str | None = "MeanOfTransportation"
    partition: str = "dirichlet"
    alpha: float = 0.5
    proportions: list[float] | None = None
    test_fraction: float = 0.2
    limit: int | None = None
    embedding_model: str | None = None
    #: auto (OpenVINO on a CPU-only machine when installed, else torch), torch, openvino or
    #: onnx-int8 (common/data/embedding_backends.py); $FEDCTL_EMBED_BACKEND when unset.
    embedding_backend: str | None = None
    cache_dir: str | None = None


@dataclass
class SecurityConfig:
    """Transport security: ``curve`` (CURVE encryption + key-based admission) or ``none``."""

    mode: str = "none"
    keys_dir: str | None = None
    explicit: bool = False  # whether the YAML chose a mode (plaintext by default is logged)

    @property
    def curve(self) -> bool:
        return self.mode == "curve"


@dataclass
class TrackingConfig:
    """Where the per-round metrics also go (``pip install 'fedctl[tracking]'``).

    ``tensorboard``: false, true (``<run>/tensorboard``) or a folder; ``mlflow``: false, true
    (a file store in ``<run>/mlruns``), a folder, or a tracking URI (``http://host:5000``);
    ``experiment``: the MLflow experiment's name."""

    tensorboard: bool | str = False
    mlflow: bool | str = False
    experiment: str = "fedctl"

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard or self.mlflow)


@dataclass
class ClusterConfig:
    """The whole cluster description (see the README's cluster.yaml reference)."""

    master: MasterConfig = field(default_factory=MasterConfig)
    workers: list[WorkerConfig] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=lambda: {"family": "mlp"})
    strategy: dict[str, Any] = field(default_factory=lambda: {"name": "fedavg"})
    rounds: int = 20
    client_fraction: float = 1.0
    min_workers: int = 1
    round_deadline: float = C.ROUND_DEADLINE
    join_timeout: float = C.JOIN_TIMEOUT
    data: DataConfig = field(default_factory=DataConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    compression: dict[str, Any] = field(default_factory=lambda: {"kind": "none"})
    privacy: PrivacyParams = field(default_factory=PrivacyParams)
    heartbeat_timeout: float = C.HEARTBEAT_TIMEOUT
    report_timeout: float = C.REPORT_TIMEOUT
    eval_every: int = 1
    checkpoint_every: int = 1
    checkpoint_budget: float = C.CHECKPOINT_BUDGET
    worker_snapshots: bool = True
    max_weight_fraction: float | None = None
    max_message_mb: float = C.MAX_MESSAGE_BYTES / 1024**2
    memory_limit_mb: float | None = None  # None: master/memory.default_limit()
    output_dir: str = "runs/latest"
    baselines: bool = True
    seed: int = 0
    source: str = "<defaults>"

    @property
    def family(self) -> str:
        return str(self.model["family"])

    @property
    def family_params(self) -> dict[str, Any]:
        """The model section less ``family``: the family's hyperparameters."""
        return {k: v for k, v in self.model.items() if k != "family"}

    @property
    def strategy_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.strategy.items() if k != "name"}

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        known = ", ".join(w.name for w in self.workers) or "none"
        raise ConfigError(f"{self.source}: workers: no worker named {name!r} (known: {known})")

    def with_workers(self, n: int) -> ClusterConfig:
        """A copy with workers ``w1..wN`` (what ``fedctl run --workers N`` uses)."""
        if n < 1:
            raise ConfigError(f"{self.source}: workers: need at least 1 worker, got {n}")
        cfg = copy.deepcopy(self)
        cfg.workers = [WorkerConfig(name=f"w{i + 1}") for i in range(n)]
        cfg.min_workers = min(cfg.min_workers, n)
        check_threshold(cfg)
        return cfg


def _expect(cond: bool, where: str, what: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{where}: expected {what}, got {value!r}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    """A finite number (YAML's ``.inf`` and ``.nan`` are floats no setting can take)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_keys(mapping: dict, known: set[str], where: str) -> None:
    """Refuse keys that are not strings or not known; the first offender is named."""
    for k in mapping:
        if not isinstance(k, str) or k not in known:
            name = k if isinstance(k, str) and k.isprintable() else repr(k)
            raise ConfigError(f"{where}{name}: unknown field (known: {', '.join(sorted(known))})")


def _section(raw: dict, key: str, known: set[str], src: str) -> dict:
    sec = raw.get(key) or {}
    _expect(isinstance(sec, dict), f"{src}: {key}", "a mapping", sec)
    _check_keys(sec, known, f"{src}: {key}.")
    return sec


def parse_config(raw: Any, source: str = "<config>") -> ClusterConfig:
    """Validate a parsed YAML document and build a :class:`ClusterConfig`.

    Raises
    ------
    ConfigError
        One line naming the file, the field and what was expected.
    """
    src = source
    if raw is None:
        raw = {}
    _expect(isinstance(raw, dict), src, "a mapping at the top level", type(raw).__name__)
    top = {"master", "workers", "model", "strategy", "rounds", "client_fraction", "min_workers",
           "round_deadline", "join_timeout", "data", "security", "tracking", "compression",
           "heartbeat_timeout", "report_timeout", "eval_every", "checkpoint_every",
           "checkpoint_budget", "worker_snapshots", "max_weight_fraction", "max_message_mb",
           "memory_limit_mb",
           "output_dir", "privacy",
           "baselines", "seed"}
    _check_keys(raw, top, f"{src}: ")
    cfg = ClusterConfig(source=src)

    m = _section(raw, "master", {"host", "bind", "pub_port", "rep_port"}, src)
    master = MasterConfig(**m)
    for port in ("pub_port", "rep_port"):
        v = getattr(master, port)
        _expect(_int(v) and 0 < v < 65536, f"{src}: master.{port}", "a port 1-65535", v)
    _expect(master.pub_port != master.rep_port, f"{src}: master.rep_port",
            "a port other than pub_port", master.rep_port)
    for key in ("host", "bind"):
        v = getattr(master, key)
        _expect(isinstance(v, str) and v, f"{src}: master.{key}", "a host name or address", v)
    cfg.master = master

    workers = raw.get("workers") or []
    _expect(isinstance(workers, list), f"{src}: workers", "a list", workers)
    seen: set[str] = set()
    for i, w in enumerate(workers):
        where = f"{src}: workers[{i}]"
        if isinstance(w, str):
            w = {"name": w}
        _expect(isinstance(w, dict), where, "a mapping with a name", w)
        _check_keys(w, {"name", "host", "data", "device"}, f"{where}.")
        name = w.get("name")
        # A name is a file name too (the worker's log, snapshots and keys): no separators, no
        # leading dot (".." would name the run's own folder).
        _expect(isinstance(name, str) and WORKER_NAME.fullmatch(name) is not None,
                f"{where}.name", f"a name of {WORKER_NAME_RULE}", name)
        for key in ("host", "device"):
            if key in w:
                _expect(isinstance(w[key], str) and w[key], f"{where}.{key}", "a string", w[key])
        if w.get("data") is not None:
            _expect(isinstance(w["data"], str) and w["data"], f"{where}.data", "a path",
                    w["data"])
        if name in seen:
            raise ConfigError(f"{where}.name: duplicate worker name {name!r}")
        seen.add(name)
        cfg.workers.append(WorkerConfig(**w))

    model = raw.get("model") or {"family": "mlp"}
    if isinstance(model, str):  # `model: nmf`, as `strategy: fedyogi`: the family's defaults
        model = {"family": model}
    _expect(isinstance(model, dict) and isinstance(model.get("family"), str),
            f"{src}: model.family", "a model family name", model.get("family")
            if isinstance(model, dict) else model)
    cfg.model = dict(model)

    strategy = raw.get("strategy", "fedavg")
    if isinstance(strategy, str):
        strategy = {"name": strategy}
    _expect(isinstance(strategy, dict) and isinstance(strategy.get("name"), str),
            f"{src}: strategy", "a strategy name or a mapping with a name", strategy)
    cfg.strategy = dict(strategy)

    for key, check, what in (
        ("rounds", lambda v: _int(v) and 1 <= v <= C.MAX_ROUNDS,
         f"an integer from 1 to {C.MAX_ROUNDS:,}"),
        ("client_fraction", lambda v: _num(v) and 0 < v <= 1, "a fraction in (0, 1]"),
        ("min_workers", lambda v: _int(v) and v >= 1, "an integer >= 1"),
        ("round_deadline", lambda v: _num(v) and v > 0, "a number of seconds > 0"),
        ("join_timeout", lambda v: _num(v) and v > 0, "a number of seconds > 0"),
        ("heartbeat_timeout", lambda v: _num(v) and v > 0, "a number of seconds > 0"),
        ("report_timeout", lambda v: _num(v) and v > 0, "a number of seconds > 0"),
        ("seed", lambda v: _int(v) and 0 <= v < 2**32, "an integer in [0, 2**32)"),
        ("eval_every", lambda v: _int(v) and v >= 0, "an integer >= 0 (0: never)"),
        ("checkpoint_every", lambda v: _int(v) and v >= 0, "an integer >= 0 (0: never)"),
        ("checkpoint_budget", lambda v: _num(v) and 0 < v <= 1, "a fraction in (0, 1]"),
        ("max_weight_fraction", lambda v: v is None or (_num(v) and 0 < v <= 1),
         "a fraction in (0, 1], or null for none"),
        ("max_message_mb", lambda v: _num(v) and 0 < v <= 4096, "a size in MiB, 0-4096"),
        ("memory_limit_mb", lambda v: v is None or (_num(v) and 0 < v < 2**40),
         "a size in MiB > 0, or null for the default"),
        ("baselines", lambda v: isinstance(v, bool), "true or false"),
        ("worker_snapshots", lambda v: isinstance(v, bool), "true or false"),
        ("output_dir", lambda v: isinstance(v, str) and v, "a path"),
    ):
        if key in raw:
            _expect(check(raw[key]), f"{src}: {key}", what, raw[key])
            setattr(cfg, key, raw[key])

    d = _section(raw, "data", set(DataConfig.__dataclass_fields__), src)
    # Labels are read as text (a JSON 8 is the label "8"), so a number names its class too:
    # `--set data.positive=8` was refused as "expected a string, got 8".
    if isinstance(d.get("positive"), int | float) and not isinstance(d["positive"], bool):
        d["positive"] = str(d["positive"])
    data = DataConfig(**d)
    _expect(isinstance(data.path, str) and data.path, f"{src}: data.path", "a path", data.path)
    for key in ("cache_dir", "embedding_model", "embedding_backend", "positive"):
        v = getattr(data, key)
        _expect(v is None or (isinstance(v, str) and v), f"{src}: data.{key}", "a string", v)
    if data.embedding_backend is not None:
        _expect(data.embedding_backend in BACKENDS, f"{src}: data.embedding_backend",
                f"one of {', '.join(BACKENDS)}", data.embedding_backend)
    for key, allowed in (("task", TASKS), ("partition", SCHEMES)):
        v = getattr(data, key)
        _expect(v in allowed, f"{src}: data.{key}", f"one of {', '.join(allowed)}", v)
    _expect(data.proportions is None or (isinstance(data.proportions, list)
                                         and all(_num(x) for x in data.proportions)),
            f"{src}: data.proportions", "a list of numbers", data.proportions)
    _expect(_num(data.alpha) and data.alpha > 0, f"{src}: data.alpha", "a number > 0", data.alpha)
    _expect(_num(data.test_fraction) and 0 < data.test_fraction < 1, f"{src}: data.test_fraction",
            "a number between 0 and 1, neither included (every worker scores the models on "
            "its test split)", data.test_fraction)
    _expect(data.limit is None or (_int(data.limit) and data.limit > 0), f"{src}: data.limit",
            "a positive integer", data.limit)
    cfg.data = data

    comp = raw.get("compression", "none")
    if isinstance(comp, str):
        comp = {"kind": comp}
    comp = _section({"compression": comp}, "compression", {"kind", "fraction"}, src)
    _expect(comp.get("kind", "none") in ("none", "float16", "int8", "topk"),
            f"{src}: compression.kind", "none, float16, int8 or topk", comp.get("kind"))
    _expect(_num(comp.get("fraction", 0.01)) and 0 < comp.get("fraction", 0.01) <= 1,
            f"{src}: compression.fraction", "a fraction in (0, 1]", comp.get("fraction"))
    cfg.compression = {"kind": "none", **comp}
    cfg.privacy = _privacy(raw.get("privacy"), cfg, src)

    sec = raw.get("security")
    if isinstance(sec, str):
        sec = {"mode": sec}
    if sec is not None:
        sec = _section({"security": sec}, "security", {"mode", "keys_dir"}, src)
        keys_dir = sec.get("keys_dir")
        mode = sec.get("mode", "curve" if keys_dir else None)
        _expect(mode in ("curve", "none"), f"{src}: security.mode", "curve or none", mode)
        _expect(keys_dir is None or (isinstance(keys_dir, str) and keys_dir),
                f"{src}: security.keys_dir", "a path", keys_dir)
        if mode == "curve" and not keys_dir:
            raise ConfigError(f"{src}: security.keys_dir: curve needs a key folder "
                              "(write one with `fedctl keygen`)")
        cfg.security = SecurityConfig(mode=mode, keys_dir=keys_dir, explicit=True)

    # Relative paths are relative to the YAML file's directory; `~` is the user's home, as a
    # shell would read it (a folder literally named `~` was made beside the config).
    base = Path(source).resolve().parent if Path(source).exists() else Path.cwd()
    home = os.path.expanduser
    if raw.get("tracking") is not None:
        tr = dict(_section(raw, "tracking", {"tensorboard", "mlflow", "experiment"}, src))
        for key in ("tensorboard", "mlflow"):
            v = tr.get(key, False)
            _expect(isinstance(v, bool) or (isinstance(v, str) and v), f"{src}: tracking.{key}",
                    "true, false, or a folder" + (" or a tracking URI" if key == "mlflow"
                                                  else ""), v)
            if isinstance(v, str) and "://" not in v and not v.startswith("file:"):
                tr[key] = str((base / home(v)).resolve())
        _expect(isinstance(tr.get("experiment", "fedctl"), str) and tr.get("experiment", "x"),
                f"{src}: tracking.experiment", "a name", tr.get("experiment"))
        cfg.tracking = TrackingConfig(**tr)
    cfg.data.path = str((base / home(data.path)).resolve())
    for w in cfg.workers:
        if w.data:
            w.data = str((base / home(w.data)).resolve())
    if data.cache_dir:
        cfg.data.cache_dir = str((base / home(data.cache_dir)).resolve())
    if data.embedding_model:  # a folder on this machine (nothing is downloaded), as the others
        cfg.data.embedding_model = str((base / home(data.embedding_model)).resolve())
    # Absolute, but a link (runs/latest) stays a link: it names the run history, not a run.
    cfg.output_dir = os.path.abspath(base / home(cfg.output_dir))
    if cfg.security.keys_dir:
        cfg.security.keys_dir = str((base / home(cfg.security.keys_dir)).resolve())
    return cfg


def config_to_dict(cfg: ClusterConfig) -> dict[str, Any]:
    """The config as plain data, ready for ``yaml.safe_dump`` (what ``fedctl run`` saves)."""
    out = asdict(cfg)
    out.pop("source")
    out["workers"] = [{k: v for k, v in w.items() if v is not None} for w in out["workers"]]
    sec = out.pop("security")
    if cfg.security.explicit:
        out["security"] = {k: v for k, v in sec.items() if k != "explicit" and v is not None}
    privacy = {k: v for k, v in out.pop("privacy").items() if v is not None}
    if cfg.privacy != PrivacyParams():
        out["privacy"] = privacy
    return out


def job_terms(cfg: ClusterConfig) -> dict[str, Any]:
    """What every node of one job must agree on, as plain data: the model and how it is
    trained (strategy, seed: a simulated worker's share of the data too), the task, privacy
    and compression. Not what differs by node: paths, devices, ports, output folders, rounds
    (``--rounds`` given to the master alone). A worker sends it when it registers
    (master/agreement.py)."""
    # target_epsilon is the master's stopping rule alone (a resume may raise it).
    privacy = {k: v for k, v in asdict(cfg.privacy).items()
               if v is not None and k != "target_epsilon"}
    return {"model": dict(cfg.model), "strategy": dict(cfg.strategy), "seed": cfg.seed,
            "data": {"task": cfg.data.task, "positive": cfg.data.positive},
            "privacy": privacy, "compression": dict(cfg.compression)}


def share_terms(cfg: ClusterConfig) -> dict[str, Any]:
    """How the shares of ``data.path`` are cut: what a worker that reads its share of it (no
    file of its own) must agree on with the master, or it trains on other documents than the
    master's baselines and the other workers count on (a `--set data.limit=...` on one node).
    Sent under ``data`` beside :func:`job_terms`' by such a worker alone."""
    d = cfg.data
    terms: dict[str, Any] = {"file": Path(d.path).name, "partition": d.partition,
                             "test_fraction": d.test_fraction, "limit": d.limit}
    if d.partition.startswith("dirichlet"):  # what else the scheme reads, and only that
        terms["alpha"] = d.alpha
    if d.partition == "proportions":
        # The shares as the partition reads them, normalised: [9, 1] and [0.9, 0.1] agree.
        total = float(sum(d.proportions or [])) or 1.0
        terms["proportions_digest"] = digest([round(float(x) / total, 12)
                                              for x in d.proportions or []])
    # The worker list decides whose share is whose: one term, whatever its length (a list of
    # a thousand names would pass the registration's bound on terms).
    terms["workers_digest"] = digest([w.name for w in cfg.workers])
    return terms


def digest(value: Any) -> str:
    """A short fingerprint of a JSON-able value, for comparing long lists as one term."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_terms(cfg: ClusterConfig) -> dict[str, Any]:
    """How a simulated cluster's data is read and split: the file (its name and size: the
    same file moved is the same), the split, the cap and the workers whose shares it cuts. A
    resumed master must agree with its checkpoint on them, or its workers train on other
    documents than before it stopped, and its baselines are cut from others again."""
    d = cfg.data
    path = Path(d.path)
    return {"file": path.name, "bytes": path.stat().st_size if path.is_file() else None,
            "partition": d.partition, "alpha": d.alpha, "proportions": d.proportions,
            "test_fraction": d.test_fraction, "limit": d.limit,
            "workers": [w.name for w in cfg.workers]}


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (PyYAML keeps the
    last silently: ``rounds: 5`` then ``rounds: 7`` would run 7 rounds without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} written twice (lines {seen[key]} and {line})",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML's) reads a float only with a dot: `lr: 1e-3` was the string '1e-3', and
# the README's own `delta: 1e-5` failed. YAML 1.2 reads exponents without one, as users expect.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _read_yaml(text: str) -> Any:
    """``text`` as YAML, with the loader above."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def apply_overrides(raw: Any, overrides: Sequence[str], source: str) -> Any:
    """``raw`` (a parsed cluster.yaml) with each ``FIELD=VALUE`` of ``overrides`` set in it:
    ``model.lr=0.01``, ``rounds=5``, ``data.limit=600``, ``strategy.name=fedadam``. The value
    is read as YAML (numbers, booleans, ``null``, ``[6, 4]``); what the result means is then
    checked like the file itself.

    Raises
    ------
    ConfigError
        An override that is not ``FIELD=VALUE``, or whose path runs through a plain value.
    """
    raw = {} if raw is None else raw
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. model.lr=0.01")
        try:
            value = _read_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text  # not YAML: the string as given
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            elif part == "strategy" and isinstance(child, str):
                child = node[part] = {"name": child}  # `strategy: fedavg` takes parameters
            elif part == "model" and i == 0 and isinstance(child, str):
                child = node[part] = {"family": child}  # as `model: nmf` does
            if not isinstance(child, dict):
                where = ".".join(parts[:i + 1])
                raise ConfigError(f"{source}: --set {key}: {where} is {child!r}, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ClusterConfig:
    """Read and validate a cluster.yaml, with ``--set FIELD=VALUE`` ``overrides`` applied
    first (:func:`apply_overrides`).

    Raises
    ------
    ConfigError
        Unreadable file, YAML syntax error (with its line), or an invalid field.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:  # (`fedctl run -c nmf`, or a folder without cluster.yaml)
        raise ConfigError(f"{p}: no such file (`fedctl init --family NAME` writes a starter "
                          f"config; examples/ holds one for each family)") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None
    try:
        raw = _read_yaml(text)
    except yaml.constructor.ConstructorError as exc:
        if "written twice" in str(exc.problem):
            raise ConfigError(f"{p}: {exc.problem}") from None
        raise ConfigError(f"{p}: not valid YAML at line {exc.problem_mark.line + 1}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (no mark)
        line = text.count("\n", 0, exc.position) + 1
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        raise ConfigError(f"{p}: not valid YAML at line {line}: a control character "
                          f"({char!r}) where text was expected") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        # PyYAML's own words ("found character '\t' that cannot start any token") do not say
        # what to do; a tab is the commonest cause.
        hint = ("; YAML indents with spaces, not tabs"
                if "'\\t'" in str(getattr(exc, "problem", "") or "") else "")
        raise ConfigError(f"{p}: not valid YAML{line}{hint}") from None
    if overrides:
        if not isinstance(raw, dict | None):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        raw = apply_overrides(raw, overrides, str(p))
    return parse_config(raw, source=str(p))


def check_threshold(cfg: ClusterConfig) -> None:
    """A secure round reveals its sum only with ``threshold`` members: more than the cluster
    has and every round fails (the run used to show a KeyError, then advise a resume).
    Checked once the worker list is final (``--workers N`` applied: the commands' loader)."""
    sa = cfg.privacy.secure_aggregation
    n = len(cfg.workers)
    if sa is not None and sa.threshold is not None and n and sa.threshold > n:
        raise ConfigError(f"{cfg.source}: privacy.secure_aggregation.threshold: {sa.threshold} "
                          f"is more than the cluster's {n} workers: no round could reveal its "
                          f"sum")


def _privacy(raw: Any, cfg: ClusterConfig, src: str) -> PrivacyParams:
    """The ``privacy:`` section (:mod:`common.privacy.dp`). iFTM's Laplace mechanism is
    written here too (``laplace: {epsilon, tau}``) and lands in the topic model's own fields,
    with the same meaning as ``model.epsilon`` / ``model.tau``."""
    if raw is None:
        return PrivacyParams()
    where = f"{src}: privacy"
    sec = dict(_section({"privacy": raw}, "privacy",
                        {"dp_sgd", "client_dp", "delta", "target_epsilon", "laplace",
                         "secure_aggregation"}, src))
    laplace = sec.pop("laplace", None)
    if laplace is not None:
        _expect(isinstance(laplace, dict), f"{where}.laplace", "a mapping of epsilon, tau",
                laplace)
        _check_keys(laplace, {"epsilon", "tau"}, f"{where}.laplace.")
        if cfg.family not in ("lda", "sentencelda"):
            raise ConfigError(f"{where}.laplace: iFTM's Laplace mechanism is the topic models' "
                              f"(lda, sentencelda), not {cfg.family}'s")
        for key, value in laplace.items():
            if key in cfg.model and cfg.model[key] != value:
                raise ConfigError(f"{where}.laplace.{key}: model.{key} says {cfg.model[key]!r}; "
                                  f"write it once")
            cfg.model[key] = value
    for key, cls in (("dp_sgd", DPSGDParams), ("client_dp", ClientDPParams),
                     ("secure_aggregation", SecAggParams)):
        if sec.get(key) is not None:
            value = sec[key]
            _expect(isinstance(value, dict), f"{where}.{key}", "a mapping", value)
            sec[key] = build_params(cls, value, f"{where}.{key}")
    for key in ("delta", "target_epsilon"):
        if key in sec:
            _expect(_num(sec[key]) or (key == "target_epsilon" and sec[key] is None),
                    f"{where}.{key}", "a number", sec[key])
    if (sec.get("target_epsilon") is not None and sec.get("dp_sgd") is None
            and sec.get("client_dp") is None):
        # Nothing would spend ε towards it: a run would train with no privacy, and say none.
        raise ConfigError(f"{where}.target_epsilon: needs dp_sgd or client_dp, whose ε it "
                          f"bounds (iFTM's Laplace mechanism is set by laplace.epsilon)")
    try:
        return PrivacyParams(**sec)
    except ValueError as exc:
        raise ConfigError(f"{where}.{exc}") from None


def build_params(cls: type, params: dict[str, Any], where: str) -> Any:
    """Build a family's hyperparameter dataclass from the ``model`` section.

    Raises
    ------
    ConfigError
        An unknown field, or a value whose type differs from the field's default.
    """
    fields = cls.__dataclass_fields__
    for key, value in params.items():
        if key not in fields:
            raise ConfigError(
                f"{where}.{key}: unknown field (known: family, {', '.join(sorted(fields))})"
            )
        default = fields[key].default
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = _num(value) and (isinstance(default, float) or _int(value))
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            finite = "a finite " if isinstance(value, float) and not math.isfinite(value) else ""
            raise ConfigError(
                f"{where}.{key}: expected {finite}{type(default).__name__}, got {value!r}"
            )
    try:
        return cls(**params)
    except ValueError as exc:  # the dataclass's own checks name the field
        raise ConfigError(f"{where}.{exc}") from None
