"""What differential privacy costs on the default job (issue 26).

**Record-level DP-SGD.** The default job (``cluster.yaml``: the mlp one-vs-rest classifier,
MeanOfTransportation against the rest, ``data/dbpedia_10k``, 3 workers, Dirichlet α 0.5, 20
rounds), ``security: none``, baselines on, at ε = 1, 2, 4, 8 (δ = 1e-5) and without privacy,
seeds 0, 1, 2. The private runs use ``examples/mlp_dp.yaml``'s settings (lr 0.02, batches of
256, 2 local epochs, ``max_grad_norm`` 1.0) with the noise multiplier that makes the worker with
the fewest training documents spend exactly ε over the 20 rounds (Opacus's
``get_noise_multiplier``, the RDP accountant); the others spend less. The non-private runs are
the default job as it ships (lr 0.001, batches of 64). Each run is the master and three worker
processes, as ``fedctl run`` starts them (:func:`fedctl.bench.harness.run_cluster`).

**Client-level DP-FedAvg.** The same data shared out among 100 workers (threads of one
process: 100 processes would not fit this machine), every worker every round, 20 rounds, lr
0.01 and 5 local epochs (a worker holds about 80 documents), at ε = 8 and without privacy, seed
0; the private run clips each update's change to 2.0 with the noise multiplier that spends ε = 8
over the 20 rounds (an in-process simulation gave 0.54, 0.67, 0.92, 0.97 and 0.94 pooled
macro-F1 with clips of 0.2, 0.5, 1, 2 and 4).

Scores: the final model's macro-F1 on all workers' test splits pooled (``comparison.json``'s
``federated`` row) and the mean of the workers' own; ε as reported (``summary.json``); the
median round time. Usage: ``python benchmarks/privacy.py [--work DIR] [--seeds 0,1,2]
[--skip-client]``; a run whose ``run.json`` is in the work folder is not run again. Writes
``benchmarks/results/privacy.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.config import load_config  # noqa: E402
from common.data.shards import local_data  # noqa: E402
from common.privacy.dp import ClientDPParams, DPSGDParams, PrivacyParams  # noqa: E402
from fedctl.bench.harness import bench_config, run_cluster  # noqa: E402
from fedctl.bench.report import command_line, median_range  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
EPSILONS: tuple[float | None, ...] = (1.0, 2.0, 4.0, 8.0, None)  # None: no privacy
DELTA = 1e-5
ROUNDS = 20
DP_LR, DP_BATCH, DP_EPOCHS, DP_CLIP = 0.02, 256, 2, 1.0
CLIENT_WORKERS, CLIENT_CLIP, CLIENT_LR, CLIENT_EPOCHS = 100, 2.0, 0.01, 5


def noise_for(eps: float, sample_rate: float, steps: int) -> float:
    """The noise multiplier that spends ``eps`` (at DELTA) in ``steps`` subsampled steps."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=eps, target_delta=DELTA,
                                      sample_rate=sample_rate, steps=steps, accountant="rdp",
                                      epsilon_tolerance=0.005))


def record_config(work: Path, eps: float | None, seed: int) -> Any:
    base = load_config(ROOT / "cluster.yaml")
    cfg = bench_config(base, work / "out", rounds=ROUNDS, seed=seed, baselines=True,
                       **{"security.mode": "none"})
    if eps is None:
        return cfg, None
    cfg.model = {**cfg.model, "lr": DP_LR, "batch_size": DP_BATCH, "local_epochs": DP_EPOCHS}
    n_min = min(len(local_data(cfg, w.name).train_index) for w in cfg.workers)
    steps = ROUNDS * DP_EPOCHS * math.ceil(n_min / DP_BATCH)
    sigma = noise_for(eps, DP_BATCH / n_min, steps)
    cfg.privacy = PrivacyParams(dp_sgd=DPSGDParams(sigma, DP_CLIP), delta=DELTA)
    return cfg, sigma


def client_config(work: Path, eps: float | None) -> Any:
    base = load_config(ROOT / "cluster.yaml")
    cfg = bench_config(base, work / "out", n_workers=CLIENT_WORKERS, rounds=ROUNDS, seed=0,
                       baselines=True, eval_every=0, heartbeat_timeout=60.0,
                       **{"security.mode": "none"})
    # ~80 documents a worker: the default lr and epoch leave the model where it started.
    cfg.model = {**cfg.model, "lr": CLIENT_LR, "local_epochs": CLIENT_EPOCHS}
    if eps is None:
        return cfg, None
    sigma = noise_for(eps, 1.0, ROUNDS)
    cfg.privacy = PrivacyParams(client_dp=ClientDPParams(CLIENT_CLIP, sigma), delta=DELTA)
    return cfg, sigma


def run_one(folder: Path, kind: str, eps: float | None, seed: int) -> dict[str, Any]:
    done = folder / "run.json"
    if done.exists():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    cfg, sigma = (record_config(folder, eps, seed) if kind == "record"
                  else client_config(folder, eps))
    t0 = time.monotonic()
    res = run_cluster(cfg, threads_mode=kind == "client", timeout=3600)
    summary = json.loads((Path(cfg.output_dir) / "summary.json").read_text())
    privacy = summary.get("privacy", {})
    r = {"kind": kind, "epsilon_target": eps, "seed": seed, "noise_multiplier": sigma,
         "wall_s": time.monotonic() - t0, "rounds": len(res["rounds"]),
         "pooled_f1": res["pooled"]["federated"]["macro_f1"],
         "centralized_pooled_f1": res["pooled"]["centralized"]["macro_f1"],
         "mean_f1": statistics.mean(row["federated_macro_f1"] for row in summary["comparison"]),
         "epsilon": privacy.get("epsilon" if kind == "record" else "client_epsilon"),
         "median_round_s": res["median_round_s"],
         "median_train_s": res["median_slowest_train_s"]}
    done.write_text(json.dumps(r, indent=2))
    return r


