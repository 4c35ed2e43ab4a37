"""`fedctl bench`: timing benchmarks of the cluster on one machine over TCP loopback.

Four sections, each run on real clusters (a ``fedctl master`` process; workers as ``fedctl
worker`` processes, or for N >= 30 as threads of this process, as ``tests/test_load.py`` does),
with every timing read from the master's ``metrics.jsonl``:

``centralized``
    The seed's table for the default job (``cluster.yaml``): each worker's local-only training
    time, the pooled centralized training time (``MLPClassifier.fit`` in this process for
    rounds x local_epochs epochs, same hyperparameters) and the federated run's training time
    (first broadcast to the last aggregation), with ``eval_every: 0`` and with evaluation on,
    process start-up reported apart.
``anatomy``
    Where a round's time goes for MLPs of about 0.1 M, 1.6 M and 25 M parameters: broadcast
    (serialize + wire + queue), evaluation, the critical worker's training, upload, aggregation
    and the rest; plus the bare exchange of the same bytes with plain pyzmq (PUB -> 3 SUB, then
    3 REQ/REP uploads, zero-copy), in the same run.
``scaling``
    Round time, master CPU and memory (sampled from ``/proc``) and bytes per round for N workers.
``compression``
    Bytes per round and final federated macro-F1 for none / float16 / int8 / top-k.

Results go to ``<out>/cluster_report.{md,json}`` and ``<out>/cluster_*.png``.

    fedctl bench [--quick] [--out benchmarks/results] [--only anatomy,scaling]
    python benchmarks/cluster_bench.py [same options]
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from common.config import ClusterConfig, config_to_dict, load_config
from common.net.transport import free_ports

SECTIONS = ("centralized", "anatomy", "scaling", "compression")
THREAD_WORKERS_FROM = 30  # N at or above which workers run as threads of this process


# ------------------------------------------------------------------------------ settings
@dataclass
class Plan:
    """What one invocation measures (``--quick`` shrinks every section).

    Attributes
    ----------
    rounds : int
        Rounds of the default-job runs (centralized, compression).
    eval_on : bool
        Also run the default job with per-round evaluation on.
    anatomy_hidden : list of int
        MLP hidden sizes (parameters = 387 h + 2).
    anatomy_rounds : int
    anatomy_limit : int
        ``data.limit`` of the anatomy runs: local work kept small, the point is communication.
    bare_reps : int
        Repetitions of the bare pyzmq exchange per size.
    scaling_n : list of int
    scaling_rounds : int
    scaling_limit : int
        ``data.limit`` of the scaling runs (split iid among the N workers).
    scaling_threads_from : int
        N from which workers run as threads of this process.
    profile : bool
        Profile the master of each anatomy run (cProfile).
    compression : list of dict
        ``compression`` sections to compare (``none`` is the centralized section's run).
    """

    rounds: int = 20
    eval_on: bool = True
    anatomy_hidden: list[int] = field(default_factory=lambda: [256, 4096, 65000])
    anatomy_rounds: int = 20
    anatomy_limit: int = 600
    bare_reps: int = 7
    scaling_n: list[int] = field(default_factory=lambda: [1, 3, 10, 30, 100])
    scaling_rounds: int = 5
    scaling_limit: int = 2000
    scaling_threads_from: int = THREAD_WORKERS_FROM
    profile: bool = False
    compression: list[dict[str, Any]] = field(default_factory=lambda: [
        {"kind": "float16"}, {"kind": "int8"}, {"kind": "topk", "fraction": 0.01},
        {"kind": "topk", "fraction": 0.1}])

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: every code path, a few rounds, small models."""
        return cls(rounds=3, eval_on=False, anatomy_hidden=[256, 4096], anatomy_rounds=3,
                   bare_reps=3, scaling_n=[1, 4], scaling_rounds=2, scaling_threads_from=2,
                   compression=[{"kind": "int8"}])


# ------------------------------------------------------------------------------ helpers

def n_params(hidden: int, input_dim: int = 384, n_classes: int = 2) -> int:
    """Parameter count of the MLP: ``input_dim*h + h + h*n_classes + n_classes``."""
    return input_dim * hidden + hidden + hidden * n_classes + n_classes


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def _fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{scale * x:.{digits}f}"


def seed_subset_cache(cfg: ClusterConfig) -> None:
    """Fill the embedding cache entry of a ``data.limit`` subset from the full file's entry.

    The subset's embeddings are rows of the full file's (same texts, same model), so a cached
    full file spares the sentence-transformer run; without one, the workers embed as usual.
    """
    if cfg.data.limit is None or not cfg.workers:
        return
    from common.atomic import atomic_save_npy
    from common.data.embedding import _cache_key, _default_cache_dir, default_model_path
    from common.data.shards import local_data

    model = cfg.data.embedding_model or default_model_path()
    folder = Path(cfg.data.cache_dir) if cfg.data.cache_dir else _default_cache_dir()
    sub = local_data(cfg, cfg.workers[0].name).dataset
    target = folder / f"{_cache_key(model, sub.texts)[:32]}.npy"
    if target.exists():
        return
    full_cfg = copy.deepcopy(cfg)
    full_cfg.data.limit = None
    full = local_data(full_cfg, cfg.workers[0].name).dataset
    source = folder / f"{_cache_key(model, full.texts)[:32]}.npy"
    if not source.exists():
        return
    X = np.load(source, mmap_mode="r")
    row = {t: i for i, t in enumerate(full.texts)}
    atomic_save_npy(target, np.ascontiguousarray(X[[row[t] for t in sub.texts]]))


class ProcSampler(threading.Thread):
    """Samples a process's CPU time and memory from ``/proc`` every ``interval`` seconds.

    Attributes
    ----------
    samples : list of tuple
        ``(wall time, CPU seconds, VmRSS MiB, VmHWM MiB)``.
    """

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(name=f"sampler-{pid}", daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float, float, float]] = []
        self._halt = threading.Event()
        self._tck = os.sysconf("SC_CLK_TCK")

    def sample(self) -> tuple[float, float, float, float] | None:
        """One reading, or None once the process is gone."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{self.pid}/status").read_text().splitlines()
        except (OSError, IndexError):
            return None
        cpu = (int(stat[11]) + int(stat[12])) / self._tck  # utime + stime
        mem = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in status
               if line.startswith(("VmRSS:", "VmHWM:"))}
        return time.time(), cpu, mem.get("VmRSS", 0.0), mem.get("VmHWM", 0.0)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            s = self.sample()
            if s is None:
                return
            self.samples.append(s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)

    def window(self, t0: float, t1: float) -> dict[str, float | None]:
        """CPU share (1.0 = one core) and memory between wall times ``t0`` and ``t1``."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        a = before[-1] if before else (inside[0] if inside else None)
        b = after[0] if after else (inside[-1] if inside else None)
        cpu = ((b[1] - a[1]) / (b[0] - a[0]) if a and b and b[0] > a[0] else None)
        return {"cpu_cores": cpu,
                "rss_mib_max": max((s[2] for s in inside), default=None),
                "hwm_mib": max((s[3] for s in self.samples), default=None)}


