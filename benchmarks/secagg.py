"""What secure aggregation costs a round (issue 25).

The default job (``cluster.yaml``: the mlp one-vs-rest classifier on ``data/dbpedia_10k``,
Dirichlet α 0.5), ``security: none`` (loopback; CURVE's cost is the same with or without
secure aggregation), baselines off, 10 rounds, plain and with ``privacy.secure_aggregation``
(threshold: a majority; every pair of workers joined, or ``neighbours: 4``). Cells: model
size (``hidden`` 256: 99 k parameters, the default; 4096: 1.6 M; 65536: 25 M, on the first
600 documents and half the rounds) × workers (3 processes, as ``fedctl run`` starts them; 10
and 30 as threads of one process, one torch thread each). Each cell is
run ``--repeats`` times; a run's figure is its median round (from round 2: round 1 carries the
set-up), and the table gives the median over the runs with their min-max. *Overhead* is the
round less its slowest worker's training; *secure − plain* compares the medians.

Also, on one thread, the arithmetic alone for one worker's update: quantizing, the ChaCha20
masks (one self mask and one per neighbour) and, on the master, the unmasking of n inputs.

Usage: ``python benchmarks/secagg.py [--work DIR] [--repeats 3] [--rounds 10] [--hidden H]
[--replot]``. Writes
``benchmarks/results/secagg.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.config import load_config  # noqa: E402
from common.secagg import crypto  # noqa: E402
from common.secagg import protocol as P  # noqa: E402
from common.secagg.params import SecAggParams  # noqa: E402
from common.secagg.ring import levels, quantize  # noqa: E402
from fedctl.bench.harness import bench_config, n_params, run_cluster  # noqa: E402
from fedctl.bench.report import command_line, median_range  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CELLS = (  # (hidden, workers, threads, neighbours)
    (256, 3, False, None),
    (256, 10, True, None),
    (256, 10, True, 4),
    (256, 30, True, None),
    (256, 30, True, 4),
    (4096, 3, False, None),
    (4096, 10, True, None),
    (4096, 10, True, 4),
    (65536, 3, False, None),
)
#: ``data.limit`` per model size: at 25 M parameters a worker's epoch over its full share would
#: take most of a minute on one thread; what is measured is the rest of the round.
LIMIT = {65536: 600}


def run_one(work: Path, hidden: int, n: int, threads: bool, secure: dict | None,
            rounds: int, repeat: int) -> dict[str, Any]:
    base = load_config(ROOT / "cluster.yaml")
    extra = {"data.limit": LIMIT[hidden]} if hidden in LIMIT else {}
    cfg = bench_config(base, work / "out", n_workers=n, rounds=rounds, baselines=False,
                       **{"model.hidden": hidden, "security": "none", **extra})
    cfg.min_workers = n
    if secure is not None:
        cfg.privacy.secure_aggregation = SecAggParams(**secure)
    res = run_cluster(cfg, threads_mode=threads, timeout=1800)
    rs = [r for r in res["rounds"] if r["round"] > 1]
    return {"hidden": hidden, "workers": n, "threads": threads, "secure": secure,
            "repeat": repeat,
            "round_s": statistics.median(r["duration_s"] for r in rs),
            "overhead_s": statistics.median(r["overhead_s"] for r in rs),
            "train_s": statistics.median(r["slowest_train_s"] for r in rs),
            "bytes_in": statistics.median(r["bytes_in"] for r in rs),
            "pooled_f1": (res.get("pooled") or {}).get("federated", {}).get("macro_f1")}


def arithmetic(size: int, n: int, k: int, repeats: int = 5) -> dict[str, float]:
    """Seconds, on this thread, for one worker's quantize + masks and the master's unmask."""
    rng = np.random.default_rng(0)
    vec = rng.uniform(-0.01, 0.01, size)
    L = levels(n)
    keys = [crypto.new_seed() for _ in range(k)]
    seed = crypto.new_seed()
    worker, master = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = P.masked_input(quantize(vec, 1.0, L), seed, "w1",
                           {f"w{i + 2}": key for i, key in enumerate(keys)})
        worker.append(time.perf_counter() - t0)
        inputs = {f"w{i}": y for i in range(n)}
        t0 = time.perf_counter()
        P.unmask(inputs, {f"w{i}": seed for i in range(n)}, {})
        master.append(time.perf_counter() - t0)
    return {"worker_s": statistics.median(worker), "master_s": statistics.median(master)}


def label(secure: dict | None) -> str:
    if secure is None:
        return "plain"
    return "secure, k = " + (str(secure["neighbours"]) if secure.get("neighbours") else "all")


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """Each cell's round overhead (the round less its slowest training), plain and secure, on
    a log scale: the cells span 10 ms to seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["hidden"], r["workers"]) for r in rows})
    modes = ["plain", "secure, k = all", "secure, k = 4"]
    colours = {"plain": "#4c72b0", "secure, k = all": "#dd8452", "secure, k = 4": "#55a868"}
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.27
    for j, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for i, (h, n) in enumerate(groups):
            vals = [1000 * r["overhead_s"] for r in rows
                    if (r["hidden"], r["workers"]) == (h, n) and label(r["secure"]) == mode]
            if vals:
                m = statistics.median(vals)
                xs.append(i + (j - 1) * width)
                ys.append(m)
                lo.append(m - min(vals))
                hi.append(max(vals) - m)
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=mode, color=colours[mode])
            for x, y, up in zip(xs, ys, hi, strict=True):  # above the error bar
                ax.text(x, (y + up) * 1.08, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{n_params(h) / 1e6:.2g} M params\n{n} workers" for h, n in groups],
                       fontsize=8)
    ax.set_ylabel("round overhead, ms (log scale)")
    ax.set_title("Round overhead (round less its slowest training) with and without secure "
                 "aggregation, loopback; median and min–max of the runs")
    ax.title.set_fontsize(10)
    ax.legend(frameon=False)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--hidden", type=int, action="append", default=[],
                    help="only the cells of this hidden width (repeatable); the others' rows "
                         "are kept from the saved results")
    ap.add_argument("--replot", action="store_true",
                    help="redraw secagg.png from the results' secagg.json, running nothing")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads((args.results / "secagg.json").read_text())
        plot(args.results / "secagg.png", saved["rows"])
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="secagg-bench-"))
    load = os.getloadavg()
    t_start = time.monotonic()
    cells = [c for c in CELLS if not args.hidden or c[0] in args.hidden]
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for hidden, n, threads, k in cells:
            # The plain run of n workers is the k = all cell's.
            modes: list[dict | None] = [{"neighbours": k}] if k else [None, {}]
            for secure in modes:
                row = run_one(work / f"r{repeat}-h{hidden}-n{n}-{label(secure)}", hidden,
                              n, threads, secure,
                              args.rounds if hidden not in LIMIT else max(3, args.rounds // 2),
                              repeat)
                rows.append(row)
                print(f"hidden {hidden}, {n} workers, {label(secure)}: round "
                      f"{1000 * row['round_s']:.1f} ms, overhead "
                      f"{1000 * row['overhead_s']:.1f} ms", flush=True)
    sizes = sorted({h for h, *_ in cells})
    arith = {f"{n_params(h)}": arithmetic(n_params(h) + 1, 10, 9) for h in sizes}
    minutes = (time.monotonic() - t_start) / 60
    args.results.mkdir(parents=True, exist_ok=True)
    saved = args.results / "secagg.json"
    kept: list[int] = []
    if args.hidden and saved.exists():  # the other sizes' rows stay as they were measured
        old = json.loads(saved.read_text())
        kept = sorted({r["hidden"] for r in old["rows"] if r["hidden"] not in sizes})
        rows = [r for r in old["rows"] if r["hidden"] not in sizes] + rows
        arith = {**{k: v for k, v in old["arithmetic"].items()
                    if int(k) not in {n_params(h) for h in sizes}}, **arith}
    saved.write_text(json.dumps(
        {"rows": rows, "arithmetic": arith, "load_before": load,
         "load_after": os.getloadavg(), "minutes": minutes}, indent=1))
    plot(args.results / "secagg.png", rows)
    lines = ["# Secure aggregation: what a round costs", "",
             f"`{command_line(ROOT)}`", "",
             __doc__.split("\n\n", 1)[1].split("Usage:")[0].strip(), "",
             f"Load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} "
             f"(2 cores, shared); {minutes:.1f} min in all." + (
                 f" The rows of {', '.join(f'{n_params(h) / 1e6:.2g} M' for h in kept)} "
                 f"parameters are kept from the saved results of an earlier run."
                 if kept else ""), "",
             "| parameters | workers | mode | median round, ms | overhead, ms | slowest "
             "training, ms | bytes in a round | round: secure − plain, ms | overhead: "
             "secure − plain, ms (× plain) |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups = sorted({(r["hidden"], r["workers"]) for r in rows})
    for h, n in groups:
        plain = [r["round_s"] for r in rows if (r["hidden"], r["workers"]) == (h, n)
                 and r["secure"] is None]
        plain_over = [r["overhead_s"] for r in rows if (r["hidden"], r["workers"]) == (h, n)
                      and r["secure"] is None]
        for mode in ("plain", "secure, k = all", "secure, k = 4"):
            rs = [r for r in rows if (r["hidden"], r["workers"]) == (h, n)
                  and label(r["secure"]) == mode]
            if not rs:
                continue
            gap = statistics.median(r["round_s"] for r in rs) - statistics.median(plain or [0])
            extra = "—" if mode == "plain" or not plain else f"{1000 * gap:+.1f}"
            over = statistics.median(r["overhead_s"] for r in rs)
            extra += " | " + ("—" if mode == "plain" or not plain_over else
                              f"{1000 * (over - statistics.median(plain_over)):+.1f} "
                              f"(× {over / statistics.median(plain_over):.2f})")
            lines.append(
                f"| {n_params(h) / 1e6:.2g} M | {n}{' (threads)' if rs[0]['threads'] else ''} "
                f"| {mode} | {median_range([1000 * r['round_s'] for r in rs], 1)} | "
                f"{median_range([1000 * r['overhead_s'] for r in rs], 1)} | "
                f"{median_range([1000 * r['train_s'] for r in rs], 1)} | "
                f"{statistics.median(r['bytes_in'] for r in rs):,.0f} | {extra} |")
    lines += ["", "![round time](secagg.png)", "",
              "The arithmetic alone (one thread; 10 workers, 9 neighbours each):", "",
              "| parameters | a worker: quantize + 10 masks, ms | the master: unmask 10 "
              "inputs, ms |",
              "|---|---|---|"]
    for size, a in arith.items():
        lines.append(f"| {int(size) / 1e6:.2g} M | {1000 * a['worker_s']:.1f} | "
                     f"{1000 * a['master_s']:.1f} |")
    (args.results / "secagg.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
