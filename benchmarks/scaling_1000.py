"""Round time, master CPU and memory from 1 to 1,000 workers (issue 30, item 5).

``fedctl bench``'s scaling section (``fedctl/bench/scaling.py``) taken further: the default
model (mlp, hidden 256: 99 k parameters) on all of ``data/dbpedia_10k`` split iid among N
workers (N = 1 … 1,000; about 8 training documents each at N = 1,000), 3 rounds, evaluation
off, security none (loopback), baselines off. The master is a process; the workers are
processes below 30 and from 30 threads of a few processes of at most
``--threads-per-process`` each (:mod:`fedctl.bench.worker_pool`, one torch thread a process:
1,000 processes of a few hundred MB would not fit, and 1,000 threads of one process starve
each other of the interpreter lock). Master CPU (cores) and memory (VmRSS max, VmHWM)
from /proc over the rounds. The goal: 1,000 workers complete 3 rounds with the master's peak
resident memory at most 2 GiB.

Usage: ``python benchmarks/scaling_1000.py [--n 1,3,10,30,100,300,1000] [--rounds 3]
[--threads-per-process 125] [--replot]``. Writes ``benchmarks/results/scaling_1000.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.config import load_config  # noqa: E402
from fedctl.bench.plan import Plan  # noqa: E402
from fedctl.bench.report import command_line, current_commit  # noqa: E402
from fedctl.bench.scaling import section_scaling  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL_MIB = 2048


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(ns, [1000 * r["median_round_s"] for r in rows], "o-", label="median round")
    a.plot(ns, [1000 * r["median_overhead_s"] for r in rows], "s--",
           label="overhead (round − slowest training)")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("workers (processes below 30, then threads of a few processes)")
    a.set_ylabel("ms")
    a.set_title("Round time against the number of workers")
    a.legend(frameon=False, fontsize=8)
    b.plot(ns, [r["master_hwm_mib"] for r in rows], "o-", color="#c44e52",
           label="master peak memory (VmHWM)")
    b.axhline(GOAL_MIB, color="grey", ls=":", label="goal: 2 GiB")
    b2 = b.twinx()
    b2.plot(ns, [r["master_cpu_cores"] for r in rows], "s--", color="#55a868",
            label="master CPU (cores)")
    b2.set_ylabel("master CPU, cores")
    b2.set_ylim(0, 1.2)
    b.set_xscale("log")
    b.set_ylim(0, max(GOAL_MIB * 1.1, max(r["master_hwm_mib"] for r in rows) * 1.1))
    b.set_xlabel("workers")
    b.set_ylabel("MiB")
    b.set_title("The master's memory and CPU")
    lines = b.get_legend_handles_labels()
    lines2 = b2.get_legend_handles_labels()
    b.legend(lines[0] + lines2[0], lines[1] + lines2[1], frameon=False, fontsize=8,
             loc="center left")
    for ax in (a, b):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(saved: dict[str, Any], results: Path) -> None:
    rows = saved["rows"]
    plot(results / "scaling_1000.png", rows)
    big = rows[-1]
    met = (big["n"] >= 1000 and big["completed_rounds"] >= saved["rounds"]
           and big["all_updates"] and big["master_hwm_mib"] <= GOAL_MIB)
    lines = ["# Scaling to 1,000 workers", "", f"`{saved['command']}`", "",
             __doc__.split("\n\n", 1)[1].split("Usage:")[0].strip(), "",
             f"Load average before / after: {saved['load_before'][0]:.1f} / "
             f"{saved['load_after'][0]:.1f} (2 cores, shared); {saved['minutes']:.1f} min in "
             f"all; commit {saved['commit']}.", "",
             "| N | workers as | rounds done | every update | median round, ms | median "
             "overhead, ms | master publish, ms | slowest broadcast, ms | update bytes a round "
             "| master CPU, cores | master RSS max, MiB | master peak (VmHWM), MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['mode']} | {r['completed_rounds']} | "
            f"{'yes' if r['all_updates'] else '**no**'} | {1000 * r['median_round_s']:.1f} | "
            f"{1000 * r['median_overhead_s']:.1f} | {1000 * r['median_publish_s']:.2f} | "
            f"{1000 * r['median_broadcast_latency_max_s']:.1f} | {r['bytes_in']:,.0f} | "
            f"{r['master_cpu_cores']:.2f} | {r['master_rss_mib']:.0f} | "
            f"{r['master_hwm_mib']:.0f} |")
    lines += ["", f"Goal (1,000 workers, {saved['rounds']} rounds, master peak ≤ 2 GiB): "
              f"**{'met' if met else 'not met'}**"
              f"{'' if big['n'] >= 1000 else ' (the largest N run is ' + str(big['n']) + ')'}.", "",
              *([saved["note"], ""] if saved.get("note") else []),
              "![scaling](scaling_1000.png)", ""]
    (results / "scaling_1000.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1,3,10,30,100,300,1000",
                    help="comma-separated numbers of workers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads-per-process", type=int, default=125,
                    help="worker threads a process at most (0: all in this process)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--replot", action="store_true",
                    help="redraw the table and figure from the saved JSON")
    ap.add_argument("--note", default=None, help="a paragraph for the report, kept in the JSON")
    args = ap.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    saved_path = args.results / "scaling_1000.json"
    if args.replot:
        saved = json.loads(saved_path.read_text())
        if args.note:
            saved["note"] = args.note
            saved_path.write_text(json.dumps(saved, indent=1, default=float))
        report(saved, args.results)
        return
    plan = Plan(scaling_n=[int(n) for n in args.n.split(",")], scaling_rounds=args.rounds,
                scaling_limit=10_000, scaling_threads_per_process=args.threads_per_process)
    work = args.work or Path(tempfile.mkdtemp(prefix="scaling-"))
    load = os.getloadavg()
    t0 = time.monotonic()
    out = section_scaling(load_config(ROOT / "cluster.yaml"), plan, work,
                          lambda s: print(f"[scaling] {s}", file=sys.stderr, flush=True))
    rows = [{k: v for k, v in r.items() if k != "run"} for r in out.values()]
    commit = current_commit(ROOT)
    saved = {"rows": rows, "rounds": args.rounds, "command": command_line(ROOT), "note": args.note,
             "load_before": load, "load_after": os.getloadavg(),
             "minutes": (time.monotonic() - t0) / 60, "commit": commit}
    saved_path.write_text(json.dumps(saved, indent=1, default=float))
    report(saved, args.results)


if __name__ == "__main__":
    main()
