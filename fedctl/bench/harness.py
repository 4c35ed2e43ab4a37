"""The measuring harness: one job on a real loopback cluster, started by
:class:`fedctl.launch.LocalCluster` as ``fedctl run`` starts it, and read back from the
master's ``metrics.jsonl``; plus the helpers the sections share."""

from __future__ import annotations

import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ClusterConfig, load_config
from common.net.transport import free_ports
from fedctl.bench.worker_pool import start_thread_workers
from fedctl.launch import LocalCluster, child_env

FAILURE_TAIL_LINES = 10  # log lines of a failed process quoted in the error


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
    from common.data.embedding_backends import resolve_backend
    from common.data.shards import local_data

    model = cfg.data.embedding_model or default_model_path()
    # The key of the backend the workers will use (their embeddings are on the CPU here).
    label = resolve_backend(cfg.data.embedding_backend
                            or os.environ.get("FEDCTL_EMBED_BACKEND"), "cpu")
    folder = Path(cfg.data.cache_dir) if cfg.data.cache_dir else _default_cache_dir()
    sub = local_data(cfg, cfg.workers[0].name).dataset
    target = folder / f"{_cache_key(model, sub.texts, label)[:32]}.npy"
    if target.exists():
        return
    full_cfg = copy.deepcopy(cfg)
    full_cfg.data.limit = None
    full = local_data(full_cfg, cfg.workers[0].name).dataset
    source = folder / f"{_cache_key(model, full.texts, label)[:32]}.npy"
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
                profile: bool = False, pools: int = 0) -> dict[str, Any]:
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
    pools : int, default 0
        With ``threads_mode``: the workers' threads in this many processes
        (:mod:`fedctl.bench.worker_pool`) rather than in this one (0).

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
    out = Path(cfg.output_dir)
    if out.exists():
        shutil.rmtree(out)  # an earlier run's metrics.jsonl would be read as this one's
    seed_subset_cache(cfg)
    cluster = LocalCluster(cfg, profile_master=profile)
    cluster.prepare()
    launched = time.time()  # start-up is timed from here: preparation is not the cluster's
    sampler = ProcSampler(cluster.start_master().pid)
    sampler.start()
    errors: list[str] = []
    workers: list[threading.Thread] = []
    try:
        if threads_mode and pools:
            _start_worker_pools(cluster, pools)
        elif threads_mode:
            workers = _start_thread_workers(cluster, errors)
        else:
            cluster.start_workers()
        deadline = time.monotonic() + timeout
        while cluster.running() or any(t.is_alive() for t in workers):
            bad = cluster.failed()
            late = time.monotonic() > deadline
            if bad or errors or late:
                report = cluster.failure_report(bad[:1], FAILURE_TAIL_LINES)
                raise RuntimeError(f"cluster in {out} failed ({', '.join(bad)} exited; "
                                   f"{errors[:3]}; timeout {late}): {report}")
            time.sleep(0.1)
    finally:
        sampler.stop()
        cluster.stop()
    mode = "processes"
    if threads_mode:
        mode = (f"threads of {pools} process{'es' if pools > 1 else ''}" if pools
                   else "threads")
    res = _summarize(out, launched, sampler, mode)
    if cluster.profile is not None and cluster.profile.exists():
        res["master_profile"] = profile_top(cluster.profile)
    return res


def _start_thread_workers(cluster: LocalCluster, errors: list[str]) -> list[threading.Thread]:
    """Every worker of ``cluster`` as a daemon thread of this process, one torch thread each:
    N processes of a few hundred MB each would not fit where N reaches 100 (as in
    ``tests/test_load.py``). A worker's exception is appended to ``errors``."""
    wcfg = load_config(cluster.config_path)  # what the worker processes would have read
    return start_thread_workers(wcfg, [w.name for w in cluster.cfg.workers], errors)


def _start_worker_pools(cluster: LocalCluster, pools: int) -> None:
    """The workers of ``cluster`` as threads of ``pools`` processes
    (:mod:`fedctl.bench.worker_pool`), in ``cluster.procs`` as ``pool1`` ... with their logs."""
    ids = [w.name for w in cluster.cfg.workers]
    for i in range(pools):
        share = ids[i::pools]
        if not share:
            break
        name = f"pool{i + 1}"
        with open(cluster.logs / f"{name}.log", "wb") as fh:
            cluster.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "fedctl.bench.worker_pool", "--config",
                 str(cluster.config_path), "--ids", ",".join(share)],
                stdout=fh, stderr=subprocess.STDOUT, env=child_env(threads=1),
                start_new_session=True)


def _summarize(out: Path, launched: float, sampler: ProcSampler, mode: str) -> dict[str, Any]:
    from common.runlog import read_metrics, round_cpu

    events = read_metrics(out / "metrics.jsonl")
    cpu = round_cpu(events)
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
             "upload_s", "broadcast_s", "cpu_s", "fit_cpu_s", "snapshot_time")
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
        # machine_cpu_s: what the round cost the master and the workers together
        "rounds": [{**{k: e.get(k) for k in keep}, "machine_cpu_s": cpu.get(e["round"])}
                   for e in rounds],
        "worker_rounds": [{k: e.get(k) for k in wkeep} for e in wrounds],
    }