# ------------------------------------------------------------------------------ clusters
def bench_config(base: ClusterConfig, out: Path, n_workers: int | None = None,
                 **changes: Any) -> ClusterConfig:
    """A copy of ``base`` on free loopback ports writing to ``out``; ``changes`` are
    attribute paths (``model.hidden``, ``data.limit``, ``eval_every``...) and values."""
    cfg = base.with_workers(n_workers) if n_workers else copy.deepcopy(base)
    pub, rep = free_ports(2)
    cfg.master.host, cfg.master.bind = "127.0.0.1", "127.0.0.1"
    cfg.master.pub_port, cfg.master.rep_port = pub, rep
    cfg.output_dir = str(out)
    cfg.min_workers = len(cfg.workers)
    for key, value in changes.items():
        parts = key.split(".")
        if parts[0] == "model":
            cfg.model = {**cfg.model, parts[1]: value}
        elif parts[0] == "data":
            setattr(cfg.data, parts[1], value)
        elif parts[0] == "security":
            cfg.security.mode = value
        else:
            setattr(cfg, key, value)
    return cfg


def _child_env(threads: int) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _spawn(args: list[str], log: Path, threads: int, profile: Path | None = None
           ) -> subprocess.Popen:
    fh = open(log, "wb")  # noqa: SIM115 - owned by the child
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    return subprocess.Popen([sys.executable, *prof, "-m", "fedctl.cli", *args], stdout=fh,
                            stderr=subprocess.STDOUT, env=_child_env(threads))


def profile_top(path: Path, n: int = 15) -> list[dict[str, Any]]:
    """The ``n`` functions of a cProfile file with the most own (total) time."""
    import pstats

    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": calls,
                     "tottime_s": tottime, "cumtime_s": cumtime})
    return sorted(rows, key=lambda r: -r["tottime_s"])[:n]


def run_cluster(cfg: ClusterConfig, threads_mode: bool = False, timeout: float = 900.0,
                profile: bool = False) -> dict[str, Any]:
    """Run one job as ``fedctl run`` does and measure it.

    Parameters
    ----------
    cfg : ClusterConfig
        From :func:`bench_config` (free ports, its own output folder).
    threads_mode : bool, default False
        Workers as threads of this process (one torch thread each) instead of processes.
    timeout : float
        Seconds for the whole job.
    profile : bool, default False
        Run the master under cProfile (its main thread): ``master_profile`` in the result
        lists the functions with the most own time.

    Returns
    -------
    dict
        ``rounds`` and ``worker_rounds`` (the metrics events), ``startup_s`` (launch to first
        broadcast), ``train_s`` (sum of round durations), ``master`` (CPU and memory),
        ``pooled`` (comparison.json's pooled scores) and ``mode``.

    Raises
    ------
    RuntimeError
        A process failed or the job ran past ``timeout``.
    """
    from master.families import SERVER_FAMILIES

    out = Path(cfg.output_dir)
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    seed_subset_cache(cfg)
    if cfg.security.curve:
        from common.net.security import keygen

        keygen(cfg.security.keys_dir, [w.name for w in cfg.workers])
    family = SERVER_FAMILIES.get(cfg.family)
    if family is not None:
        family.prepare(cfg)
    config_path = out / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    n = len(cfg.workers)
    threads = max(1, (os.cpu_count() or 1) // n)  # what fedctl run gives each worker
    args = ["--config", str(config_path), "--log-level", "info"]
    launched = time.time()
    prof = out / "master.prof" if profile else None
    master = _spawn(["master", *args], out / "logs" / "master.log", threads, prof)
    sampler = ProcSampler(master.pid)
    sampler.start()
    procs: dict[str, subprocess.Popen] = {"master": master}
    errors: list[str] = []
    workers: list[threading.Thread] = []
    try:
        if threads_mode:
            import torch

            from worker.client import Worker

            torch.set_num_threads(1)
            wcfg = load_config(config_path)

            def work(wid: str) -> None:
                try:
                    Worker(wcfg, wid).run()
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(f"{wid}: {type(exc).__name__}: {exc}")

            workers = [threading.Thread(target=work, args=(w.name,), daemon=True)
                       for w in cfg.workers]
            for t in workers:
                t.start()
        else:
            for w in cfg.workers:
                procs[w.name] = _spawn(["worker", *args, "--id", w.name, "--threads",
                                        str(threads)], out / "logs" / f"{w.name}.log", threads)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs.values()) or any(t.is_alive()
                                                                   for t in workers):
            bad = [k for k, p in procs.items() if p.poll() not in (None, 0)]
            if bad or errors or time.monotonic() > deadline:
                raise RuntimeError(f"cluster in {out} failed ({', '.join(bad)} exited; "
                                   f"{errors[:3]}; timeout {time.monotonic() > deadline}): "
                                   f"{_tail(out / 'logs' / (bad[0] + '.log')) if bad else ''}")
            time.sleep(0.1)
    finally:
        sampler.stop()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    res = _summarize(out, launched, sampler, "threads" if threads_mode else "processes")
    if prof is not None and prof.exists():
        res["master_profile"] = profile_top(prof)
    return res


