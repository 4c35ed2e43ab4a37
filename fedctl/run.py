"""`fedctl run`: a whole cluster on this machine with a live progress bar, then its results.

The processes are the same `fedctl master` / `fedctl worker` a user starts by hand
(:mod:`fedctl.launch` starts them); this module only follows the master's metrics log and
prints the comparison table at the end.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from common.config import ClusterConfig
from common.runlog import read_metrics
from fedctl.launch import LocalCluster

log = logging.getLogger("fedctl.run")

POLL_S = 0.1  # how often the metrics log and the processes are looked at


def run_local_cluster(cfg: ClusterConfig, progress: bool = True, log_level: str = "info") -> int:
    """Run the job; returns the exit code (0 when master and every worker succeeded)."""
    started = time.monotonic()
    cluster = LocalCluster(cfg, log_level=log_level)
    metrics_path = cluster.out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()  # this run's log, not an earlier one's
    log.info("preparing %s (once for all %d workers)", cfg.family, len(cfg.workers))
    cluster.prepare()
    cluster.start()
    log.info("started master and %d worker(s); logs in %s", len(cfg.workers), cluster.logs)
    bar = tqdm(total=cfg.rounds, desc="rounds", unit="round", disable=not progress,
               dynamic_ncols=True)
    code = 0
    try:
        code = _follow(cluster, metrics_path, bar)
    except KeyboardInterrupt:
        code = 130
    finally:
        bar.close()
        cluster.stop()
    if code == 0:
        _print_results(cluster.out, time.monotonic() - started)
    return code


def _follow(cluster: LocalCluster, metrics_path: Path, bar: tqdm) -> int:
    """Advance the bar round by round until every process has exited; 1 if one failed."""
    seen = 0
    while True:
        time.sleep(POLL_S)
        rounds = ([e for e in read_metrics(metrics_path) if e["event"] == "round"]
                  if metrics_path.exists() else [])
        for e in rounds[seen:]:
            f1 = e.get("mean_macro_f1")
            bar.set_postfix_str(f"F1 {f1:.3f}, {1000 * e['overhead_s']:.1f} ms overhead"
                                if f1 is not None else "")
            bar.update(1)
        seen = max(seen, len(rounds))
        failed = cluster.failed()
        if failed:
            log.error("%s", cluster.failure_report(failed))
            return 1
        if not cluster.running():
            break
    return 0


def _print_results(out: Path, wall: float) -> None:
    events = read_metrics(out / "metrics.jsonl")
    rounds = [e for e in events if e["event"] == "round"]
    table = (out / "comparison.md").read_text() if (out / "comparison.md").exists() else ""
    print("")
    print(table)
    if rounds:
        durations = [e["duration_s"] for e in rounds]
        overheads = [e["overhead_s"] for e in rounds]
        print(f"wall time {wall:.1f} s for {len(rounds)} round(s): training {sum(durations):.2f} "
              f"s, median round {1000 * statistics.median(durations):.1f} ms, median overhead "
              f"(round - slowest worker's training) {1000 * statistics.median(overheads):.2f} ms")
    print(f"model, metrics, comparison and logs in {out}")
