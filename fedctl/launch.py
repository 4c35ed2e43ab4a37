"""The one launcher: a master and its workers as ``fedctl`` processes on this machine.

``fedctl run``, the benchmark harness and the tests all start clusters through this module,
so they start them the same way: the same command (``python -m fedctl.cli``), the same child
environment (unbuffered, offline, one share of the cores each, the plug-ins registered in this
process), the same preparation (keys, the family's one-off work, the config the processes
read) and the same clean stop.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from common.atomic import atomic_write_bytes
from common.config import ClusterConfig, config_to_dict

__all__ = ["fedctl_command", "child_env", "spawn", "tail", "worker_threads", "LocalCluster",
           "ForkedProcess", "limit_threads"]

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


#: prctl(2)'s option that sends the calling process a signal when its parent dies (Linux).
PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's prctl, looked up in the parent: a child between fork and exec must not load
    libraries (a lock another thread of the parent held stays held there)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent: int, prctl: Any) -> None:
    """In a child of a job's launcher, before it runs: SIGTERM when its parent dies, so that
    a launcher killed outright (SIGKILL, the OOM killer) leaves no master or worker running on
    as an orphan (the master then stops as on SIGTERM, keeping its checkpoint). ``prctl``:
    :func:`_prctl`'s (None: nothing done); ``parent`` is the pid the child was started by, in
    case it died before this took hold. Hand-written: psutil and multiprocessing offer no
    parent-death signal."""
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def end_with(launcher: int) -> None:
    """SIGTERM to this process when process ``launcher`` ends, as :func:`die_with_parent`
    does for a direct child: a process forked by the fork server has the server for its
    parent, and the server lives as long as its children do (multiprocessing hands each the
    server's alive pipe). A thread waits on a pidfd (Linux 5.3+); elsewhere, nothing."""
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:  # already gone
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):  # no pidfd here
        return

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="launcher-watch", daemon=True).start()


def spawn(args: list[str], log: Path, env: Mapping[str, str] | None = None,
          profile: Path | None = None, cwd: str | Path | None = None,
          new_session: bool = False) -> subprocess.Popen:
    """Start ``fedctl ARGS`` with stdout and stderr in ``log``; it ends with this process
    (:func:`die_with_parent`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    me, prctl = os.getpid(), _prctl()
    with open(log, "wb") as fh:  # the child holds its own descriptor once started
        return subprocess.Popen(fedctl_command(*args, profile=profile), stdout=fh,
                                stderr=subprocess.STDOUT, env=dict(env or child_env()),
                                cwd=cwd, start_new_session=new_session,
                                preexec_fn=lambda: die_with_parent(me, prctl))


#: What the fork server behind :class:`LocalCluster` imports once, before any process of the
#: job starts: each would otherwise spend about 4 s of CPU importing them (torch; the compiler
#: front end, torch._dynamo, that torch.optim loads on an optimizer's first use; scikit-learn
#: with scipy) while the others start on the same cores. Third-party modules only: fedctl's
#: own read the child's environment, which is set after the fork.
FORK_PRELOAD = ("torch", "torch._dynamo", "torch.optim", "sklearn.model_selection",
                "sklearn.metrics", "zmq", "yaml", "click")


#: What stops a launcher (fedctl.run: Ctrl-C, ``kill``, a closed terminal).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Within: :data:`STOP_SIGNALS` noted, not acted on; after: the first noted delivered
    again to the handler it had. Only the main thread sets handlers; elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
              for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if caught:  # the first: its handler stops the launcher (a second would be cut short)
            signal.raise_signal(caught[0])


def _start_fork_server() -> None:
    """Start multiprocessing's fork server (and its resource tracker) with Ctrl-C ignored.
    Both are in the terminal's process group: Ctrl-C in the seconds the server spends
    importing :data:`FORK_PRELOAD` printed a KeyboardInterrupt traceback of its own under
    fedctl's one-line stop (the server ignores SIGINT only once its imports are done). The
    forked processes take Ctrl-C's default back (:func:`_forked_main`)."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()  # (signal handlers are the main thread's to set)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