def _tail(path: Path, n: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _summarize(out: Path, launched: float, sampler: ProcSampler, mode: str) -> dict[str, Any]:
    from common.runlog import read_metrics

    events = read_metrics(out / "metrics.jsonl")
    rounds = [e for e in events if e["event"] == "round"]
    wrounds = [e for e in events if e["event"] == "worker_round"]
    if not rounds:
        raise RuntimeError(f"no rounds in {out / 'metrics.jsonl'}")
    first_broadcast = rounds[0]["time"] - rounds[0]["duration_s"]
    end = rounds[-1]["time"]
    comparison = out / "comparison.json"
    pooled = json.loads(comparison.read_text()).get("pooled") if comparison.exists() else None
    keep = ("round", "duration_s", "slowest_train_s", "overhead_s", "slowest_compute_s",
            "comm_overhead_s", "aggregate_s", "publish_s", "broadcast_bytes", "bytes_in",
            "n_updates")
    wkeep = ("round", "worker", "train_time", "eval_time", "wait_time", "bytes_in", "bytes_out",
             "upload_s", "broadcast_s")
    return {
        "mode": mode,
        "n_workers": len({e["worker"] for e in wrounds}),
        "startup_s": first_broadcast - launched,
        "train_s": float(sum(e["duration_s"] for e in rounds)),
        "first_broadcast_to_last_aggregate_s": end - first_broadcast,
        "median_round_s": _median([e["duration_s"] for e in rounds]),
        "median_overhead_s": _median([e["overhead_s"] for e in rounds]),
        "median_comm_overhead_s": _median([e["comm_overhead_s"] for e in rounds]),
        "median_slowest_train_s": _median([e["slowest_train_s"] for e in rounds]),
        "master": sampler.window(first_broadcast, end),
        "pooled": pooled,
        "rounds": [{k: e.get(k) for k in keep} for e in rounds],
        "worker_rounds": [{k: e.get(k) for k in wkeep} for e in wrounds],
    }


def anatomy(run: dict[str, Any]) -> dict[str, float | None]:
    """Median per-round decomposition along each round's critical path.

    The critical worker of a round is the one whose broadcast + evaluation + training +
    upload is longest; ``other`` is the round's duration less its broadcast, evaluation,
    training, upload and the master's aggregation (the worker's parameter copies and
    (de)compression, the master's validation, queueing and event-loop latency).
    """
    parts: dict[str, list[float]] = {k: [] for k in ("broadcast", "eval", "train", "upload",
                                                     "aggregate", "other", "publish")}
    for r in run["rounds"]:
        ws = [w for w in run["worker_rounds"] if w["round"] == r["round"]]
        if not ws:
            continue

        def path(w: dict[str, Any]) -> float:
            return sum(w.get(k) or 0.0 for k in ("broadcast_s", "eval_time", "train_time",
                                                 "upload_s"))

        crit = max(ws, key=path)
        b, e, t, u = (crit.get(k) or 0.0 for k in ("broadcast_s", "eval_time", "train_time",
                                                   "upload_s"))
        parts["broadcast"].append(b)
        parts["eval"].append(e)
        parts["train"].append(t)
        parts["upload"].append(u)
        parts["aggregate"].append(r["aggregate_s"])
        parts["publish"].append(r["publish_s"])
        parts["other"].append(max(0.0, r["duration_s"] - b - e - t - u - r["aggregate_s"]))
    return {k: _median(v) for k, v in parts.items()}


# ------------------------------------------------------------------------------ bare exchange
def _bare_peer(pub: int, rep: int, reps: int) -> None:  # pragma: no cover - child process
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{rep}")
    while True:  # slow joiner: wait for a hello, then say ready
        frames = sub.recv_multipart()
        if frames[0] == b"hello":
            break
    req.send_multipart([b"ready", b""])
    req.recv_multipart()
    for _ in range(reps):
        frames = sub.recv_multipart(copy=False)
        while frames[0].bytes == b"hello":
            frames = sub.recv_multipart(copy=False)
        got = time.time()
        stamp = json.dumps({"got": got, "sent": time.time()}).encode()
        req.send_multipart([b"u", stamp, *frames[1:]], copy=False)  # the same bytes back
        req.recv_multipart()
    sub.close(0)
    req.close(0)
    ctx.term()


def bare_exchange(shapes: Sequence[tuple[int, ...]], n_peers: int = 3, reps: int = 5
                  ) -> dict[str, Any]:
    """Time the bare bytes of a round with plain pyzmq: one PUB message of ``shapes`` (float32
    arrays, one frame each, zero-copy) to ``n_peers`` SUB processes, then each sends the same
    frames back over REQ/REP and gets a one-frame reply.

    Returns
    -------
    dict
        Medians over ``reps``: ``round_s`` (publish to last reply), ``broadcast_s`` (publish to
        the last peer's receipt) and ``upload_s`` (slowest REQ send to REP receipt); ``bytes``.
    """
    import zmq

    arrays = [np.ones(s, dtype=np.float32) for s in shapes]
    pub_port, rep_port = free_ports(2)
    spawn = mp.get_context("spawn")
    peers = [spawn.Process(target=_bare_peer, args=(pub_port, rep_port, reps), daemon=True)
             for _ in range(n_peers)]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    rep = ctx.socket(zmq.REP)
    rep.bind(f"tcp://127.0.0.1:{rep_port}")
    for p in peers:
        p.start()
    rounds, broadcasts, uploads = [], [], []
    try:
        ready = 0
        while ready < n_peers:
            pub.send_multipart([b"hello", b""])
            if rep.poll(100):
                rep.recv_multipart()
                rep.send(b"ok")
                ready += 1
        for _ in range(reps):
            t0 = time.time()
            pub.send_multipart([b"r", b"{}", *arrays], copy=False)
            got, up = [], []
            for _ in range(n_peers):
                if not rep.poll(120_000):
                    raise RuntimeError("bare exchange: a peer did not answer in 120 s")
                frames = rep.recv_multipart(copy=False)
                arrived = time.time()
                stamp = json.loads(frames[1].bytes)
                rep.send(b"ack")
                got.append(stamp["got"] - t0)
                up.append(arrived - stamp["sent"])
            rounds.append(time.time() - t0)
            broadcasts.append(max(got))
            uploads.append(max(up))
    finally:
        for p in peers:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        pub.close(0)
        rep.close(0)
        ctx.term()
    return {"round_s": _median(rounds), "broadcast_s": _median(broadcasts),
            "upload_s": _median(uploads), "reps": reps, "n_peers": n_peers,
            "bytes": int(sum(a.nbytes for a in arrays))}


# ------------------------------------------------------------------------------ sections
def centralized_times(cfg: ClusterConfig, threads: int) -> dict[str, Any]:
    """Local-only training time of each worker and the pooled one, in this process.

    ``MLPClassifier.fit`` for rounds x local_epochs epochs with the job's hyperparameters and
    ``torch.set_num_threads(threads)``, on the very train splits the workers use.
    """
    import torch

    from common.config import build_params
    from common.data.shards import local_data, sentence_features, worker_seed
    from common.models.mlp import MLPParams

    params = build_params(MLPParams, cfg.family_params, "model")
    shards = {w.name: local_data(cfg, w.name) for w in cfg.workers}
    first = next(iter(shards.values()))
    X, y = sentence_features(cfg, first.dataset), first.y
    n_classes = len(first.classes)
    epochs = cfg.rounds * params.local_epochs
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        warm = params.classifier(X.shape[1], n_classes)
        warm.fit(X[:64], y[:64], epochs=1)  # torch's one-off start-up cost, as workers pay it
        local = {}
        for name, s in shards.items():
            model = params.classifier(X.shape[1], n_classes, random_state=worker_seed(cfg, name))
            t0 = time.perf_counter()
            model.fit(X[s.train_index], y[s.train_index], epochs=epochs)
            local[name] = {"seconds": time.perf_counter() - t0, "n_train": len(s.train_index)}
        train = np.concatenate([s.train_index for s in shards.values()])
        model = params.classifier(X.shape[1], n_classes, random_state=cfg.seed)
        t0 = time.perf_counter()
        model.fit(X[train], y[train], epochs=epochs)
        pooled = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "epochs": epochs, "local": local,
            "pooled": {"seconds": pooled, "n_train": int(len(train))}}


