"""Fixtures for the multi-process tests: free ports, cluster configs, real `fedctl` processes.

Everything here is real: `fedctl master` / `fedctl worker` / `fedctl run` run as separate Python
processes (``fedctl run`` as ``python -m fedctl.cli``; the masters and workers a test starts
itself forked by the fork server ``fedctl run`` uses) talking ZeroMQ over TCP loopback, on the
bundled dbpedia_10k file and the real sentence-transformer model. Embedding costs ~17 ms per
text on a CPU, so configs keep ``data.limit`` at 600 and share one session-wide embedding cache,
filled once by the ``embed_cache`` fixture, so that no process ever embeds again.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedctl.launch import ForkedProcess, child_env, fedctl_command

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"
LIMIT = 600
CLASSES = ["rest", "MeanOfTransportation"]  # one_vs_rest with the config's default positive


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, this test process's own torch and BLAS pools get its share of the
    cores, as fedctl run gives each of its processes: with a pool as wide as the machine, a
    test that trains in-process beside another process's cluster spins its waiting threads
    (measured: an FSTC fit 2x slower beside two busy cores). Its children keep their own
    settings (nothing here goes into the environment)."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if processes > 1:
        import torch
        from threadpoolctl import threadpool_limits

        from fedctl.launch import usable_cores

        share = max(1, usable_cores() // processes)
        torch.set_num_threads(share)
        threadpool_limits(share)


#: Ports the tests' clusters take, each xdist worker from a slice of its own of these, below
#: the ephemeral ones (32768 on): drawn there by ``bind(0)``, as before, the other worker's
#: tests and every outgoing connection drew from the same pool between a test's pick and its
#: master's bind.
PORTS_FROM, PORTS_SPAN = 20000, 12000
_port_offsets = itertools.count(os.getpid())  # (another session beside this one: elsewhere)


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports on 127.0.0.1 nobody listens on now, from this xdist worker's own slice
    of :data:`PORTS_SPAN` ports, each tried by a bind, in turn from a place of this process's
    own: none is handed out twice before the slice comes round again."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    span = PORTS_SPAN // max(1, int(count) if count.isdigit() else 1)
    base = PORTS_FROM + (int(worker) if worker.isdigit() else 0) * span % PORTS_SPAN
    ports: list[int] = []
    for _ in range(span):
        port = base + next(_port_offsets) % span
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports in {base}..{base + span - 1}")


def free_port() -> int:
    """A TCP port nobody listens on right now (:func:`free_ports`)."""
    return free_ports(1)[0]



def _deep_update(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def config_dict(out_dir: Path, cache_dir: Path | str, workers: int | list[str] = 3,
                rounds: int = 3, **overrides: Any) -> dict[str, Any]:
    """A cluster.yaml as a dict: the bundled data (limit 600), free ports, small timeouts."""
    names = [f"w{i + 1}" for i in range(workers)] if isinstance(workers, int) else list(workers)
    pub, rep = free_ports(2)
    raw: dict[str, Any] = {
        "master": {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub, "rep_port": rep},
        "workers": names,
        "model": {"family": "mlp"},
        "rounds": rounds,
        "min_workers": len(names),
        "round_deadline": 60,
        "join_timeout": 60,
        "data": {"path": str(DATA), "limit": LIMIT, "cache_dir": str(cache_dir)},
        "output_dir": str(out_dir),
        "baselines": False,
        "seed": 0,
    }
    return _deep_update(raw, overrides)


@pytest.fixture(scope="session")
def embed_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session-wide embedding cache holding the 600 documents every config uses: one for
    the whole run, the parallel test processes' too (the cache's file lock lets one compute
    while the others wait, then read)."""
    from common.config import parse_config
    from common.data.shards import local_data, sentence_features

    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each process has its own basetemp inside the run's own folder.
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "embed_cache"
    cache.mkdir(exist_ok=True)
    cfg = parse_config(config_dict(cache / "unused-out", cache), source="<embed_cache>")
    X = sentence_features(cfg, local_data(cfg, "w1").dataset)
    assert X.shape == (LIMIT, 384)
    assert list(cache.glob("*.npy"))  # (the other test processes may have added theirs)
    return cache


MakeConfig = Callable[..., Path]


@pytest.fixture
def make_config(embed_cache: Path) -> MakeConfig:
    """Factory: ``make_config(tmp_path, workers=3, rounds=3, **overrides) -> Path``.

    Writes ``<tmp_path>/cluster.yaml`` (or ``name=...``) with free ports, the bundled data file
    (absolute path, limit 600), the session embedding cache, ``min_workers`` = every worker,
    60 s round deadline and join timeout, ``output_dir`` = ``<tmp_path>/out``, and baselines
    off. ``overrides`` replace top-level fields; mappings (``master``, ``data``, ``model``)
    are merged key by key.
    """

    def make(tmp_path: Path, workers: int | list[str] = 3, rounds: int = 3,
             name: str = "cluster.yaml", **overrides: Any) -> Path:
        raw = config_dict(tmp_path / "out", embed_cache, workers, rounds, **overrides)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return make


