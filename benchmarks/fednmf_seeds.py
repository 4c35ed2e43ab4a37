"""Benchmark: how much the FedNMF table's macro-F1 moves from seed to seed, and whether +MI
beats the same strategy without MI by more than that.

``fednmf_tables.py`` runs one seed; this reruns each strategy with and without MI (k = 50, the
same scale and titles) with other seeds: the client partition, the initial topics, the clients'
initial weights and batch order, and the clients sampled each round all change. The paired
differences (+MI minus no MI, same seed) tell which differences of the main table are larger
than chance.

    python benchmarks/fednmf_seeds.py [--datasets stackoverflow,sms_spam]
        [--strategies fedavg,fedadagrad,fedyogi,fedadam] [--seeds 0,1,2] [--docs 3000]
        [--rounds 50] [--epochs 2]

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
    ap.add_argument("--datasets", default="stackoverflow,sms_spam")
    ap.add_argument("--strategies", default="fedavg,fedadagrad,fedyogi,fedadam")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    datasets = args.datasets.split(",")
    strategies = args.strategies.split(",")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    f1: dict[str, dict[str, list[float]]] = {}
    for name in datasets:
        corpus = Corpus(name, args.docs)
        f1[name] = {}
        for strategy in strategies:
            for mi in (False, True):
                label = LABELS[strategy] + ("+MI" if mi else "")
                for seed in seeds:
                    server, _ = simulate(corpus, strategy, 50, MI_WEIGHT if mi else 0.0,
                                         args.rounds, args.epochs, seed=seed)
                    vocab = server.setup_info_["vocabulary"]
                    model = server.params.model()
                    model.set_arrays(server.global_.arrays)
                    X = bow_matrix(corpus.dataset.texts, vocab)
                    f1[name].setdefault(label, []).append(scores(
                        corpus, vocab, model.components_, model.transform, X)["macro_f1"])
                print(name, label, [round(v, 3) for v in f1[name][label]], flush=True)
    lines = ["# FedNMF macro-F1 across seeds (k = 50)", "",
             f"Same titles, split and scale as fednmf_tables.py ({args.docs} titles, K = 10, "
             f"alpha = 1, C = 0.2, {args.rounds} rounds x {args.epochs} local epochs, "
             f"lambda = {MI_WEIGHT} for +MI, critic averaged); seeds {seeds} change the "
             f"partition, the initial topics, the clients' initialization and batch order and "
             f"the sampled clients. {(time.perf_counter() - t0) / 60:.1f} min on one shared "
             f"CPU core.", ""]
    summary = ["## +MI minus no MI (same seed)", "",
               "| dataset | strategy | per seed | mean | std |", "|---|---|---|---:|---:|"]
    wins = total = 0
    for name in datasets:
        lines += [f"## {name}", "",
                  "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | std |",
                  "|---|" + "---:|" * (len(seeds) + 2)]
        for label, vals in f1[name].items():
            lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals)
                         + f" | {np.mean(vals):.3f} | {np.std(vals, ddof=1):.3f} |")
        lines.append("")
        for strategy in strategies:
            base = LABELS[strategy]
            d = np.array(f1[name][base + "+MI"]) - np.array(f1[name][base])
            wins += int(d.mean() > 0)
            total += 1
            summary.append(f"| {name} | {base} | {', '.join(f'{v:+.3f}' for v in d)} | "
                           f"{d.mean():+.3f} | {np.std(d, ddof=1):.3f} |")
    summary += ["", f"+MI has the higher mean macro-F1 in {wins} of {total} "
                    f"dataset/strategy pairs.", ""]
    text = "\n".join(lines[:4] + summary + lines[4:]) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS / "fednmf_seeds.md", text.encode())
    atomic_write_bytes(RESULTS / "fednmf_seeds.json",
                       json.dumps({"seeds": seeds, "macro_f1": f1, "docs": args.docs,
                                   "rounds": args.rounds, "epochs": args.epochs,
                                   "mi_weight": MI_WEIGHT}, indent=2).encode())


if __name__ == "__main__":
    main()
