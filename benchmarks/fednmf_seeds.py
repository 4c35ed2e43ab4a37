"""Benchmark: how much the FedNMF table's macro-F1 moves from seed to seed.

``fednmf_tables.py`` runs one seed; this reruns FedAvg(+MI) and FedAdam(+MI) on stackoverflow
(k = 50, the same scale and titles) with other seeds: the client partition, the initial topics,
the clients' initial weights and batch order, and the clients sampled each round all change.
The spread tells which +MI-minus-no-MI differences of the main table are larger than chance.

    python benchmarks/fednmf_seeds.py [--seeds 0,1,2] [--docs 3000] [--rounds 50] [--epochs 2]

Prints a table and writes benchmarks/results/fednmf_seeds.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fednmf_tables import LABELS, MI_WEIGHT, RESULTS, Corpus, scores, simulate  # noqa: E402

from common.atomic import atomic_write_bytes  # noqa: E402
from common.text import bow_matrix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    corpus = Corpus("stackoverflow", args.docs)
    f1: dict[str, list[float]] = {}
    for strategy in ("fedavg", "fedadam"):
        for mi in (False, True):
            label = LABELS[strategy] + ("+MI" if mi else "")
            for seed in seeds:
                server, _ = simulate(corpus, strategy, 50, MI_WEIGHT if mi else 0.0,
                                     args.rounds, args.epochs, seed=seed)
                vocab = server.setup_info_["vocabulary"]
                model = server.params.model()
                model.set_arrays(server.global_.arrays)
                X = bow_matrix(corpus.dataset.texts, vocab)
                f1.setdefault(label, []).append(
                    scores(corpus, vocab, model.components_, model.transform, X)["macro_f1"])
            print(label, [round(v, 3) for v in f1[label]], flush=True)
    lines = ["# FedNMF macro-F1 across seeds (stackoverflow, k = 50)", "",
             f"Same titles, split and scale as fednmf_tables.py ({args.docs} titles, K = 10, "
             f"alpha = 1, C = 0.2, {args.rounds} rounds x {args.epochs} local epochs); "
             f"seeds {seeds} change the partition, the initial topics, the clients' "
             f"initialization and batch order and the sampled clients. "
             f"{(time.perf_counter() - t0) / 60:.1f} min.", "",
             "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | std |",
             "|---|" + "---:|" * (len(seeds) + 2)]
    for label, vals in f1.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals)
                     + f" | {np.mean(vals):.3f} | {np.std(vals, ddof=1):.3f} |")
    lines.append("")
    for base in ("FedAvg", "FedAdam"):
        d = np.array(f1[base + "+MI"]) - np.array(f1[base])
        lines.append(f"{base}: +MI minus no MI per seed {np.round(d, 3).tolist()}, "
                     f"mean {d.mean():+.3f}.")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS / "fednmf_seeds.md", text.encode())
    atomic_write_bytes(RESULTS / "fednmf_seeds.json",
                       json.dumps({"seeds": seeds, "macro_f1": f1, "docs": args.docs,
                                   "rounds": args.rounds, "epochs": args.epochs},
                                  indent=2).encode())


if __name__ == "__main__":
    main()