def eps_label(eps: float | None) -> str:
    return "∞ (no DP)" if eps is None else f"{eps:g}"


def plot(path: Path, record: list[dict[str, Any]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    xs = [e for e in EPSILONS if e is not None]
    pos = {e: i for i, e in enumerate(xs)}
    free = [r["pooled_f1"] for r in record if r["epsilon_target"] is None]
    for r in record:
        if r["epsilon_target"] is not None:
            ax.plot(pos[r["epsilon_target"]], r["pooled_f1"], "o", color="tab:blue", alpha=0.5)
    med = [statistics.median([r["pooled_f1"] for r in record if r["epsilon_target"] == e])
           for e in xs]
    ax.plot(range(len(xs)), med, "-", color="tab:blue", label="DP-SGD, median of the seeds")
    if free:
        ref = statistics.median(free)
        ax.axhline(ref, color="black", lw=1, label=f"no DP ({ref:.3f})")
        ax.axhspan(ref - 0.03, ref, color="tab:green", alpha=0.12, label="within 3 points")
    ax.set_xticks(range(len(xs)), [f"ε = {e:g}" for e in xs])
    ax.set_ylabel("final macro-F1, all test splits pooled")
    ax.set_title("Default job with record-level DP-SGD (δ = 1e-5, 20 rounds, 3 workers)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the runs (default: a new one under the temporary folder)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--skip-client", action="store_true", help="record-level runs only")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="privacy_"))
    seeds = [int(s) for s in args.seeds.split(",") if s]
    record, client = [], []
    for seed in seeds:
        for eps in EPSILONS:
            r = run_one(work / f"record_{eps_label(eps).split()[0]}_s{seed}", "record", eps, seed)
            record.append(r)
            print(f"record ε {eps_label(eps)} seed {seed}: pooled F1 {r['pooled_f1']:.4f}, "
                  f"ε spent {r['epsilon']}, {r['wall_s']:.0f} s", flush=True)
    if not args.skip_client:
        for eps in (8.0, None):
            r = run_one(work / f"client_{eps_label(eps).split()[0]}", "client", eps, 0)
            client.append(r)
            print(f"client ε {eps_label(eps)}: pooled F1 {r['pooled_f1']:.4f}, "
                  f"{r['wall_s']:.0f} s", flush=True)

    lines = ["# Differential privacy on the default job (issue 26)", "",
             f"`{command_line(ROOT)}`", "", __doc__.split("\n\n", 1)[1].split("Usage:")[0].strip(),
             "", "## Record-level DP-SGD (3 workers)", "",
             "Median over the seeds (min–max).", "",
             "| ε target | noise multiplier σ | ε reported (largest worker) | pooled macro-F1 | "
             "workers' mean macro-F1 | Δ pooled vs no DP (points) | median round (s) |",
             "|---|---|---|---|---|---|---|"]
    free = [r["pooled_f1"] for r in record if r["epsilon_target"] is None]
    ref = statistics.median(free) if free else None
    for eps in EPSILONS:
        rs = [r for r in record if r["epsilon_target"] == eps]
        if not rs:
            continue
        pooled = [r["pooled_f1"] for r in rs]
        delta = ("—" if ref is None or eps is None
                 else f"{100 * (statistics.median(pooled) - ref):+.2f}")
        sig = [r["noise_multiplier"] for r in rs if r["noise_multiplier"] is not None]
        spent = [r["epsilon"] for r in rs if r["epsilon"] is not None]
        lines.append(f"| {eps_label(eps)} | {median_range(sig, 3)} | "
                     f"{median_range(spent, 3)} | {median_range(pooled)} "
                     f"| {median_range([r['mean_f1'] for r in rs])} | {delta} | "
                     f"{median_range([r['median_round_s'] for r in rs], 3)} |")
    central = [r["centralized_pooled_f1"] for r in record]
    lines += ["", f"Centralized reference (pooled training data, no DP): {median_range(central)}."]
    if ref is not None:
        at8 = [r["pooled_f1"] for r in record if r["epsilon_target"] == 8.0]
        if at8:
            gap = 100 * (ref - statistics.median(at8))
            lines.append(f"Goal (within 3 points of no DP at ε = 8): "
                         f"{'met' if gap <= 3 else 'not met'} ({gap:.2f} points).")
    if client:
        lines += ["", f"## Client-level DP-FedAvg ({CLIENT_WORKERS} workers, threads)", "",
                  "| ε target | noise multiplier σ | clip | ε reported | pooled macro-F1 | "
                  "workers' mean macro-F1 | median round (s) |", "|---|---|---|---|---|---|---|"]
        for r in client:
            lines.append(f"| {eps_label(r['epsilon_target'])} | "
                         f"{format(r['noise_multiplier'], '.3f') if r['noise_multiplier'] else '—'}"
                         " | "
                         f"{CLIENT_CLIP if r['epsilon_target'] else '—'} | "
                         f"{r['epsilon'] if r['epsilon'] is None else format(r['epsilon'], '.3f')}"
                         f" | {r['pooled_f1']:.4f} | {r['mean_f1']:.4f} | "
                         f"{r['median_round_s']:.3f} |")
    minutes = sum(r["wall_s"] for r in record + client) / 60
    lines += ["", f"{len(record) + len(client)} runs, {minutes:.1f} min of runs on this 2-core "
              f"machine (shared with other work). Work folder: `{work}`."]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "privacy.md").write_text("\n".join(lines) + "\n")
    (args.results / "privacy.json").write_text(json.dumps({"record": record, "client": client},
                                                          indent=2))
    plot(args.results / "privacy.png", record)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