def start_worker_threads(cfg: Any, worker_ids: list[str], reports: dict[str, Any],
                         errors: list[BaseException]) -> list[threading.Thread]:
    """Run ``Worker(cfg, id).run()`` for each id on a daemon thread of this process; each
    final report lands in ``reports``, each exception in ``errors``."""
    from worker.client import Worker

    def work(wid: str) -> None:
        try:
            reports[wid] = Worker(cfg, wid).run()
        except BaseException as exc:  # surfaced by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in worker_ids]
    for t in threads:
        t.start()
    return threads


def run_fedctl(*args: str, timeout: float = 60, cache_dir: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``fedctl ARGS`` to completion and capture its output. Past ``timeout`` the test
    fails and whatever it started is killed with it (``fedctl run``'s master and workers have
    sessions of their own: subprocess.run's kill would leave them running)."""
    cmd = fedctl_command(*args)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(cache_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"fedctl {' '.join(args)} still running after {timeout:g}s\n"
                    f"{stdout[-2000:]}{stderr[-4000:]}")
    finally:
        kill_tree(proc)  # nothing left once it has ended by itself
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; empty where /proc is unavailable)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid):
            out.append(int(entry.parent.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process started (directly or not) by ``pid``, deepest first."""
    found: list[int] = []
    for child in _children(pid):
        found += descendants(child)
        found.append(child)
    return found


def kill_tree(proc: subprocess.Popen | ForkedProcess, grace: float = 5.0) -> None:
    """Stop ``proc`` and every process it started (fedctl run's children have their own
    sessions, so killing the parent alone would orphan them)."""
    if proc.poll() is not None:
        return
    kids = descendants(proc.pid)
    for pid in [*kids, proc.pid]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Procs:
    """Starts `fedctl` processes with their output in log files; kills what is left at the end.

    They are forked by the fork server that ``fedctl run`` uses (fedctl/launch.py), torch and
    scikit-learn imported once: each would otherwise spend about 4 s of CPU importing them, some
    200 times in the suite, on the cores the clusters under test share. Each is still its own
    process, with its own sockets, signals and exit status, running ``fedctl``'s own entry point
    (spawned from a fresh interpreter by the ``fedctl run`` tests and the deployment tests).

    Attributes
    ----------
    logs : Path
        Folder of the ``<name>.log`` files.
    procs : dict of str to ForkedProcess (or subprocess.Popen, for a test's own program)
        Each with the part of :class:`subprocess.Popen`'s interface the tests use.
    """

    def __init__(self, logs: Path, cache_dir: Path) -> None:
        self.logs = logs
        self.cache_dir = cache_dir
        self.procs: dict[str, ForkedProcess | subprocess.Popen] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str) -> ForkedProcess:
        proc = ForkedProcess(list(args), self.logs / f"{name}.log", child_env(self.cache_dir),
                             new_session=False, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def master(self, config: Path, *extra: str, name: str = "master") -> ForkedProcess:
        return self.start(name, "master", "--config", str(config), *extra)

    def worker(self, config: Path, worker_id: str, *extra: str) -> ForkedProcess:
        return self.start(worker_id, "worker", "--config", str(config), "--id", worker_id,
                          "--threads", "1", *extra)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, n: int = 15) -> str:
        parts = []
        for name in self.procs:
            lines = self.log(name).splitlines()[-n:]
            parts.append(f"--- {name} (rc {self.procs[name].poll()}) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def check_alive_or_ok(self) -> None:
        """Fail at once (with the logs) if any process has exited with an error."""
        bad = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
        if bad:
            pytest.fail(f"process(es) failed: {bad}\n{self.logs_tail()}")

    def wait_all(self, timeout: float) -> dict[str, int]:
        """Wait (at most ``timeout`` seconds in all) for every process; their exit codes."""
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running after {timeout:g}s\n{self.logs_tail()}")
        return {n: p.returncode for n, p in self.procs.items()}

    def stop_all(self) -> None:
        for p in self.procs.values():
            kill_tree(p)


def run_job(config: Path, logs: Path, cache_dir: Path,
            workers: tuple[str, ...] = ("w1", "w2", "w3"), timeout: float = 400) -> None:
    """Run a job to its end (``fedctl master`` and one ``fedctl worker`` each, logs in
    ``logs``) and fail the test, with the logs' tails, unless every process exits 0."""
    procs = Procs(logs, cache_dir)
    try:
        procs.master(config)
        for w in workers:
            procs.worker(config, w)
        codes = procs.wait_all(timeout=timeout)
        assert set(codes.values()) == {0}, procs.logs_tail()
    finally:
        procs.stop_all()


@pytest.fixture
def procs(tmp_path: Path, embed_cache: Path) -> Iterator[Procs]:
    """A :class:`Procs` whose processes are all killed when the test ends."""
    p = Procs(tmp_path / "logs", embed_cache)
    try:
        yield p
    finally:
        p.stop_all()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             check: Callable[[], None] | None = None, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned), at most ``timeout`` s.

    ``check`` runs each turn too and may fail the test early (e.g. a process died).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def events(out_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of ``<out_dir>/metrics.jsonl`` (of one kind if given); [] if none yet."""
    from common.runlog import read_metrics

    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    evs = read_metrics(path)
    return [e for e in evs if kind is None or e["event"] == kind]