def section_centralized(base: ClusterConfig, plan: Plan, work: Path, log: Callable[[str], None]
                        ) -> dict[str, Any]:
    """Centralized (local-only, pooled) against federated training time, default job."""
    cfg = bench_config(base, work / "fed_noeval", rounds=plan.rounds, eval_every=0)
    log(f"centralized: federated run, {plan.rounds} rounds, eval_every 0")
    fed = run_cluster(cfg)
    res: dict[str, Any] = {"federated_noeval": fed}
    if plan.eval_on:
        log("centralized: federated run with evaluation every round")
        res["federated_eval"] = run_cluster(bench_config(base, work / "fed_eval",
                                                         rounds=plan.rounds, eval_every=1))
    log("centralized: local-only and pooled training in this process")
    res["central_1thread"] = centralized_times(cfg, 1)
    res["central_all_threads"] = centralized_times(cfg, os.cpu_count() or 1)
    res["ratio_federated_to_pooled"] = fed["train_s"] / res["central_1thread"]["pooled"]["seconds"]
    res["security"] = cfg.security.mode
    return res


def section_anatomy(base: ClusterConfig, plan: Plan, work: Path, log: Callable[[str], None]
                    ) -> dict[str, Any]:
    """Round anatomy by model size, and the bare exchange of the same bytes."""
    out = {}
    for hidden in plan.anatomy_hidden:
        big = hidden > 20_000
        cfg = bench_config(base, work / f"anatomy_{hidden}", rounds=plan.anatomy_rounds,
                           eval_every=0, baselines=False, **{
                               "model.hidden": hidden, "model.batch_size": 1024,
                               "model.local_epochs": 1, "data.limit": plan.anatomy_limit,
                               "data.partition": "iid", "security.mode": "none",
                               "heartbeat_timeout": 30.0 if big else base.heartbeat_timeout})
        log(f"anatomy: hidden {hidden} ({n_params(hidden) / 1e6:.2f} M parameters), "
            f"{plan.anatomy_rounds} rounds")
        run = run_cluster(cfg, profile=plan.profile)
        shapes = [(hidden, 384), (hidden,), (2, hidden), (2,)]
        log(f"anatomy: bare pyzmq exchange of the same {4 * n_params(hidden) / 1e6:.1f} MB")
        bare = bare_exchange(shapes, n_peers=len(cfg.workers), reps=plan.bare_reps)
        out[str(hidden)] = {"hidden": hidden, "params": n_params(hidden), "run": run,
                            "anatomy": anatomy(run), "bare": bare}
    return out


