"""iFTM benchmark (Jiang et al. 2021, Figs. 5–7) at reduced scale, plus sampler throughput.

Parties hold unbalanced, non-i.i.d. corpora: party i takes ``skew`` of its documents from its
"own" bundled corpus and the rest from the others, with sizes in the paper's 1 : 2 : 3 ratio
(1 : 2 : 3 : 4 with four parties). A held-out test corpus is drawn from the same sources
(documents no party holds). Everything runs in this process with the code the cluster runs
(``LDAMH`` on the parties, ``merge_models`` / ``compose`` on the master; the cluster adds only
the ZeroMQ transport). Scores are the document-completion held-out log-likelihood of the test
corpus (:func:`common.models.lda_mh.heldout_log_likelihood`), NPMI on the test corpus, and
topic diversity.

    python benchmarks/iftm_lda.py [--docs 500] [--rounds 5] [--sweeps 20] [--topics 20]
                                  [--only quality|throughput] [--repeats 3]

Writes ``benchmarks/results/iftm_lda.{md,json}`` and ``iftm_lda_{likelihood,rounds,
throughput}.png``; with ``--only``, the other part's results are kept from the JSON. Run the
throughput part pinned to an otherwise idle core (``taskset -c 1``): it is per core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # throughput is per core

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.data.reading import read_jsonl  # noqa: E402
from common.data.text import bow_matrix, local_vocabulary, merge_vocabularies  # noqa: E402
from common.eval.topics import npmi_coherence, top_words, topic_diversity  # noqa: E402
from common.models.iftm import compose, merge_models, topic_normalize  # noqa: E402
from common.models.lda_mh import LDAMH, Corpus, corpus_from_texts, heldout_log_likelihood  # noqa: E402

DATA = Path("/work/shared/data")
SOURCES = {"agnews": DATA / "agnews_8000/agnews_8000.jsonl",
           "dbpedia": ROOT / "data/dbpedia_10k/dbpedia_10k.jsonl",
           "tagmynews": DATA / "tagmynews_subset/tagmynews_subset.jsonl",
           "stackoverflow": DATA / "stackoverflow/stackoverflow.jsonl"}
RESULTS = ROOT / "benchmarks" / "results"
ALPHA, BETA = 0.1, 0.01
EPSILONS = (8.0, 9.0, 10.0, 11.0)
TAUS = (0.0, 0.2)
PAPER = {"iftm": -2.74e7, "best_party": -3.03e7}


def build_parties(n_parties: int, base_docs: int, test_docs: int, skew: float, seed: int
                  ) -> tuple[list[list[str]], list[str]]:
    """Texts of each party (sizes base x 1, 2, 3[, 4]) and of the test corpus."""
    rng = np.random.default_rng(seed)
    names = list(SOURCES)[:n_parties]
    pools = {}
    for name in names:
        texts = list(read_jsonl(SOURCES[name]).texts)
        pools[name] = [texts[i] for i in rng.permutation(len(texts))]
    used = dict.fromkeys(names, 0)

    def take(name: str, n: int) -> list[str]:
        out = pools[name][used[name]:used[name] + n]
        used[name] += n
        return out

    test = [t for name in names for t in take(name, test_docs // n_parties)]
    parties = []
    for i, own in enumerate(names):
        n = base_docs * (i + 1)
        n_own = int(round(skew * n))
        others = [m for m in names if m != own]
        share = np.full(len(others), (n - n_own) // len(others))
        share[: (n - n_own) - share.sum()] += 1
        docs = take(own, n_own) + [t for m, s in zip(others, share, strict=True)
                                   for t in take(m, int(s))]
        parties.append(docs)
    return parties, test


def score(topics: np.ndarray, test: Corpus, test_bow, vocab: list[str], seed: int
          ) -> dict[str, float]:
    ll = heldout_log_likelihood(topics, test, ALPHA, n_iter=30, random_state=seed)
    heads = top_words(topics, vocab, 10)
    return {"loglik": ll["loglik"], "loglik_per_token": ll["loglik_per_token"],
            "perplexity": ll["perplexity"], "npmi": npmi_coherence(heads, test_bow, vocab),
            "diversity": topic_diversity(heads), "n_topics": int(topics.shape[0])}


def run_iftm(corpora: list[Corpus], k: int, sentence: bool, epsilon: float | None, tau: float,
             rounds: int, sweeps: int, test: Corpus, test_bow, vocab: list[str], seed: int,
             xi: float, top_l: int) -> dict:
    """Parties sample locally, the master merges and composes, ``rounds`` times."""
    models = [LDAMH(k, ALPHA, BETA, n_iter=sweeps, sentence=sentence, epsilon=epsilon,
                    tau=tau, warm_start=True, random_state=seed + i)
              for i in range(len(corpora))]
    composed: list[np.ndarray | None] = [None] * len(corpora)
    sizes = [c.n_tokens for c in corpora]
    curve = []
    merged = None
    for rnd in range(1, rounds + 1):
        uploads = []
        for i, (m, c) in enumerate(zip(models, corpora, strict=True)):
            m.fit(c, topic_prior=composed[i])
            uploads.append(topic_normalize(m.components_, BETA))
        merged, _ = merge_models(uploads, sizes, xi, top_l)
        composed = [compose(u, merged, xi, top_l)[0] for u in uploads]
        s = score(merged, test, test_bow, vocab, seed)
        s["round"] = rnd
        curve.append(s)
    return {"final": curve[-1], "curve": curve}


def throughput(corpus: Corpus, k: int, sentence: bool, sweeps: int) -> float:
    """Tokens per second of one core over ``sweeps`` sweeps (after a warm-up sweep)."""
    m = LDAMH(k, ALPHA, BETA, n_iter=1, sentence=sentence, epsilon=11.0, tau=0.2,
              warm_start=True, random_state=0).fit(corpus)
    m.n_iter = sweeps
    t0 = time.perf_counter()
    m.fit(corpus)
    return sweeps * corpus.n_tokens / (time.perf_counter() - t0)


def measure_throughput(vocab: list[str], repeats: int) -> list[dict]:
    """Sampler throughput on all of two bundled corpora over ``vocab``, LDA and SentenceLDA
    at 20 and 100 topics: the median of ``repeats`` measurements of 5 sweeps each."""
    # a larger corpus than the parties', so the per-sweep O(V K) word tables amortize as they
    # do at LightLDA scale
    big = corpus_from_texts([t for name in ("agnews", "dbpedia")
                             for t in read_jsonl(SOURCES[name]).texts], vocab)
    out = []
    for family, sentence in (("lda", False), ("sentencelda", True)):
        for k in (20, 100):
            runs = [throughput(big, k, sentence, sweeps=5) for _ in range(repeats)]
            out.append({"family": family, "n_topics": k, "tokens": big.n_tokens,
                        "tokens_per_s": float(np.median(runs)), "runs": runs})
            print(f"throughput {family} k={k}: {np.median(runs) / 1e6:.2f} M tokens/s "
                  f"(median of {[round(x / 1e6, 2) for x in runs]})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=500, help="party 1's documents (base size)")
    ap.add_argument("--test-docs", type=int, default=1500)
    ap.add_argument("--topics", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweeps", type=int, default=20, help="MH sweeps per round")
    ap.add_argument("--skew", type=float, default=0.8)
    ap.add_argument("--xi", type=float, default=0.3)
    ap.add_argument("--top-l", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("quality", "throughput"),
                    help="run one part; the other's results are kept from iftm_lda.json")
    ap.add_argument("--repeats", type=int, default=3,
                    help="throughput measurements per setting (the median is reported)")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    total_sweeps = args.rounds * args.sweeps
    results: dict = {"args": vars(args), "settings": {}, "throughput": []}
    if args.only:
        previous = json.loads((RESULTS / "iftm_lda.json").read_text())
        if args.only == "throughput":
            results = previous
            texts, _ = build_parties(3, args.docs, args.test_docs, args.skew, args.seed)
            vocab = merge_vocabularies([local_vocabulary(t) for t in texts], args.vocab,
                                       min_df=2)
            results["throughput"] = measure_throughput(vocab, args.repeats)
            results["throughput_args"] = vars(args)
            finish(results)
            return
        results["throughput"] = previous["throughput"]
    for n_parties in (3, 4):
        texts, test_texts = build_parties(n_parties, args.docs, args.test_docs, args.skew,
                                          args.seed)
        vocab = merge_vocabularies([local_vocabulary(t) for t in texts], args.vocab, min_df=2)
        corpora = [corpus_from_texts(t, vocab) for t in texts]
        test = corpus_from_texts(test_texts, vocab)
        test_bow = bow_matrix(test_texts, vocab)
        pooled = corpus_from_texts([t for p in texts for t in p], vocab)
        setting: dict = {"party_docs": [len(t) for t in texts],
                         "party_tokens": [c.n_tokens for c in corpora],
                         "test_docs": len(test_texts), "vocab": len(vocab)}
        for family, sentence in (("lda", False), ("sentencelda", True)):
            print(f"[{n_parties} parties, {family}] {setting['party_tokens']} tokens, "
                  f"{time.perf_counter() - t_start:.0f}s", flush=True)
            fam: dict = {"parties": [], "iftm": {}}
            for i, c in enumerate(corpora):
                m = LDAMH(args.topics, ALPHA, BETA, n_iter=total_sweeps, sentence=sentence,
                          epsilon=None, tau=0.0, random_state=args.seed + i).fit(c)
                fam["parties"].append(score(m.topic_word_, test, test_bow, vocab, args.seed))
            central = LDAMH(args.topics, ALPHA, BETA, n_iter=total_sweeps, sentence=sentence,
                            epsilon=None, tau=0.0, random_state=args.seed).fit(pooled)
            fam["centralized"] = score(central.topic_word_, test, test_bow, vocab, args.seed)
            grid = ([(e, t) for e in EPSILONS for t in TAUS] if n_parties == 3
                    else [(11.0, 0.2)])
            for eps, tau in grid:
                fam["iftm"][f"eps={eps:g},tau={tau:g}"] = run_iftm(
                    corpora, args.topics, sentence, eps, tau, args.rounds, args.sweeps, test,
                    test_bow, vocab, args.seed, args.xi, args.top_l)
            fam["iftm"]["no privacy"] = run_iftm(
                corpora, args.topics, sentence, None, 0.0, args.rounds, args.sweeps, test,
                test_bow, vocab, args.seed, args.xi, args.top_l)
            setting[family] = fam
        results["settings"][f"{n_parties}_parties"] = setting
        if n_parties == 3 and args.only is None:
            results["throughput"] = measure_throughput(vocab, args.repeats)
    results["wall_s"] = time.perf_counter() - t_start
    finish(results)


def finish(results: dict) -> None:
    """Write the JSON, the markdown report and the plots."""
    (RESULTS / "iftm_lda.json").write_text(json.dumps(results, indent=2))
    md = report(results)
    (RESULTS / "iftm_lda.md").write_text(md)
    print(md)
    plots(results)


def report(r: dict) -> str:
    a = r["args"]
    lines = ["# iFTM: federated LDA / SentenceLDA (reduced scale)\n",
             f"Parties' documents {a['docs']} x (1, 2, 3[, 4]), {a['skew']:.0%} from their own "
             f"corpus; {a['topics']} topics per party; {a['rounds']} rounds x {a['sweeps']} MH "
             f"sweeps (party-alone and centralized: {a['rounds'] * a['sweeps']} sweeps); "
             f"ξ = {a['xi']}, top-L = {a['top_l']}. Held-out log-likelihood by document "
             "completion on a test corpus no party holds (higher is better). 2 shared, noisy "
             f"CPU cores; wall time {r['wall_s']:.0f} s.\n"]
    for name, s in r["settings"].items():
        lines.append(f"## {name.replace('_', ' ')}: party tokens {s['party_tokens']}, test docs "
                     f"{s['test_docs']}, vocabulary {s['vocab']}\n")
        lines.append("| family | model | held-out LL | LL / token | perplexity | NPMI | "
                     "diversity | topics |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for family in ("lda", "sentencelda"):
            f = s[family]
            rows = [(f"party {i + 1} alone", p) for i, p in enumerate(f["parties"])]
            rows.append(("centralized", f["centralized"]))
            rows += [(f"iFTM {k}", v["final"]) for k, v in f["iftm"].items()]
            for label, m in rows:
                lines.append(f"| {family} | {label} | {m['loglik']:.4g} | "
                             f"{m['loglik_per_token']:.4f} | {m['perplexity']:.1f} | "
                             f"{m['npmi']:.3f} | {m['diversity']:.2f} | {m['n_topics']} |")
            best = max(p["loglik"] for p in f["parties"])
            ift = f["iftm"].get("eps=11,tau=0.2", next(iter(f["iftm"].values())))["final"]
            lines.append(f"| {family} | **iFTM (ε=11, τ=0.2) − best party** | "
                         f"{ift['loglik'] - best:+.4g} | | | | | |")
        lines.append("")
    lines.append(f"Paper (full scale, its corpus): iFTM {PAPER['iftm']:.3g} vs best single party "
                 f"{PAPER['best_party']:.3g}.\n")
    lines.append("## Held-out LL of the merged global model by round (3 parties, ε=11, τ=0.2)\n")
    lines.append("| round | lda | sentencelda |")
    lines.append("|---|---|---|")
    s3 = r["settings"]["3_parties"]
    c1 = s3["lda"]["iftm"]["eps=11,tau=0.2"]["curve"]
    c2 = s3["sentencelda"]["iftm"]["eps=11,tau=0.2"]["curve"]
    for x, y in zip(c1, c2, strict=True):
        lines.append(f"| {x['round']} | {x['loglik']:.4g} | {y['loglik']:.4g} |")
    lines.append("\n## Sampler throughput (one core, NUMBA_NUM_THREADS=1, ε=11, τ=0.2, "
                 "2 MH rounds of doc + word proposal per token or sentence)\n")
    lines.append("Median of the runs (5 sweeps each, after a warm-up sweep); goal: 1 M tokens "
                 "/ s / core.\n")
    lines.append("| family | topics | tokens | M tokens / s | runs |")
    lines.append("|---|---|---|---|---|")
    for t in r["throughput"]:
        runs = ", ".join(f"{x / 1e6:.2f}" for x in t.get("runs", [t["tokens_per_s"]]))
        lines.append(f"| {t['family']} | {t['n_topics']} | {t['tokens']} | "
                     f"{t['tokens_per_s'] / 1e6:.2f} | {runs} |")
    return "\n".join(lines) + "\n"


def plots(r: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s3 = r["settings"]["3_parties"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, family in zip(axes, ("lda", "sentencelda"), strict=True):
        f = s3[family]
        for tau, style in zip(TAUS, ("o-", "s--"), strict=True):
            ax.plot(EPSILONS, [f["iftm"][f"eps={e:g},tau={tau:g}"]["final"]["loglik"]
                               for e in EPSILONS], style, label=f"iFTM τ={tau:g}")
        for i, p in enumerate(f["parties"]):
            ax.axhline(p["loglik"], color=f"C{i + 2}", lw=1, ls=":", label=f"party {i + 1}")
        ax.axhline(f["centralized"]["loglik"], color="k", lw=1, label="centralized")
        ax.set(title=f"{family}, 3 parties", xlabel="ε", ylabel="held-out log-likelihood")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "iftm_lda_likelihood.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for family in ("lda", "sentencelda"):
        for n in ("3_parties", "4_parties"):
            c = r["settings"][n][family]["iftm"]["eps=11,tau=0.2"]["curve"]
            ax.plot([x["round"] for x in c], [x["loglik_per_token"] for x in c], "o-",
                    label=f"{family}, {n.replace('_', ' ')}")
    ax.set(xlabel="communication round", ylabel="held-out LL per token",
           title="iFTM global model by round (ε=11, τ=0.2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "iftm_lda_rounds.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{t['family']}\nk={t['n_topics']}" for t in r["throughput"]]
    ax.bar(labels, [t["tokens_per_s"] / 1e6 for t in r["throughput"]])
    ax.axhline(1.0, color="r", ls="--", label="goal: 1 M tokens/s/core")
    ax.set(ylabel="M tokens / s / core", title="MH sampler throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "iftm_lda_throughput.png", dpi=120)


if __name__ == "__main__":
    main()
