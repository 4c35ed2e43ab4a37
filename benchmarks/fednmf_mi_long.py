"""Benchmark: long training with FedNMF's MI term, the collapse and the stabilizer.

NMF by SGD on the stackoverflow titles of ``fednmf_tables.py`` (3,000 titles, 80/20 split,
k = 50, the family's defaults otherwise), centralized, trained for many epochs, as the master's
comparison baseline trains (rounds x local epochs). Three settings, several seeds:

* no MI (lambda = 0);
* +MI, lambda = 1, the paper's update (``mi_keeps_scale=False``);
* +MI, lambda = 1, ``mi_keeps_scale`` (the family's default): the MI term's step on each
  title's topic weights keeps their sum, so only the reconstruction sets their scale.

Every ``--every`` epochs it records the macro-F1 of a linear SVM on re-solved topic weights
(how the tables score), the reconstruction loss, the SMILE bound, the mean row sum of H and the
median norm of the topics (rows of C).

    python benchmarks/fednmf_mi_long.py [--dataset stackoverflow] [--docs 3000] [--epochs 80]
        [--every 10] [--seeds 0,1,2] [--jobs 2]

Prints a table and writes benchmarks/results/fednmf_mi_long.{json,md,png} (``_<dataset>`` and
``_<docs>`` added for other datasets and sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fednmf_tables import RESULTS, Corpus, simulate  # noqa: E402

from common.atomic import atomic_write_bytes  # noqa: E402
from common.data.text import bow_matrix  # noqa: E402
from common.eval.topics import svm_scores  # noqa: E402
from common.models.nmf import SGDNMF  # noqa: E402

K = 50
#: label -> (lambda, further options of SGDNMF)
SETTINGS: dict[str, tuple[float, dict[str, bool]]] = {
    "no MI": (0.0, {}), "+MI": (1.0, {"mi_keeps_scale": False}),
    "+MI, keeps scale": (1.0, {"mi_keeps_scale": True})}
METRICS = ("macro_f1", "loss", "mi", "h_row_sum", "topic_norm")


_CORPORA: dict[tuple[str, int], tuple[Corpus, Any]] = {}


def _corpus(dataset: str, docs: int) -> tuple[Corpus, Any]:
    """The titles and their counts over the federation's vocabulary, once per process."""
    if (dataset, docs) not in _CORPORA:
        corpus = Corpus(dataset, docs)
        server, _ = simulate(corpus, "fedavg", K, 0.0, 1, 1)
        _CORPORA[dataset, docs] = corpus, bow_matrix(corpus.dataset.texts,
                                                     server.setup_info_["vocabulary"])
    return _CORPORA[dataset, docs]


def run(dataset: str, docs: int, label: str, seed: int, epochs: int, every: int
        ) -> dict[str, list[float]]:
    """One setting and seed: the metrics after every ``every`` epochs (in a pool process)."""
    torch.set_num_threads(1)
    corpus, X = _corpus(dataset, docs)
    tr, te, y = corpus.train, corpus.test, corpus.y
    lam, options = SETTINGS[label]
    model = SGDNMF(K, mi_weight=lam, random_state=seed, **options)
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for _ in range(0, epochs, every):
        model.fit(X[tr], epochs=every)
        h = model.transform(X)
        out["macro_f1"].append(svm_scores(h[tr], y[tr], h[te], y[te])["macro_f1"])
        out["loss"].append(model.last_loss_)
        out["mi"].append(model.last_mi_)
        out["h_row_sum"].append(float(model.doc_topic_.sum(axis=1).mean()))
        out["topic_norm"].append(float(np.median(np.linalg.norm(model.components_, axis=1))))
    return out