def section_scaling(base: ClusterConfig, plan: Plan, work: Path, log: Callable[[str], None]
                    ) -> dict[str, Any]:
    """Round time, master CPU/memory and bytes per round against the number of workers."""
    out = {}
    for n in plan.scaling_n:
        threads_mode = n >= plan.scaling_threads_from
        cfg = bench_config(base, work / f"scaling_{n}", n_workers=n, rounds=plan.scaling_rounds,
                           eval_every=0, baselines=False, heartbeat_timeout=60.0,
                           **{"data.partition": "iid", "data.limit": plan.scaling_limit,
                              "security.mode": "none"})
        log(f"scaling: {n} worker(s) as {'threads' if threads_mode else 'processes'}, "
            f"{plan.scaling_rounds} rounds")
        run = run_cluster(cfg, threads_mode=threads_mode)
        rs = run["rounds"]
        bcast = [max((w.get("broadcast_s") or 0.0) for w in run["worker_rounds"]
                     if w["round"] == r["round"]) for r in rs]
        out[str(n)] = {
            "n": n, "mode": run["mode"], "run": run,
            "completed_rounds": len(rs), "all_updates": all(r["n_updates"] == n for r in rs),
            "median_round_s": run["median_round_s"],
            "median_overhead_s": run["median_overhead_s"],
            "median_publish_s": _median([r["publish_s"] for r in rs]),
            "median_broadcast_latency_max_s": _median(bcast),
            "broadcast_bytes": _median([r["broadcast_bytes"] for r in rs]),
            "bytes_in": _median([r["bytes_in"] for r in rs]),
            "master_cpu_cores": run["master"]["cpu_cores"],
            "master_rss_mib": run["master"]["rss_mib_max"],
            "master_hwm_mib": run["master"]["hwm_mib"],
        }
    return out


def section_compression(base: ClusterConfig, plan: Plan, work: Path,
                        log: Callable[[str], None], none_run: dict[str, Any] | None
                        ) -> dict[str, Any]:
    """Bytes per round and final federated macro-F1 with each update compression."""
    out = {}
    kinds = ([] if none_run is not None else [{"kind": "none"}]) + plan.compression
    for comp in kinds:
        label = comp["kind"] + (f" {comp['fraction']:g}" if "fraction" in comp else "")
        log(f"compression: {label}, {plan.rounds} rounds")
        cfg = bench_config(base, work / f"comp_{label.replace(' ', '_')}", rounds=plan.rounds,
                           eval_every=0, compression=dict(comp))
        out[label] = run_cluster(cfg)
    if none_run is not None:
        out = {"none": none_run, **out}
    table = {}
    for label, run in out.items():
        f1 = (run.get("pooled") or {}).get("federated", {}).get("macro_f1")
        table[label] = {"bytes_in": _median([r["bytes_in"] for r in run["rounds"]]),
                        "broadcast_bytes": _median([r["broadcast_bytes"] for r in run["rounds"]]),
                        "federated_macro_f1": f1, "median_round_s": run["median_round_s"],
                        "train_s": run["train_s"]}
    return {"table": table, "runs": {k: v for k, v in out.items() if k != "none"}}


