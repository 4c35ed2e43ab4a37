"""Federated vs centralized ProdLDA and CombinedTM on real text (stackoverflow, dbpedia_10k).

For each dataset a seeded subset is split 80/20 into training and held-out documents; the
training documents are shared among 3 nodes by a Dirichlet(0.5) skew over their labels (as
``fedctl`` does). The vocabulary is agreed as on the cluster: each node's
:func:`common.text.local_vocabulary`, merged by :func:`common.text.merge_vocabularies`
(2000 words, min_df 2). Then, for each model:

* centralized: one model on all training documents pooled, each step on the union of the
  nodes' mini-batches (:func:`common.models.ntm.simulate_union`);
* federated: synchronous gFedNTM training (:func:`common.models.ntm.simulate_sync`, the code
  the cluster runs, in one process), each node a batch of 64 per step;

with the same steps and initial weights and the reference defaults otherwise (dropout 0.2, batch
statistics, sampled noise). Scores: NPMI (reference corpus: the whole subset), topic
diversity, inverted RBO (``common.topic_metrics``) and held-out perplexity.

Usage: ``python benchmarks/ntm_real.py [--docs 3000] [--epochs 40] [--topics 20]``. Writes
``benchmarks/results/ntm_real.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.data import embed_texts, partition, read_jsonl  # noqa: E402
from common.models.ntm import (  # noqa: E402
    CONTEXT_SIZE,
    NTMParams,
    simulate_sync,
    simulate_union,
)
from common.text import bow_matrix, local_vocabulary, merge_vocabularies  # noqa: E402
from common.topic_metrics import inverted_rbo, npmi_coherence, topic_diversity  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DATASETS = {"stackoverflow": Path("/work/shared/data/stackoverflow/stackoverflow.jsonl"),
            "dbpedia_10k": ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"}


def scores(model, vocab, X_ref, X_test, c_test) -> dict:
    topics = model.get_topics(10, vocab)
    return {"npmi": npmi_coherence(topics, X_ref, vocab), "diversity": topic_diversity(topics),
            "inverted_rbo": inverted_rbo(topics),
            "perplexity": model.perplexity(X_test, c_test), "topics": topics}


def run_dataset(name: str, path: Path, args: argparse.Namespace) -> dict:
    full = read_jsonl(path)
    rng = np.random.default_rng(args.seed)
    idx = np.sort(rng.choice(len(full.texts), size=min(args.docs, len(full.texts)),
                             replace=False))
    texts = [full.texts[i] for i in idx]
    labels = np.unique([str(full.labels[i]) for i in idx], return_inverse=True)[1]
    # dbpedia_10k's embeddings of the whole file are usually cached: embed it whole then.
    whole = len(full.texts) <= 10_000
    emb = embed_texts(full.texts if whole else texts, progress=False)
    emb = np.asarray(emb[idx] if whole else emb, dtype=np.float32)
    perm = rng.permutation(len(texts))
    n_test = len(texts) // 5
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    parts = [train[p] for p in partition(labels[train], args.nodes, scheme="dirichlet",
                                         alpha=0.5, seed=args.seed)]
    vocab = merge_vocabularies([local_vocabulary([texts[i] for i in p]) for p in parts],
                               max_size=args.vocab, min_df=2)
    X = bow_matrix(texts, vocab)
    out = {"documents": len(texts), "train": len(train), "test": len(test),
           "vocabulary": len(vocab), "node_sizes": [len(p) for p in parts], "models": {}}
    for family, csize in (("prodlda", 0), ("combinedtm", CONTEXT_SIZE)):
        p = NTMParams(n_topics=args.topics)
        ctx = emb if csize else None
        c_test = emb[test] if csize else None
        steps = args.epochs * math.ceil(len(train) / (args.nodes * p.batch_size))
        shards = [(X[q], None if ctx is None else ctx[q]) for q in parts]
        t0 = time.perf_counter()
        central = simulate_union(shards, p, steps, random_state=args.seed,
                                 contextual_size=csize)
        t_central = time.perf_counter() - t0
        t0 = time.perf_counter()
        fed = simulate_sync(shards, p, steps, random_state=args.seed, contextual_size=csize)
        t_fed = time.perf_counter() - t0
        res = {"centralized": scores(central, vocab, X, X[test], c_test),
               "federated": scores(fed, vocab, X, X[test], c_test),
               "steps_federated": steps, "steps_centralized": central.steps_,
               "seconds_centralized": t_central, "seconds_federated": t_fed}
        pc, pf = res["centralized"]["perplexity"], res["federated"]["perplexity"]
        res["perplexity_difference_pct"] = 100 * (pf - pc) / pc
        out["models"][family] = res
        print(f"{name} {family}: NPMI central {res['centralized']['npmi']:.3f} fed "
              f"{res['federated']['npmi']:.3f}; perplexity central {pc:.1f} fed {pf:.1f} "
              f"({res['perplexity_difference_pct']:+.2f}%) [{t_central:.0f}s/{t_fed:.0f}s]",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--topics", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datasets", default=",".join(DATASETS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results = {name: run_dataset(name, DATASETS[name], args)
               for name in args.datasets.split(",")}
    lines = ["# Federated vs centralized neural topic models on real text", "",
             f"{args.docs} documents per dataset (seeded subset), 80/20 train/held-out, "
             f"training shared among {args.nodes} nodes (Dirichlet 0.5 over labels), "
             f"vocabulary agreed from the nodes' vocabularies ({args.vocab} words max, "
             f"min_df 2), K = {args.topics}, {args.epochs} epochs for both (same steps, same "
             f"union batches, same initial weights; centralized sees the union as one batch), "
             f"reference "
             f"defaults (dropout 0.2, batch statistics, sampled noise, Adam 2e-3/0.99, batch "
             f"64 per node). Federated = synchronous gFedNTM simulated in one process. "
             f"NPMI on the whole subset; perplexity on the held-out documents. "
             f"Wall time {time.perf_counter() - t0:.0f} s on 2 shared CPU cores.", "",
             "| dataset | model | training | NPMI | diversity | inverted RBO | perplexity |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for family, m in r["models"].items():
            for who in ("centralized", "federated"):
                s = m[who]
                lines.append(f"| {name} | {family} | {who} | {s['npmi']:.3f} | "
                             f"{s['diversity']:.3f} | {s['inverted_rbo']:.3f} | "
                             f"{s['perplexity']:.1f} |")
    lines += ["", "Held-out perplexity, federated vs centralized:", ""]
    for name, r in results.items():
        for family, m in r["models"].items():
            lines.append(f"* {name} {family}: {m['perplexity_difference_pct']:+.2f}%")
    lines += ["", "## First topics (10 words)", ""]
    for name, r in results.items():
        for family, m in r["models"].items():
            for who in ("centralized", "federated"):
                lines.append(f"**{name} {family} {who}**")
                lines += [f"{i + 1}. {' '.join(t)}" for i, t in enumerate(m[who]["topics"][:5])]
                lines.append("")
    md = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ntm_real.md").write_text(md + "\n")
    (RESULTS / "ntm_real.json").write_text(json.dumps(
        {"args": vars(args), "results": results}, indent=2))
    print(md)


if __name__ == "__main__":
    main()