def plot(path: Path, epochs: list[int], mean: dict[str, dict[str, np.ndarray]],
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label, m in mean.items():
        axes[0].plot(epochs, m["macro_f1"], marker="o", label=label)
        axes[1].plot(epochs, m["loss"], marker="o", label=label)
        axes[2].plot(epochs, m["h_row_sum"], marker="o", label=label)
    axes[0].set_ylabel("macro-F1 (SVM on re-solved H)")
    axes[1].set_ylabel("reconstruction loss per title")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("mean row sum of H")
    for ax in axes:
        ax.set_xlabel("epochs")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="stackoverflow")
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.perf_counter()
    cells = [(label, seed) for label in SETTINGS for seed in seeds]
    print(f"{len(cells)} runs of {args.epochs} epochs on {args.jobs} process(es)", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, args.dataset, args.docs, label, seed, args.epochs,
                               args.every) for label, seed in cells]
        results = [f.result() for f in futures]
    runs: dict[str, list[dict[str, list[float]]]] = {}
    for (label, _), r in zip(cells, results, strict=True):
        runs.setdefault(label, []).append(r)
    epochs = list(range(args.every, args.epochs + 1, args.every))[:len(results[0]["loss"])]
    mean = {label: {m: np.mean([r[m] for r in rs], axis=0) for m in METRICS}
            for label, rs in runs.items()}
    minutes = (time.perf_counter() - t0) / 60
    title = (f"{args.dataset}, {args.docs} titles, k = {K}, centralized NMF by SGD, "
             f"mean of seeds {seeds}")
    lines = [f"# Long training with the MI term ({args.dataset}, {args.docs} titles)", "",
             f"Centralized NMF by SGD, k = {K}, batch 32, SGD lr 0.5, lambda = 1 for +MI; "
             f"seeds {seeds}, mean (macro-F1: mean ± std). See the script's docstring. "
             f"{minutes:.1f} min on {args.jobs} process(es) of a shared 2-core CPU.", "",
             "| epochs | " + " | ".join(f"{label}: F1" for label in SETTINGS) + " | "
             + " | ".join(f"{label}: loss" for label in SETTINGS) + " | "
             + " | ".join(f"{label}: H row sum" for label in SETTINGS) + " |",
             "|---:|" + "---:|" * (3 * len(SETTINGS))]
    for i, ep in enumerate(epochs):
        f1 = [np.array([r["macro_f1"][i] for r in runs[label]]) for label in SETTINGS]
        lines.append(f"| {ep} | " + " | ".join(f"{v.mean():.3f} ± {v.std(ddof=1):.3f}"
                                               if len(v) > 1 else f"{v.mean():.3f}"
                                               for v in f1) + " | "
                     + " | ".join(f"{mean[label]['loss'][i]:.2f}" for label in SETTINGS)
                     + " | "
                     + " | ".join(f"{mean[label]['h_row_sum'][i]:.2f}" for label in SETTINGS)
                     + " |")
    last = len(epochs) - 1
    lines += ["", "At the end: SMILE bound "
              + ", ".join(f"{label} {mean[label]['mi'][last]:.2f}" for label in SETTINGS
                          if SETTINGS[label][0] > 0)
              + " nats; median topic norm "
              + ", ".join(f"{label} {mean[label]['topic_norm'][last]:.2f}" for label in SETTINGS)
              + ".", ""]
    text = "\n".join(lines) + "\n"
    print(text)
    stem = "fednmf_mi_long"
    if args.dataset != "stackoverflow":
        stem += f"_{args.dataset}"
    if args.docs != 3000:
        stem += f"_{args.docs}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS / f"{stem}.md", text.encode())
    settings = {k: {"mi_weight": lam, **o} for k, (lam, o) in SETTINGS.items()}
    payload: dict[str, Any] = {"dataset": args.dataset, "docs": args.docs, "epochs": epochs,
                               "seeds": seeds, "settings": settings, "runs": runs,
                               "minutes": minutes}
    atomic_write_bytes(RESULTS / f"{stem}.json", json.dumps(payload, indent=2).encode())
    plot(RESULTS / f"{stem}.png", epochs, mean, title)


if __name__ == "__main__":
    main()