# ------------------------------------------------------------------------------ goals, report
def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's acceptance goals, each with its measured value and whether it is met."""
    g: list[dict[str, Any]] = []
    c = res.get("centralized")
    if c:
        r = c["ratio_federated_to_pooled"]
        g.append({"goal": "federated training <= 1.1 x pooled centralized (default job)",
                  "value": f"{r:.2f} x", "met": r <= 1.1})
        ov = c["federated_noeval"]["median_overhead_s"]
        g.append({"goal": "median overhead <= 5 ms at 0.1 M parameters (default job, "
                          f"security {c['security']})", "value": f"{1000 * ov:.2f} ms",
                  "met": ov <= 0.005})
    for key, a in (res.get("anatomy") or {}).items():
        ov = a["run"]["median_overhead_s"]
        limit = 0.005 if a["params"] < 1e6 else (0.5 if a["params"] > 1e7 else None)
        if limit is not None:
            g.append({"goal": f"median overhead <= {limit * 1000:g} ms at "
                              f"{a['params'] / 1e6:.2f} M parameters (anatomy, hidden {key})",
                      "value": f"{1000 * ov:.2f} ms (bare exchange "
                               f"{1000 * a['bare']['round_s']:.2f} ms)",
                      "met": ov <= limit})
    s = res.get("scaling")
    if s:
        sizes = [v["broadcast_bytes"] for v in s.values()]
        pubs = [v["median_publish_s"] for v in s.values() if v["median_publish_s"] is not None]
        # One message whatever N; it grows only by the participant list in its header.
        g.append({"goal": "broadcast cost flat in N (one serialization per round)",
                  "value": f"broadcast {min(sizes):,.0f}-{max(sizes):,.0f} bytes "
                           f"(+{100 * (max(sizes) / min(sizes) - 1):.2f} %, the participant "
                           f"list); master publish {1000 * min(pubs):.2f}-"
                           f"{1000 * max(pubs):.2f} ms",
                  "met": max(sizes) <= 1.01 * min(sizes)})
        big = s.get(str(max(int(k) for k in s)))
        g.append({"goal": f"{big['n']} workers complete rounds",
                  "value": f"{big['completed_rounds']} rounds, all updates "
                           f"{big['all_updates']}", "met": bool(big["all_updates"])})
    return g


def _plots(res: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    a = res.get("anatomy")
    if a:
        comps = ["broadcast", "eval", "train", "upload", "aggregate", "other"]
        fig, axes = plt.subplots(1, len(a), figsize=(4 * len(a), 4), squeeze=False)
        for ax, (key, v) in zip(axes[0], a.items(), strict=True):
            bottom = 0.0
            for comp in comps:
                h = 1000 * (v["anatomy"][comp] or 0.0)
                ax.bar(["fedctl round"], [h], bottom=bottom, label=comp)
                bottom += h
            bare = v["bare"]
            ax.bar(["bare pyzmq"], [1000 * bare["broadcast_s"]], color="C0")
            ax.bar(["bare pyzmq"], [1000 * (bare["round_s"] - bare["broadcast_s"])],
                   bottom=[1000 * bare["broadcast_s"]], color="C3")
            ax.set_title(f"{v['params'] / 1e6:.2f} M parameters (h={key})")
            ax.set_ylabel("median ms per round")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "cluster_anatomy.png", dpi=100)
        plt.close(fig)
        files.append("cluster_anatomy.png")
    s = res.get("scaling")
    if s:
        ns = [v["n"] for v in s.values()]
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        axes[0].plot(ns, [1000 * v["median_round_s"] for v in s.values()], "o-", label="round")
        axes[0].plot(ns, [1000 * v["median_overhead_s"] for v in s.values()], "o-",
                     label="overhead")
        axes[0].plot(ns, [1000 * v["median_publish_s"] for v in s.values()], "o-",
                     label="master publish")
        axes[0].set_ylabel("median ms")
        axes[1].plot(ns, [100 * (v["master_cpu_cores"] or 0) for v in s.values()], "o-",
                     label="master CPU % of a core")
        axes[1].plot(ns, [v["master_hwm_mib"] or 0 for v in s.values()], "o-",
                     label="master peak RSS MiB")
        axes[2].plot(ns, [v["broadcast_bytes"] / 1e6 for v in s.values()], "o-",
                     label="PUB broadcast MB")
        axes[2].plot(ns, [v["bytes_in"] / 1e6 for v in s.values()], "o-",
                     label="uploads MB")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("workers")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "cluster_scaling.png", dpi=100)
        plt.close(fig)
        files.append("cluster_scaling.png")
    comp = (res.get("compression") or {}).get("table")
    if comp:
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = list(comp)
        ax.bar(labels, [v["bytes_in"] / 1e3 for v in comp.values()])
        ax.set_ylabel("update kB per round (all workers)")
        ax2 = ax.twinx()
        ax2.plot(labels, [v["federated_macro_f1"] or 0 for v in comp.values()], "ko-")
        ax2.set_ylabel("final federated macro-F1 (pooled test)")
        fig.tight_layout()
        fig.savefig(out / "cluster_compression.png", dpi=100)
        plt.close(fig)
        files.append("cluster_compression.png")
    return files


