"""`fedctl run`: a master and N workers as separate processes on this machine, over loopback.

The processes are the same `fedctl master` / `fedctl worker` a user starts by hand; this module
only launches them, shows progress from the master's metrics log, and prints the results.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from tqdm import tqdm

from common.atomic import atomic_write_bytes
from common.config import ClusterConfig, config_to_dict
from common.runlog import read_metrics

log = logging.getLogger("fedctl.run")


def _spawn(args: list[str], logfile: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    fh = open(logfile, "wb")  # noqa: SIM115 - owned by the child, closed when it exits
    return subprocess.Popen([sys.executable, "-m", "fedctl.cli", *args], stdout=fh,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _tail(path: Path, n: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_local_cluster(cfg: ClusterConfig, progress: bool = True, log_level: str = "info") -> int:
    """Run the job; returns the exit code (0 when master and every worker succeeded)."""
    from master.families import SERVER_FAMILIES

    started = time.monotonic()
    out = Path(cfg.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()  # this run's log, not an earlier one's
    config_path = out / "cluster.yaml"
    atomic_write_bytes(config_path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False).encode())

    if cfg.security.curve:  # this machine is every node: make any keys that are missing
        from common.net.security import keygen

        keygen(cfg.security.keys_dir, [w.name for w in cfg.workers])
    family = SERVER_FAMILIES.get(cfg.family)
    if family is not None:
        log.info("preparing %s (once for all %d workers)", cfg.family, len(cfg.workers))
        family.prepare(cfg)
    threads = max(1, (os.cpu_count() or 1) // max(1, len(cfg.workers)))
    common_args = ["--config", str(config_path), "--log-level", log_level]
    procs = {"master": _spawn(["master", *common_args], out / "logs" / "master.log", threads)}
    for w in cfg.workers:
        procs[w.name] = _spawn(["worker", *common_args, "--id", w.name, "--threads",
                                str(threads)], out / "logs" / f"{w.name}.log", threads)
    log.info("started master and %d worker(s); logs in %s", len(cfg.workers), out / "logs")

    bar = tqdm(total=cfg.rounds, desc="rounds", unit="round", disable=not progress,
               dynamic_ncols=True)
    code = 0
    seen = 0
    first_round_at = None
    try:
        while True:
            time.sleep(0.1)
            if metrics_path.exists():
                rounds = [e for e in read_metrics(metrics_path) if e["event"] == "round"]
                if rounds and first_round_at is None:
                    first_round_at = time.monotonic()
                for e in rounds[seen:]:
                    f1 = e.get("mean_macro_f1")
                    bar.set_postfix_str(f"F1 {f1:.3f}, {1000 * e['overhead_s']:.1f} ms overhead"
                                        if f1 is not None else "")
                    bar.update(1)
                seen = max(seen, len(rounds))
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                for name in failed:
                    log.error("%s exited with code %s:\n%s", name, procs[name].returncode,
                              _tail(out / "logs" / f"{name}.log"))
                code = 1
                break
            if all(p.poll() is not None for p in procs.values()):
                break
    except KeyboardInterrupt:
        code = 130
    finally:
        bar.close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    if code:
        return code
    _print_results(out, time.monotonic() - started)
    return 0


def _print_results(out: Path, wall: float) -> None:
    events = read_metrics(out / "metrics.jsonl")
    rounds = [e for e in events if e["event"] == "round"]
    table = (out / "comparison.md").read_text() if (out / "comparison.md").exists() else ""
    click_echo = print
    click_echo("")
    click_echo(table)
    if rounds:
        durations = [e["duration_s"] for e in rounds]
        overheads = [e["overhead_s"] for e in rounds]
        training = sum(durations)
        click_echo(f"wall time {wall:.1f} s for {len(rounds)} round(s): training {training:.2f} s, "
                   f"median round {1000 * statistics.median(durations):.1f} ms, median overhead "
                   f"(round - slowest worker's training) {1000 * statistics.median(overheads):.2f}"
                   f" ms")
    click_echo(f"model, metrics, comparison and logs in {out}")
