"""Benchmark: how much the FedNMF table's macro-F1 moves from seed to seed, and whether +MI
beats the same strategy without MI by more than that.

``fednmf_tables.py`` runs one seed; this reruns each strategy with and without MI (k = 50, the
same scale and titles) with other seeds: the client partition, the initial topics, the clients'
initial weights and batch order, and the clients sampled each round all change. The paired
differences (+MI minus no MI, same seed) tell which differences of the main table are larger
than chance.

``--alpha`` and ``--epochs`` move it to where Si et al. say the MI term matters, clients whose
labels differ (small alpha) and which go further on their own between rounds (more local
epochs). Each run also records the client drift, the median over the clients' updates of
||C_local - C_global|| / ||C_global||: how far one local update moves the topics.

``--learned-h`` scores what the MI term shapes directly: every title, held-out ones included,
lives on some client, and the SVM is trained and scored on the topic weights H the clients
learned (pooled for scoring only), the paper's likely protocol, instead of weights re-solved
from the final topics (those are kept in the JSON as ``macro_f1_resolved_h``).

Without ``--mi-keeps-scale`` the +MI runs take the paper's update (``mi_keeps_scale: false``),
as the result files without ``_keeps_scale`` were measured; with it, the family's default
``mi_keeps_scale: true`` (the MI term's step on each title's topic weights keeps their sum). It
does nothing without MI.

    python benchmarks/fednmf_seeds.py [--datasets stackoverflow,sms_spam,...]
        [--strategies fedavg,fedadagrad,fedyogi,fedadam] [--seeds 0,1,2] [--docs 3000]
        [--rounds 50] [--epochs 2] [--alpha 1] [--critic-aggregation fedavg] [--learned-h]
        [--mi-weight 1] [--mi-keeps-scale] [--jobs 2]

Prints a table and writes benchmarks/results/fednmf_seeds.{json,md} (alpha 1, 2 epochs) or
benchmarks/results/fednmf_seeds_alpha<alpha>_e<epochs>.{json,md}, with ``_critic_local`` (or
``_critic_strategy``) added for the other critic aggregations and ``_learned_h`` for
``--learned-h``, ``_lambda<lambda>`` for another ``--mi-weight`` and ``_keeps_scale`` for
``--mi-keeps-scale``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fednmf_tables import DATASETS, LABELS, MI_WEIGHT, RESULTS, Corpus, fed_row  # noqa: E402

from common.atomic import atomic_write_bytes  # noqa: E402
from common.models.nmf import CRITIC_AGGREGATIONS  # noqa: E402

_CORPORA: dict[tuple[str, int], Corpus] = {}


def paired_differences(f1: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """+MI against no MI over every dataset and strategy: in how many of these ``pairs`` +MI
    has the higher mean (``ahead``), and every difference of the same seed pooled: their
    count, mean, standard error, share above 0 and two-sided p-values of a t-test and a
    Wilcoxon signed-rank test against no difference."""
    from scipy import stats

    per_pair = [np.array(by[label + "+MI"]) - np.array(runs) for by in f1.values()
                for label, runs in by.items() if not label.endswith("+MI")]
    d = np.concatenate(per_pair)
    return {"pairs": len(per_pair), "ahead": sum(int(x.mean() > 0) for x in per_pair),
            "n": int(d.size), "mean": float(d.mean()),
            "se": float(d.std(ddof=1) / np.sqrt(d.size)), "positive": float(np.mean(d > 0)),
            "t_p": float(stats.ttest_1samp(d, 0.0).pvalue),
            "wilcoxon_p": float(stats.wilcoxon(d).pvalue)}


def pooled_sentence(p: dict[str, float]) -> str:
    return (f"Pooled over all {p['n']} paired runs: +MI minus no MI {p['mean']:+.4f} "
            f"± {p['se']:.4f} (standard error), {p['positive']:.0%} of them above 0; "
            f"p = {p['t_p']:.2f} (t-test), {p['wilcoxon_p']:.2f} (Wilcoxon).")


def run_cell(name: str, docs: int, strategy: str, mi: bool, seed: int, rounds: int,
             epochs: int, alpha: float, critic: str, learned_h: bool = False,
             keeps_scale: bool = False, mi_weight: float = MI_WEIGHT
             ) -> tuple[float, float, float]:
    """macro-F1, client drift and the macro-F1 on re-solved topic weights of one federated
    run (in a pool process); with ``learned_h`` the first is scored on the clients' learned
    H (every title on some client), otherwise both F1 are the same."""
    torch.set_num_threads(1)
    corpus = _CORPORA.setdefault((name, docs), Corpus(name, docs))
    row = fed_row(corpus, strategy, 50, mi, argparse.Namespace(rounds=rounds, epochs=epochs),
                  alpha=alpha, seed=seed, critic_aggregation=critic, all_titles=learned_h,
                  mi_keeps_scale=keeps_scale, mi_weight=mi_weight)
    f1 = row["learned_h"]["macro_f1"] if learned_h else row["macro_f1"]
    return f1, row["client_drift"], row["macro_f1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--strategies", default="fedavg,fedadagrad,fedyogi,fedadam")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--critic-aggregation", default="fedavg", choices=CRITIC_AGGREGATIONS,
                    help="how the +MI runs combine the critics (the family's option)")
    ap.add_argument("--learned-h", action="store_true",
                    help="every title (held-out ones too) lives on a client, and macro-F1 is "
                         "scored on the topic weights the clients learned (the paper's likely "
                         "protocol) instead of weights re-solved from the final topics")
    ap.add_argument("--mi-weight", type=float, default=MI_WEIGHT,
                    help="lambda of the +MI runs")
    ap.add_argument("--mi-keeps-scale", action="store_true",
                    help="the MI term's step on each title's topic weights keeps their sum "
                         "(mi_keeps_scale: true, the family's default); without it, the "
                         "paper's update")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    datasets = args.datasets.split(",")
    strategies = args.strategies.split(",")
    t0 = time.perf_counter()
    cells = [(name, strategy, mi, seed) for name in datasets for strategy in strategies
             for mi in (False, True) for seed in seeds]
    print(f"{len(cells)} runs on {args.jobs} process(es)", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_cell, name, args.docs, strategy, mi, seed, args.rounds,
                               args.epochs, args.alpha, args.critic_aggregation,
                               args.learned_h, args.mi_keeps_scale, args.mi_weight)
                   for name, strategy, mi, seed in cells]
        results = [f.result() for f in futures]
    f1: dict[str, dict[str, list[float]]] = {}
    drift: dict[str, dict[str, list[float]]] = {}
    resolved: dict[str, dict[str, list[float]]] = {}
    for (name, strategy, mi, _), (value, d, f1_resolved) in zip(cells, results, strict=True):
        label = LABELS[strategy] + ("+MI" if mi else "")
        f1.setdefault(name, {}).setdefault(label, []).append(value)
        drift.setdefault(name, {}).setdefault(label, []).append(d)
        resolved.setdefault(name, {}).setdefault(label, []).append(f1_resolved)
    keeps = ("The MI term's step on each title's topic weights keeps their sum "
             "(`mi_keeps_scale: true`). " if args.mi_keeps_scale
             else "The MI term takes the paper's update (`mi_keeps_scale: false`). ")
    scored = ("Every title, held-out ones included, lives on a client; macro-F1 is scored on "
              "the topic weights H the clients learned (pooled for scoring only). "
              if args.learned_h else "")
    lines = [f"# FedNMF macro-F1 across seeds (k = 50, alpha = {args.alpha:g}, "
             f"{args.epochs} local epochs)", "",
             f"Same titles, split and scale as fednmf_tables.py ({args.docs} titles, K = 10, "
             f"alpha = {args.alpha:g}, C = 0.2, {args.rounds} rounds x {args.epochs} local "
             f"epochs, lambda = {args.mi_weight:g} for +MI, critic_aggregation "
             f"{args.critic_aggregation}); seeds {seeds} change the "
             f"partition, the initial topics, the clients' initialization and batch order and "
             f"the sampled clients. {keeps}{scored}Client drift: median over the clients' "
             f"updates of ||C_local - C_global|| / ||C_global||. "
             f"{(time.perf_counter() - t0) / 60:.1f} min on {args.jobs} process(es) of a shared "
             f"2-core CPU.", ""]
    summary = ["## +MI minus no MI (same seed)", "",
               "| dataset | strategy | per seed | mean | std | drift, no MI -> +MI |",
               "|---|---|---|---:|---:|---|"]
    for name in datasets:
        lines += [f"## {name}", "",
                  "| method | " + " | ".join(f"seed {s}" for s in seeds)
                  + " | mean | std | client drift |",
                  "|---|" + "---:|" * (len(seeds) + 3)]
        for label, vals in f1[name].items():
            lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals)
                         + f" | {np.mean(vals):.3f} | {np.std(vals, ddof=1):.3f} | "
                         f"{np.mean(drift[name][label]):.3f} |")
        lines.append("")
        for strategy in strategies:
            base = LABELS[strategy]
            d = np.array(f1[name][base + "+MI"]) - np.array(f1[name][base])
            summary.append(f"| {name} | {base} | {', '.join(f'{v:+.3f}' for v in d)} | "
                           f"{d.mean():+.3f} | {np.std(d, ddof=1):.3f} | "
                           f"{np.mean(drift[name][base]):.3f} -> "
                           f"{np.mean(drift[name][base + '+MI']):.3f} |")
    pooled = paired_differences(f1)
    summary += ["", f"+MI has the higher mean macro-F1 in {pooled['ahead']} of "
                    f"{pooled['pairs']} "
                    f"dataset/strategy pairs. {pooled_sentence(pooled)}", ""]
    text = "\n".join(lines[:4] + summary + lines[4:]) + "\n"
    print(text)
    stem = ("fednmf_seeds" if args.alpha == 1.0 and args.epochs == 2
            else f"fednmf_seeds_alpha{args.alpha:g}_e{args.epochs}")
    if args.critic_aggregation != "fedavg":
        stem += f"_critic_{args.critic_aggregation}"
    if args.learned_h:
        stem += "_learned_h"
    if args.mi_weight != MI_WEIGHT:
        stem += f"_lambda{args.mi_weight:g}"
    if args.mi_keeps_scale:
        stem += "_keeps_scale"
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS / f"{stem}.md", text.encode())
    atomic_write_bytes(RESULTS / f"{stem}.json",
                       json.dumps({"seeds": seeds, "macro_f1": f1, "client_drift": drift,
                                   "docs": args.docs, "rounds": args.rounds,
                                   "epochs": args.epochs, "alpha": args.alpha,
                                   "critic_aggregation": args.critic_aggregation,
                                   "learned_h": args.learned_h,
                                   "mi_keeps_scale": args.mi_keeps_scale,
                                   "macro_f1_resolved_h": resolved,
                                   "mi_weight": args.mi_weight, "pooled": pooled},
                                  indent=2).encode())


if __name__ == "__main__":
    main()