def report_markdown(res: dict[str, Any], plots: list[str]) -> str:
    """The human-readable report of :func:`run_benchmarks`' results."""
    env = res["environment"]
    quick = " — **quick mode** (smoke settings, not the published figures)" if res["quick"] else ""
    lines = [
        "# fedctl cluster timing report", "",
        f"{env['date']}, {env['platform']}, {env['cpus']} CPU(s), Python {env['python']}, "
        f"load average at start {env['loadavg_start']}, at end {env['loadavg_end']}"
        f"{quick}.",
        "Timings on a loaded machine (load average above the CPU count) are noisy.", "",
        "Reproduce: `fedctl bench` (or `python benchmarks/cluster_bench.py`); "
        "`--quick` for a smoke run.", ""]
    g = res.get("goals") or []
    if g:
        lines += ["## Goals", "", "| goal | measured | met |", "|---|---|---|"]
        lines += [f"| {x['goal']} | {x['value']} | {'yes' if x['met'] else '**no**'} |"
                  for x in g]
        lines.append("")
    c = res.get("centralized")
    if c:
        fed = c["federated_noeval"]
        c1, ca = c["central_1thread"], c["central_all_threads"]
        lines += ["## Centralized against federated (default job)", "",
                  f"Same model and epochs ({c1['epochs']} = rounds x local_epochs). Centralized: "
                  f"`MLPClassifier.fit` in one process with `torch.set_num_threads(1)` (what "
                  f"`fedctl run` gives each of 3 workers on 2 cores) and with "
                  f"{ca['threads']} threads. Federated: sum of round durations (first "
                  f"broadcast to last aggregation), security `{c['security']}`, "
                  f"{fed['n_workers']} worker processes; start-up (process launch to first "
                  f"broadcast) apart.", "",
                  "| what | documents | training s (1 thread) | training s "
                  f"({ca['threads']} threads) |", "|---|---|---|---|"]
        for name, v in c1["local"].items():
            lines.append(f"| local-only {name} | {v['n_train']} | {v['seconds']:.2f} | "
                         f"{ca['local'][name]['seconds']:.2f} |")
        lines.append(f"| pooled centralized | {c1['pooled']['n_train']} | "
                     f"{c1['pooled']['seconds']:.2f} | {ca['pooled']['seconds']:.2f} |")
        for key, label in (("federated_noeval", "federated, eval_every 0"),
                           ("federated_eval", "federated, evaluation every round")):
            if key in c:
                r = c[key]
                lines.append(f"| {label} | {c1['pooled']['n_train']} | {r['train_s']:.2f} "
                             f"(start-up {r['startup_s']:.1f} s apart; median round "
                             f"{1000 * r['median_round_s']:.1f} ms, overhead "
                             f"{1000 * r['median_overhead_s']:.2f} ms) | |")
        lines += ["", f"Federated / pooled (1 thread): **{c['ratio_federated_to_pooled']:.2f}"
                  " x** (the seed: 12–18 x).", ""]
    a = res.get("anatomy")
    if a:
        lines += ["## Round anatomy", "",
                  "3 worker processes, MLP of the given width, `data.limit` "
                  f"{res['plan']['anatomy_limit']} (iid), batch 1024, 1 local epoch, "
                  "eval_every 0, security none. Median ms per round along the critical path "
                  "(the worker with the longest broadcast + evaluation + training + upload): "
                  "broadcast = master send to worker receipt (serialize + wire + queue), "
                  "upload = worker send to master receipt of the update, other = the rest "
                  "(parameter copies on the worker, validation, event-loop latency). Bare = "
                  "plain pyzmq PUB to 3 SUB processes + 3 REQ/REP uploads of the same arrays, "
                  "zero-copy, in the same run.", "",
                  "| params | MB | round | broadcast | train | upload | aggregate | other | "
                  "overhead (round − slowest training) | bare round | bare broadcast | "
                  "bare upload |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in a.values():
            an, b, run = v["anatomy"], v["bare"], v["run"]
            lines.append(
                f"| {v['params'] / 1e6:.2f} M | {b['bytes'] / 1e6:.1f} | "
                f"{_fmt(run['median_round_s'], 1000)} | {_fmt(an['broadcast'], 1000, 2)} | "
                f"{_fmt(an['train'], 1000)} | {_fmt(an['upload'], 1000, 2)} | "
                f"{_fmt(an['aggregate'], 1000, 2)} | {_fmt(an['other'], 1000, 2)} | "
                f"**{_fmt(run['median_overhead_s'], 1000, 2)}** | {_fmt(b['round_s'], 1000, 2)}"
                f" | {_fmt(b['broadcast_s'], 1000, 2)} | {_fmt(b['upload_s'], 1000, 2)} |")
        lines += ["", "The components are medians over rounds taken separately, so they need not "
                  "add up to the median round.", ""]
        for v in a.values():
            top = v["run"].get("master_profile")
            if top:
                lines += [f"Master main thread, cProfile, {v['params'] / 1e6:.2f} M parameters "
                          "(own time over the whole run, start-up included):", "",
                          "| function | calls | own s | cumulative s |", "|---|---|---|---|"]
                lines += [f"| `{r['function']}` | {r['calls']} | {r['tottime_s']:.3f} | "
                          f"{r['cumtime_s']:.3f} |" for r in top[:10]]
                lines.append("")
    s = res.get("scaling")
    if s:
        lines += ["## Scaling with workers", "",
                  f"MLP h=256, `data.limit` {res['plan']['scaling_limit']} split iid, "
                  "eval_every 0, security none; master a process, workers processes "
                  f"(N < {res['plan']['scaling_threads_from']}) or threads of the "
                  "benchmark process "
                  "(one torch thread each). Master CPU: /proc utime+stime over the training "
                  "window (1.0 = one core); memory: VmRSS max in the window, VmHWM.", "",
                  "| N | workers as | rounds | median round ms | median overhead ms | master "
                  "publish ms | slowest broadcast latency ms | PUB bytes/round | update bytes/"
                  "round | master CPU (cores) | master RSS MiB | master peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in s.values():
            lines.append(
                f"| {v['n']} | {v['mode']} | {v['completed_rounds']} | "
                f"{_fmt(v['median_round_s'], 1000)} | {_fmt(v['median_overhead_s'], 1000)} | "
                f"{_fmt(v['median_publish_s'], 1000, 3)} | "
                f"{_fmt(v['median_broadcast_latency_max_s'], 1000)} | "
                f"{v['broadcast_bytes']:,.0f} | {v['bytes_in']:,.0f} | "
                f"{_fmt(v['master_cpu_cores'], 1, 2)} | {_fmt(v['master_rss_mib'])} | "
                f"{_fmt(v['master_hwm_mib'])} |")
        lines.append("")
    comp = (res.get("compression") or {}).get("table")
    if comp:
        lines += ["## Update compression (default job)", "",
                  "Update bytes per round = all workers' uploads (the master's `bytes_in`); "
                  "final federated macro-F1 on all workers' test splits pooled.", "",
                  "| compression | update bytes/round | vs none | PUB bytes/round | "
                  "final macro-F1 | median round ms |", "|---|---|---|---|---|---|"]
        none = comp.get("none", {}).get("bytes_in")
        for label, v in comp.items():
            lines.append(f"| {label} | {v['bytes_in']:,.0f} | "
                         f"{(v['bytes_in'] / none if none else float('nan')):.3f} | "
                         f"{v['broadcast_bytes']:,.0f} | {_fmt(v['federated_macro_f1'], 1, 4)} | "
                         f"{_fmt(v['median_round_s'], 1000)} |")
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_benchmarks(config: str | Path = "cluster.yaml", out: str | Path = "benchmarks/results",
                   quick: bool = False, only: Sequence[str] = SECTIONS,
                   log: Callable[[str], None] | None = None, keep_runs: bool = False,
                   profile: bool = False, anatomy_hidden: Sequence[int] | None = None
                   ) -> dict[str, Any]:
    """Run the chosen sections and write ``cluster_report.{md,json}`` and the plots to ``out``.

    Parameters
    ----------
    config : path
        The default job (its data, model and security sections are the baseline).
    out : path
        Results folder.
    quick : bool
        Smoke settings (:meth:`Plan.quick`).
    only : sequence of str
        Sections among :data:`SECTIONS`.
    log : callable, optional
        Progress lines (default: print to stderr).
    keep_runs : bool
        Keep each cluster's output folder under ``<out>/runs`` (default: a temporary folder).
    profile : bool
        Profile the master of each anatomy run; the report lists its hottest functions.
    anatomy_hidden : sequence of int, optional
        Hidden sizes of the anatomy section instead of the plan's.

    Returns
    -------
    dict
        What ``cluster_report.json`` holds.
    """
    log = log or (lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    plan = Plan.quick() if quick else Plan()
    plan.profile = profile
    if anatomy_hidden:
        plan.anatomy_hidden = list(anatomy_hidden)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config)
    res: dict[str, Any] = {
        "quick": quick, "sections": list(only), "plan": plan.__dict__,
        "environment": {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "loadavg_start": _loadavg()}}
    work = out / "runs" if keep_runs else Path(tempfile.mkdtemp(prefix="fedctl-bench-"))
    try:
        if "centralized" in only:
            res["centralized"] = section_centralized(base, plan, work, log)
        if "anatomy" in only:
            res["anatomy"] = section_anatomy(base, plan, work, log)
        if "compression" in only:
            none_run = (res.get("centralized") or {}).get("federated_noeval")
            res["compression"] = section_compression(base, plan, work, log, none_run)
        if "scaling" in only:
            res["scaling"] = section_scaling(base, plan, work, log)
    finally:
        if not keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    res["environment"]["loadavg_end"] = _loadavg()
    res["goals"] = goals(res)
    plots = _plots(res, out)
    (out / "cluster_report.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "cluster_report.md").write_text(report_markdown(res, plots))
    log(f"report: {out / 'cluster_report.md'}")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of ``fedctl bench`` and ``benchmarks/cluster_bench.py``."""
    p = argparse.ArgumentParser(prog="fedctl bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", default="cluster.yaml", help="the default job")
    p.add_argument("--out", "-o", default=None,
                   help="results folder (default benchmarks/results, "
                        "benchmarks/results/quick with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: few rounds, small models")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections among {','.join(SECTIONS)}")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep every cluster's output folder under OUT/runs")
    p.add_argument("--profile", action="store_true",
                   help="run each anatomy master under cProfile; hottest functions in the report")
    p.add_argument("--hidden", default=None,
                   help="comma-separated MLP hidden sizes for the anatomy (default 256,4096,65000)")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}")
    out = args.out or ("benchmarks/results/quick" if args.quick else "benchmarks/results")
    hidden = [int(h) for h in args.hidden.split(",")] if args.hidden else None
    res = run_benchmarks(args.config, out, quick=args.quick, only=only,
                         keep_runs=args.keep_runs, profile=args.profile, anatomy_hidden=hidden)
    print(Path(out, "cluster_report.md").read_text())
    missed = [g["goal"] for g in res["goals"] if not g["met"]]
    if missed:
        print(f"{len(missed)} goal(s) missed (see the report)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
