"""Section ``compression``: bytes per round and final federated macro-F1 for each update
compression."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import ClusterConfig
from fedctl.bench.harness import _median, bench_config, run_cluster
from fedctl.bench.plan import Plan


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