class ForkedProcess:
    """A ``fedctl`` process forked by multiprocessing's fork server, behind the part of
    :class:`subprocess.Popen`'s interface the launcher uses (``pid``, ``returncode``,
    ``poll``, ``wait``, ``terminate``, ``kill``, ``send_signal``)."""

    def __init__(self, args: list[str], log: Path, env: Mapping[str, str],
                 new_session: bool, cwd: str | Path | None = None) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")  # there once started, as spawn's is
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORK_PRELOAD))
        _start_fork_server()
        self._proc = ctx.Process(target=_forked_main, name=f"fedctl {args[0]}",
                                 args=(list(args), str(log), dict(env), new_session,
                                       None if cwd is None else str(cwd), os.getpid()))
        self._proc.start()
        self.pid = self._proc.pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked_main(args: list[str], log: str, env: dict[str, str], new_session: bool,
                 cwd: str | None = None, launcher: int | None = None) -> None:
    """A forked child: what ``spawn`` gives a process (its session, its log as stdout and
    stderr, its environment, its folder, its share of the cores), then ``fedctl ARGS``; it
    ends with ``launcher`` (:func:`end_with`)."""
    if new_session:
        os.setsid()  # first: out of the terminal's process group, Ctrl-C is the launcher's
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignored it
    if launcher is not None:
        end_with(launcher)
    if cwd is not None:
        os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                      buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                      buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # read when the pools loaded, in the fork server: set now
        limit_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["fedctl", *args]
    from fedctl.cli import entry

    entry()


def limit_threads(n: int, report: bool = False) -> None:
    """Cap torch and every BLAS / OpenMP pool at ``n`` threads: the environment for the
    libraries not loaded yet, threadpoolctl for those already in the process."""
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    threadpool_limits(n)  # not as a context: in force for the rest of the process
    if report:
        pools = sorted({f"{p['internal_api']} {p['num_threads']}" for p in threadpool_info()})
        logging.getLogger("fedctl.worker").info(
            "CPU threads: torch %d, %s", torch.get_num_threads(), ", ".join(pools) or "no pool")


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


def exit_reason(code: int | None) -> str:
    """An exit status as a user reads it: a negative one is the signal that killed the
    process, named (-9 alone said nothing of the out-of-memory killer)."""
    if code is None or code >= 0:
        return str(code)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return str(code)
    why = {"SIGKILL": ": out of memory, or kill -9", "SIGSEGV": ": a crash in native code"}
    return f"{code} (killed by {name}{why.get(name, '')})"


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
    fork : bool, default True
        Fork the processes from a fork server that has imported :data:`FORK_PRELOAD` once
        (each starts in a fraction of the CPU); False (or ``FEDCTL_FORK=0``): a fresh
        interpreter each, as ``spawn`` starts them.

    Attributes
    ----------
    procs : dict of str to subprocess.Popen
        ``master`` and each worker started so far.
    """

    def __init__(self, cfg: ClusterConfig, log_level: str = "info",
                 profile_master: bool = False, progress: bool = True,
                 fork: bool = True) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.logs = self.out / "logs"
        self.config_path = self.out / "cluster.yaml"
        self.log_level = log_level
        self.profile = self.out / "master.prof" if profile_master else None
        self.threads = worker_threads(len(cfg.workers))
        self.progress = progress
        self.fork = fork and os.environ.get("FEDCTL_FORK", "1") != "0"
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

    def _start(self, args: list[str], log: Path, env: Mapping[str, str]
               ) -> subprocess.Popen | ForkedProcess:
        if self.fork and self.profile is None:
            return ForkedProcess(args, log, env, new_session=True)
        return spawn(args, log, env, profile=self.profile, new_session=True)

    def _launch(self, name: str, args: list[str]) -> subprocess.Popen | ForkedProcess:
        """Start process ``name`` and hold it in ``procs``, with the stop signals held until
        both are done: Ctrl-C while the fork server was still importing interrupted the
        launcher's wait for the new pid, and the process, started all the same, was never
        stopped (it ran on, or wrote a traceback once its folder had been moved)."""
        with _signals_held():
            proc = self.procs[name] = self._start(args, self.logs / f"{name}.log",
                                                  child_env(threads=self.threads))
        return proc

    def start_master(self) -> subprocess.Popen | ForkedProcess:
        return self._launch("master", ["master", *self._args()])

    def start_workers(self) -> None:
        for w in self.cfg.workers:
            self._launch(w.name, ["worker", *self._args(), "--id", w.name,
                                  "--threads", str(self.threads)])

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
        return "\n".join(f"{name} exited with code {exit_reason(self.procs[name].returncode)}:"
                         f"\n{tail(self.logs / f'{name}.log', n)}" for name in names)

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
