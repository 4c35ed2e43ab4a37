"""Strategies under label skew (issue 27): which aggregation to pick when the workers' data differ.

The default job (``cluster.yaml``: the mlp one-vs-rest classifier, MeanOfTransportation against
the rest, on ``data/dbpedia_10k``) split among 10 workers w1..w10 by a Dirichlet partition at
``alpha`` 0.1 (strong skew) and 0.5 (the default), ``security: {mode: none}``, ``min_workers:
10``, 30 rounds (10 more than the default, so that the rounds to 0.95 can be seen), seeds 0, 1,
2 (the config's ``seed``: the partition, the initial weights, the batch order). Strategies:
FedAvg; FedProx with ``proximal_mu`` 0.01 and 0.1; SCAFFOLD (``server_learning_rate`` 1.0);
FedAvgM (``server_momentum`` 0.9, Flower's usual; ``server_learning_rate`` 1.0); FedAdam with
``eta`` 0.01 (the MLP's weights are ~0.05 in scale, the default 0.1 would be a large step;
``beta_1`` 0.9, ``beta_2`` 0.99, ``tau`` 1e-3 as default). Each run is one ``fedctl run
--config <file> --no-progress`` (master and workers as processes, embeddings from the cache).

Per (alpha, strategy, seed):

* **rounds to 0.95**: the rounds trained before the global model's ``mean_macro_f1`` (the
  workers' mean macro-F1 on their own test splits, logged at each round's start in
  ``metrics.jsonl``; after the last round, the comparison's federated column) first reaches
  0.95; "not in 30" where it never does;
* **final mean macro-F1**: the final model's federated macro-F1 averaged over the workers
  (``summary.json``);
* **final pooled macro-F1**: the final model scored on all the workers' test splits together,
  recomputed here from ``model.npz`` exactly as ``baselines: true`` does; this is the number
  comparable with the centralized reference. At alpha 0.1 many workers' test splits hold no or
  a handful of positives, where one false positive halves that worker's macro-F1, so the
  workers' mean is a harsh, noisy score and the pooled one the goal's.

``baselines: true`` in one run per alpha only (FedAvg, seed 0): its pooled centralized
macro-F1 (a model trained on all workers' training data, same epochs) is the reference. Runs
are done seed 0 first for every cell, then seed 1, then seed 2, until ``--budget-min`` would be
passed; the table says how many seeds each cell has (median, min-max).

Usage: ``python benchmarks/skew.py [--work DIR] [--budget-min 45] [--seeds 0,1,2]
[--report-only]``. A run whose ``run.json`` is in the work folder is not run again. Writes
``benchmarks/results/skew.{md,json,png}`` (``--results`` elsewhere).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.runlog import read_metrics  # noqa: E402
from fedctl.bench.report import command_line, median_range  # noqa: E402
from fedctl.launch import child_env, fedctl_command  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BASE = ROOT / "cluster.yaml"
ALPHAS = (0.1, 0.5)
SEEDS = (0, 1, 2)
ROUNDS = 30
TARGET = 0.95
N_WORKERS = 10
RUN_TIMEOUT_S = 600

#: label -> the config's ``strategy``
STRATEGIES: dict[str, Any] = {
    "FedAvg": "fedavg",
    "FedProx μ=0.01": {"name": "fedprox", "proximal_mu": 0.01},
    "FedProx μ=0.1": {"name": "fedprox", "proximal_mu": 0.1},
    "SCAFFOLD": "scaffold",
    "FedAvgM β=0.9": {"name": "fedavgm", "server_momentum": 0.9},
    "FedAdam η=0.01": {"name": "fedadam", "eta": 0.01},
}
SLUG = {"FedAvg": "fedavg", "FedProx μ=0.01": "fedprox_0.01", "FedProx μ=0.1": "fedprox_0.1",
        "SCAFFOLD": "scaffold", "FedAvgM β=0.9": "fedavgm", "FedAdam η=0.01": "fedadam"}


def write_config(folder: Path, alpha: float, strategy: Any, seed: int, baselines: bool) -> Path:
    cfg = yaml.safe_load(BASE.read_text())
    cfg["workers"] = [{"name": f"w{i}"} for i in range(1, N_WORKERS + 1)]
    cfg["data"] = {**cfg["data"], "alpha": alpha,
                   "path": str((BASE.parent / cfg["data"]["path"]).resolve())}
    cfg["security"] = {"mode": "none"}
    cfg.update(rounds=ROUNDS, min_workers=N_WORKERS, strategy=copy.deepcopy(strategy),
               seed=seed, baselines=baselines, output_dir=str(folder / "out"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return path


_FEATURES: dict[str, Any] = {}


def pooled_federated(cfg_path: Path, out: Path) -> float:
    """The final model's macro-F1 on all workers' test splits together, as
    ``master.baselines.mlp_baselines`` scores its "federated" row."""
    from common.config import load_config
    from common.data.shards import local_data, sentence_features
    from common.models.mlp_params import MLPParams

    cfg = load_config(cfg_path)
    shards = {w.name: local_data(cfg, w.name) for w in cfg.workers}
    test = np.concatenate([s.test_index for s in shards.values()])
    first = next(iter(shards.values()))
    if "X" not in _FEATURES:
        _FEATURES["X"] = sentence_features(cfg, first.dataset)
    X = _FEATURES["X"]
    classes = json.loads((out / "model.json").read_text())["setup"]["classes"]
    y = np.array([classes.index(c) for c in first.classes])[first.y]
    arrays = np.load(out / "model.npz")
    clf = MLPParams(**cfg.family_params).classifier(X.shape[1], len(first.classes))
    clf.set_arrays({k: arrays[k] for k in arrays.files})
    return float(clf.score(X[test], y[test])["macro_f1"])


def run_one(folder: Path, alpha: float, label: str, seed: int, baselines: bool
            ) -> dict[str, Any]:
    done = folder / "run.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = write_config(folder, alpha, STRATEGIES[label], seed, baselines)
    out = folder / "out"
    t0 = time.monotonic()
    with open(folder / "fedctl.log", "w") as log:
        try:
            rc = subprocess.run(fedctl_command("run", "--config", str(cfg), "--no-progress"),
                                cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                timeout=RUN_TIMEOUT_S, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.monotonic() - t0
    r: dict[str, Any] = {"alpha": alpha, "strategy": label, "config_strategy": STRATEGIES[label],
                         "seed": seed, "baselines": baselines, "exit": rc, "wall_s": wall,
                         "out": str(out)}
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("w*.log")) \
        if (out / "logs").exists() else ""
    r["embedding_cache_hits"] = logs.count("embeddings: cache hit")
    if rc != 0 or not (out / "summary.json").exists():
        r["error"] = f"exit {rc}"
        done.write_text(json.dumps(r, indent=2))
        return r
    summary = json.loads((out / "summary.json").read_text())
    curve = [e["mean_macro_f1"] for e in read_metrics(out / "metrics.jsonl")
             if e["event"] == "round"]
    fed = [row["federated_macro_f1"] for row in summary["comparison"]]
    r["final_mean_f1"] = float(np.mean(fed))
    # curve[k]: the model after k rounds (round k+1's start); then the final model
    r["curve"] = curve + [r["final_mean_f1"]]
    r["rounds_to_target"] = next((k for k, f in enumerate(r["curve"]) if f >= TARGET), None)
    r["final_pooled_f1"] = pooled_federated(cfg, out)
    if summary.get("pooled"):
        r["pooled"] = {k: v["macro_f1"] for k, v in summary["pooled"].items()}
        r["centralized_pooled_f1"] = summary["pooled"]["centralized"]["macro_f1"]
        r["centralized_mean_f1"] = float(np.mean(
            [row["centralized_macro_f1"] for row in summary["comparison"]]))
    done.write_text(json.dumps(r, indent=2))
    return r


def rounds_cell(rs: list[dict[str, Any]]) -> str:
    """Median (min-max) of the rounds to the target; "not in 30" counts as larger than any."""
    vals = sorted(float("inf") if r["rounds_to_target"] is None else r["rounds_to_target"]
                  for r in rs)
    if not vals:
        return "—"

    def show(v: float) -> str:
        return f"not in {ROUNDS}" if v == float("inf") else f"{v:g}"

    med = statistics.median(vals)
    if len(vals) == 1:
        return show(med)
    return f"{show(med)} ({show(vals[0])}–{show(vals[-1])})"


def median_curve(rs: list[dict[str, Any]]) -> np.ndarray:
    return np.median(np.array([r["curve"] for r in rs]), axis=0)


def plot(path: Path, cells: dict[tuple[float, str], list[dict[str, Any]]],
         central: dict[float, dict[str, float]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ALPHAS), figsize=(12, 4.6), sharey=True)
    colors = plt.get_cmap("tab10")
    styles = {"FedProx μ=0.01": "--", "FedProx μ=0.1": ":"}
    for ax, alpha in zip(axes, ALPHAS, strict=True):
        for i, label in enumerate(STRATEGIES):
            rs = cells.get((alpha, label), [])
            if not rs:
                continue
            c = median_curve(rs)
            ax.plot(range(len(c)), c, styles.get(label, "-"), color=colors(i), lw=1.6,
                    label=f"{label} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
        ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
        ax.text(0.5, TARGET + 0.004, f"{TARGET}", color="grey", fontsize=8)
        if alpha in central and "mean" in central[alpha]:
            ax.axhline(central[alpha]["mean"], color="black", lw=0.8, ls="-.")
            ax.text(ROUNDS - 0.5, central[alpha]["mean"] - 0.006,
                    "centralized (workers' mean, seed 0)", fontsize=8, ha="right", va="top")
        ax.set_title(f"Dirichlet α = {alpha}, 10 workers")
        ax.set_xlabel("rounds trained")
        ax.set_xlim(0, ROUNDS)
        ax.set_ylim(0.4, 1.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("workers' mean macro-F1 of the global model\n(median over seeds)")
    axes[-1].legend(loc="lower right", fontsize=8)
    fig.suptitle("mlp one-vs-rest on dbpedia_10k: global model per round, by strategy",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/skew_work"),
                    help="folder of the runs' configs, outputs and logs")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--budget-min", type=float, default=45.0,
                    help="start no run that would end past this many minutes")
    ap.add_argument("--report-only", action="store_true",
                    help="only tabulate the runs already in --work")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    command = command_line(ROOT)
    seeds = [int(s) for s in args.seeds.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    rebuilt = ""
    if args.report_only and (args.work / "command.txt").exists():  # the command that ran them
        rebuilt = f" (tables rebuilt by `{command}`)"
        command = (args.work / "command.txt").read_text().strip()
    else:
        (args.work / "command.txt").write_text(command + "\n")
    print(f"work folder (configs, outputs, logs): {args.work}", flush=True)
    t_all = time.monotonic()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    walls: list[float] = []
    for seed in seeds:  # seed 0 for every cell first
        for alpha in ALPHAS:
            for label in STRATEGIES:
                folder = args.work / f"alpha{alpha}" / SLUG[label] / f"seed{seed}"
                baselines = label == "FedAvg" and seed == seeds[0]
                cached = (folder / "run.json").exists()
                if args.report_only and not cached:
                    continue
                elapsed = time.monotonic() - t_all
                guess = max(walls) if walls else 90.0
                if not cached and elapsed + guess > args.budget_min * 60:
                    skipped.append(f"alpha {alpha} {label} seed {seed}")
                    continue
                r = run_one(folder, alpha, label, seed, baselines)
                if not cached:
                    walls.append(r["wall_s"])
                runs.append(r)
                print(f"alpha {alpha} {label:15s} seed {seed}: "
                      f"{r.get('error') or ''}rounds to {TARGET} "
                      f"{r.get('rounds_to_target')}, final mean "
                      f"{r.get('final_mean_f1', float('nan')):.4f}, pooled "
                      f"{r.get('final_pooled_f1', float('nan')):.4f}, {r['wall_s']:.0f} s, "
                      f"cache hits {r['embedding_cache_hits']}, "
                      f"{(time.monotonic() - t_all) / 60:.1f} min so far", flush=True)
    wall = time.monotonic() - t_all

    ok = [r for r in runs if "error" not in r]
    failed = [r for r in runs if "error" in r]
    cells: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in ok:
        cells.setdefault((r["alpha"], r["strategy"]), []).append(r)
    central: dict[float, dict[str, float]] = {}
    for r in ok:
        if "centralized_pooled_f1" in r:
            central[r["alpha"]] = {"pooled": r["centralized_pooled_f1"],
                                   "mean": r["centralized_mean_f1"],
                                   "federated_pooled_same_run": r["final_pooled_f1"],
                                   "seed": r["seed"]}

    rows = []
    for alpha in ALPHAS:
        for label in STRATEGIES:
            rs = sorted(cells.get((alpha, label), []), key=lambda r: r["seed"])
            # the centralized model saw seed 0's partition: compare on the same test splits
            gap = [100 * (r["final_pooled_f1"] - central[alpha]["pooled"]) for r in rs
                   if alpha in central and r["seed"] == central[alpha]["seed"]]
            rows.append(
                f"| {alpha} | {label} | {len(rs)} ({','.join(str(r['seed']) for r in rs)}) | "
                f"{rounds_cell(rs)} | {median_range([r['final_mean_f1'] for r in rs])} | "
                f"{median_range([r['final_pooled_f1'] for r in rs])} | "
                f"{f'{gap[0]:+.2f}' if gap else '—'} |")
    table = [
        f"| α | strategy | seeds | rounds to mean macro-F1 ≥ {TARGET} | final mean macro-F1 "
        "(workers) | final pooled macro-F1 | seed 0: pooled − centralized, points |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    ref = [f"* α = {a}: centralized pooled macro-F1 **{c['pooled']:.4f}** (workers' mean "
           f"{c['mean']:.4f}); the same run's FedAvg: pooled {c['federated_pooled_same_run']:.4f}"
           f" (seed {c['seed']}, `baselines: true`)" for a, c in sorted(central.items())]
    best = {}
    for alpha in ALPHAS:
        meds = {label: statistics.median([r["final_pooled_f1"] for r in cells[(alpha, label)]])
                for label in STRATEGIES if cells.get((alpha, label))}
        if meds:
            b = max(meds, key=meds.get)
            best[alpha] = {"strategy": b, "median_pooled_f1": meds[b],
                           "seed0_centralized_minus_median_points": (
                               100 * (central[alpha]["pooled"] - meds[b])
                               if alpha in central else None)}
            if alpha in central:  # on the centralized run's own partition
                s0 = {r["strategy"]: r["final_pooled_f1"] for r in ok
                      if r["alpha"] == alpha and r["seed"] == central[alpha]["seed"]}
                b0 = max(s0, key=s0.get)
                best[alpha]["same_seed"] = {
                    "seed": central[alpha]["seed"], "strategy": b0, "pooled_f1": s0[b0],
                    "centralized_minus_best_points": 100 * (central[alpha]["pooled"] - s0[b0])}
    counts = {f"{a} {lab}": len(cells.get((a, lab), [])) for a in ALPHAS for lab in STRATEGIES}

    md_lines = [
        "# Strategies under label skew: 10 workers, Dirichlet α 0.1 and 0.5",
        "",
        f"`{command}`{rebuilt}",
        "",
        f"The default job (`cluster.yaml`: mlp one-vs-rest, MeanOfTransportation vs the rest, "
        f"data/dbpedia_10k, hidden 256, Adam lr 1e-3, 1 local epoch, batch 64) on 10 workers "
        f"w1..w10, Dirichlet partition, `security: {{mode: none}}`, `min_workers: 10`, "
        f"**{ROUNDS} rounds** (not the default 20, so that the rounds to {TARGET} can be seen), "
        f"seeds {', '.join(map(str, seeds))} (the config's `seed`: partition, initial weights, "
        f"batch order). One `fedctl run --config <file> --no-progress` per run; embeddings "
        f"from the cache. FedProx `proximal_mu` 0.01 / 0.1; SCAFFOLD `server_learning_rate` "
        f"1.0; FedAvgM `server_momentum` 0.9, `server_learning_rate` 1.0; FedAdam `eta` 0.01 "
        f"(`beta_1` 0.9, `beta_2` 0.99, `tau` 1e-3). {os.cpu_count()} CPU cores shared with "
        f"other work; {len(runs)} runs, {sum(r['wall_s'] for r in runs) / 60:.1f} min of "
        f"`fedctl run` wall time in all (about {statistics.median(r['wall_s'] for r in runs):.0f}"
        f" s a run, those with baselines longer). Work folder: `{args.work}`.",
        "",
        f"*Rounds to {TARGET}*: rounds trained before the global model's `mean_macro_f1` (the "
        f"workers' mean macro-F1 on their own test splits, logged at each round's start; after "
        f"round {ROUNDS}, the summary's) first reaches {TARGET}. *Final mean*: the summary's "
        f"federated macro-F1 averaged over the 10 workers. *Final pooled*: the final model on "
        f"all workers' test splits together (recomputed from `model.npz` as `baselines: true` "
        f"does), the number comparable with the pooled centralized model. Cells: median "
        f"(min–max) over the seeds listed.",
        "",
        *table,
        "",
        "Centralized reference (a model on all workers' training data pooled, "
        f"{ROUNDS} epochs, one run per α):",
        "",
        *ref,
    ]
    if failed:
        md_lines += ["", "Failed runs: " + "; ".join(
            f"α {r['alpha']} {r['strategy']} seed {r['seed']}: {r['error']}" for r in failed)]
    if skipped:
        md_lines += ["", f"Not run (out of the {args.budget_min:g}-minute budget): "
                     + "; ".join(skipped)]
    md_lines += ["", "![mean macro-F1 per round](skew.png)", ""]
    md = "\n".join(md_lines)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "skew.md").write_text(md + "\n")
    res = {"command": command, "work": str(args.work), "wall_s": wall,
           "runs_wall_s": sum(r["wall_s"] for r in runs), "rounds": ROUNDS,
           "target": TARGET, "cpu_count": os.cpu_count(), "strategies": STRATEGIES,
           "centralized": {str(a): c for a, c in central.items()},
           "best_by_median_pooled": {str(a): b for a, b in best.items()},
           "seeds_per_cell": counts, "skipped": skipped, "runs": runs}
    (args.results / "skew.json").write_text(json.dumps(res, indent=2, ensure_ascii=False))
    plot(args.results / "skew.png", cells, central)
    print(md)


if __name__ == "__main__":
    main()
