"""Section ``scaling``: round time, master CPU and memory and bytes per round against the
number of workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import ClusterConfig
from fedctl.bench.harness import _median, bench_config, run_cluster
from fedctl.bench.plan import Plan


def section_scaling(base: ClusterConfig, plan: Plan, work: Path, log: Callable[[str], None]
                    ) -> dict[str, Any]:
    """Round time, master CPU/memory and bytes per round against the number of workers."""
    out = {}
    for n in plan.scaling_n:
        threads_mode = n >= plan.scaling_threads_from
        per = plan.scaling_threads_per_process
        pools = -(-n // per) if threads_mode and per else 0
        cfg = bench_config(base, work / f"scaling_{n}", n_workers=n, rounds=plan.scaling_rounds,
                           eval_every=0, baselines=False, heartbeat_timeout=60.0,
                           # threads start one after another: ~0.3 s a worker at N = 1,000
                           join_timeout=max(base.join_timeout, 0.6 * n),
                           **{"data.partition": "iid", "data.limit": plan.scaling_limit,
                              "security.mode": "none"})
        how = "processes"
        if threads_mode:
            how = (f"threads of {pools} process{'es' if pools > 1 else ''}" if pools
                   else "threads")
        log(f"scaling: {n} worker(s) as {how}, {plan.scaling_rounds} rounds")
        run = run_cluster(cfg, threads_mode=threads_mode, pools=pools)
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

