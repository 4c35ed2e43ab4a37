"""gFedNTM Fig. 3 at reduced scale: non-collaborative vs federated ProdLDA on synthetic LDA data.

For each configuration a corpus is drawn (:func:`fedctl.datasets.synthetic_lda.make_federated_lda`):
L nodes, V words, K topics of which K' are shared and (K - K')/L private to each node. Then

* non-collaborative: each node trains ProdLDA on its own documents alone;
* federated: synchronous gFedNTM training (every step, each node's mini-batch gradient at the
  global weights, averaged by batch size, one Adam step), simulated in one process with the
  very code the cluster runs (:func:`common.models.ntm.simulate_sync`).

Both get the same number of steps. DSS (lower is better) is computed per node on its own
documents and averaged; TSS (K is perfect) compares each model's topics with all K true topics
(averaged over the nodes for the non-collaborative models). Results are averaged over seeds.

Usage: ``python benchmarks/ntm_synthetic.py [--seeds 2] [--steps 250]``. Writes
``benchmarks/results/ntm_synthetic.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.models.ntm import NTMParams, simulate_sync  # noqa: E402
from fedctl.datasets.synthetic_lda import (  # noqa: E402
    document_similarity_score,
    make_federated_lda,
    topic_similarity_score,
)

RESULTS = ROOT / "benchmarks" / "results"


def run_one(n_shared: int, eta: float, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """DSS and TSS of the federated and the non-collaborative models on one corpus."""
    c = make_federated_lda(n_nodes=args.nodes, vocab_size=args.vocab, n_topics=args.topics,
                           n_shared=n_shared, docs_per_node=args.docs, eta=eta,
                           random_state=seed)
    p = NTMParams(n_topics=args.topics, lr=args.lr, beta1=args.beta1)
    fed = simulate_sync([(X, None) for X in c.X], p, args.steps, random_state=seed)
    local = [p.model(random_state=seed + 1 + i).fit(X, steps=args.steps)
             for i, X in enumerate(c.X)]
    return {
        "dss_federated": float(np.mean([document_similarity_score(th, fed.transform(X))
                                        for X, th in zip(c.X, c.theta, strict=True)])),
        "dss_local": float(np.mean([document_similarity_score(th, m.transform(X))
                                    for X, th, m in zip(c.X, c.theta, local, strict=True)])),
        "tss_federated": topic_similarity_score(c.beta, fed.get_topic_word_distribution()),
        "tss_local": float(np.mean([topic_similarity_score(c.beta,
                                                           m.get_topic_word_distribution())
                                    for m in local])),
    }


def sweep(name: str, values: list[float], fixed: dict[str, float], args: argparse.Namespace
          ) -> list[dict[str, float]]:
    rows = []
    for v in values:
        kw = {**fixed, name: v}
        t0 = time.perf_counter()
        runs = [run_one(int(kw["n_shared"]), float(kw["eta"]), s, args)
                for s in range(args.seeds)]
        row = {name: v, **{k: float(np.mean([r[k] for r in runs])) for k in runs[0]},
               **{f"{k}_std": float(np.std([r[k] for r in runs])) for k in runs[0]},
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{name}={v}: DSS fed {row['dss_federated']:.2f} local {row['dss_local']:.2f} | "
              f"TSS fed {row['tss_federated']:.2f} local {row['tss_local']:.2f} "
              f"({row['seconds']:.0f}s)", flush=True)
    return rows


def table(rows: list[dict[str, float]], key: str) -> str:
    lines = [f"| {key} | DSS non-collab. | DSS federated | TSS non-collab. | TSS federated |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[key]:g} | {r['dss_local']:.2f} ± {r['dss_local_std']:.2f} | "
                     f"{r['dss_federated']:.2f} ± {r['dss_federated_std']:.2f} | "
                     f"{r['tss_local']:.2f} ± {r['tss_local_std']:.2f} | "
                     f"{r['tss_federated']:.2f} ± {r['tss_federated_std']:.2f} |")
    return "\n".join(lines)


def plot(shared: list[dict], etas: list[dict], path: Path, topics: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, (rows, key, label) in enumerate([(shared, "n_shared", "K' (shared topics)"),
                                              (etas, "eta", "eta")]):
        x = [r[key] for r in rows]
        for row, metric in enumerate(("dss", "tss")):
            ax = axes[row][col]
            for who, style in (("local", "o--"), ("federated", "s-")):
                ax.errorbar(x, [r[f"{metric}_{who}"] for r in rows],
                            yerr=[r[f"{metric}_{who}_std"] for r in rows], fmt=style,
                            label="non-collaborative" if who == "local" else "federated",
                            capsize=3)
            if metric == "tss":
                ax.axhline(topics, color="gray", lw=0.8, ls=":")
            if key == "eta":
                ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(metric.upper() + (" (lower is better)" if metric == "dss"
                                            else f" (best = K = {topics})"))
            ax.legend()
    fig.suptitle("gFedNTM Fig. 3, reduced scale: ProdLDA, synchronous federated vs alone")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=500)
    ap.add_argument("--topics", type=int, default=50)
    ap.add_argument("--docs", type=int, default=200, help="documents per node")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--shared", default="5,10,15,30,40")
    ap.add_argument("--etas", default="0.01,0.05,0.1,0.5,1")
    ap.add_argument("--fixed-shared", type=int, default=10)
    ap.add_argument("--fixed-eta", type=float, default=0.01)
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny networks: more threads only contend on a shared machine
    t0 = time.perf_counter()
    shared = sweep("n_shared", [float(v) for v in args.shared.split(",")],
                   {"eta": args.fixed_eta}, args)
    etas = sweep("eta", [float(v) for v in args.etas.split(",")],
                 {"n_shared": args.fixed_shared}, args)
    scale = (f"L = {args.nodes} nodes, V = {args.vocab}, K = {args.topics}, "
             f"{args.docs} documents per node (lengths 150-250), alpha = 50/K, "
             f"{args.steps} steps of batch 64 per node for both (Adam lr {args.lr}, "
             f"beta1 {args.beta1}), {args.seeds} seed(s), in-process simulation, federated "
             f"batch norm over the union of the nodes' batches (the default since "
             f"`sync_batch_norm`)")
    md = "\n\n".join([
        "# gFedNTM Fig. 3 at reduced scale",
        f"Scale: {scale}. Wall time {time.perf_counter() - t0:.0f} s (2 shared CPU cores).",
        f"## Shared topics K' (eta = {args.fixed_eta})", table(shared, "n_shared"),
        f"## Topic concentration eta (K' = {args.fixed_shared})", table(etas, "eta"),
        "DSS: sum over document pairs of |S_true - S_model| / D, S = Hellinger similarity "
        "(Bhattacharyya coefficient) of theta; per node, averaged. TSS: sum over the K true "
        "topics of the best match's Hellinger similarity.",
        "![Fig. 3](ntm_synthetic.png)"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ntm_synthetic.md").write_text(md + "\n")
    (RESULTS / "ntm_synthetic.json").write_text(json.dumps(
        {"scale": scale, "shared": shared, "eta": etas}, indent=2))
    plot(shared, etas, RESULTS / "ntm_synthetic.png", args.topics)
    print(md)


if __name__ == "__main__":
    main()
