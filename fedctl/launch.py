"""The one launcher: a master and its workers as ``fedctl`` processes on this machine.

``fedctl run``, the benchmark harness and the tests all start clusters through this module,
so they start them the same way: the same command (``python -m fedctl.cli``), the same child
environment (unbuffered, offline, one share of the cores each, the plug-ins registered in this
process), the same preparation (keys, the family's one-off work, the config the processes
read) and the same clean stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

from common.atomic import atomic_write_bytes
from common.config import ClusterConfig, config_to_dict

__all__ = ["fedctl_command", "child_env", "spawn", "tail", "worker_threads", "LocalCluster"]

STOP_GRACE_S = 10.0  # seconds a terminated process gets before it is killed


def fedctl_command(*args: str, profile: Path | None = None) -> list[str]:
    """The command line of one ``fedctl`` process (under cProfile when ``profile`` is a path)."""
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    return [sys.executable, *prof, "-m", "fedctl.cli", *args]


def child_env(cache_dir: str | Path | None = None, threads: int | None = None,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of every child: unbuffered, offline, quiet tokenizers; ``cache_dir`` is the
    embedding cache (default: the user's); ``threads`` caps the OpenMP pool; the plug-ins
    registered in this process travel in ``FEDCTL_PLUGINS``, which ``os.environ`` already
    holds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if cache_dir is not None:
        env["FEDCTL_CACHE_DIR"] = str(cache_dir)
    env.update(extra or {})
    return env


def spawn(args: list[str], log: Path, env: Mapping[str, str] | None = None,
          profile: Path | None = None, cwd: str | Path | None = None,
          new_session: bool = False) -> subprocess.Popen:
    """Start ``fedctl ARGS`` with stdout and stderr in ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:  # the child holds its own descriptor once started
        return subprocess.Popen(fedctl_command(*args, profile=profile), stdout=fh,
                                stderr=subprocess.STDOUT, env=dict(env or child_env()),
                                cwd=cwd, start_new_session=new_session)


def tail(path: Path, n: int = 8) -> str:
    """The last ``n`` lines of a log ('' when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def worker_threads(n_workers: int) -> int:
    """Each worker's share of this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, n_workers))


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which the processes it starts share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LocalCluster:
    """One job's processes on this machine.

    Parameters
    ----------
    cfg : ClusterConfig
        The job; its ``output_dir`` receives ``cluster.yaml`` (what the processes read) and
        ``logs/<name>.log``.
    log_level : str, default "info"
    profile_master : bool, default False
        Run the master under cProfile, writing ``<output_dir>/master.prof``.
    progress : bool, default True
        Progress bars in this process (the family's one-off work, e.g. embedding).

    Attributes
    ----------
    procs : dict of str to subprocess.Popen
        ``master`` and each worker started so far.
    """

    def __init__(self, cfg: ClusterConfig, log_level: str = "info",
                 profile_master: bool = False, progress: bool = True) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.logs = self.out / "logs"
        self.config_path = self.out / "cluster.yaml"
        self.log_level = log_level
        self.profile = self.out / "master.prof" if profile_master else None
        self.threads = worker_threads(len(cfg.workers))
        self.progress = progress
        self.procs: dict[str, subprocess.Popen] = {}

    def prepare(self) -> None:
        """Write the config the processes read, make missing keys (this machine is every node)
        and do the family's one-off work (e.g. embed the shared dataset once, with progress)."""
        from master.families import server_family_class

        self.logs.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.config_path,
                           yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False).encode())
        if self.cfg.security.curve:
            from common.net.security import keygen

            keygen(self.cfg.security.keys_dir, [w.name for w in self.cfg.workers])
        server_family_class(self.cfg).prepare(self.cfg, progress=self.progress)

    def _args(self) -> list[str]:
        return ["--config", str(self.config_path), "--log-level", self.log_level]

    def start_master(self) -> subprocess.Popen:
        proc = spawn(["master", *self._args()], self.logs / "master.log",
                     child_env(threads=self.threads), profile=self.profile, new_session=True)
        self.procs["master"] = proc
        return proc

    def start_workers(self) -> None:
        for w in self.cfg.workers:
            self.procs[w.name] = spawn(
                ["worker", *self._args(), "--id", w.name, "--threads", str(self.threads)],
                self.logs / f"{w.name}.log", child_env(threads=self.threads), new_session=True)

    def start(self) -> None:
        """Prepared already: start the master, then every worker."""
        self.start_master()
        self.start_workers()

    def failed(self) -> list[str]:
        """Names of the processes that exited with an error."""
        return [n for n, p in self.procs.items() if p.poll() not in (None, 0)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def failure_report(self, names: list[str], n: int = 8) -> str:
        return "\n".join(f"{name} exited with code {self.procs[name].returncode}:\n"
                         f"{tail(self.logs / f'{name}.log', n)}" for name in names)

    def stop(self) -> None:
        """Terminate what still runs; kill what does not stop within the grace period."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
