"""Benchmark: the FedNMF paper's Tables III/IV and Fig. 4 (Si et al., IJCNN 2022), scaled down.

For each dataset (stackoverflow, sms_spam, rt_polarity, tagmynews_subset from
``../shared/data``) and k in {50, 100} topics, every method learns topics from the same 80 %
training titles and is scored on:

* NPMI coherence of the top-10 words on the reference corpus (the whole dataset file), topic
  diversity (unique share of the top-10 words), inverted RBO, and embedding coherence (mean
  pairwise cosine of the top-10 words' all-MiniLM-L6-v2 embeddings, the stand-in for GloVe);
* downstream classification: topic weights of the training and the held-out 20 % titles are
  solved with the topics fixed (each model's ``transform``), a linear SVM is trained on the
  former and scored on the latter (macro-F1, accuracy).

Methods: scikit-learn LDA, scikit-learn NMF, NMF by SGD (+MI), and FedNMF (+MI) with FedAvg,
FedAdagrad, FedYogi and FedAdam. The federated runs are an in-process simulation driving the
cluster's own family code (``worker.families.nmf.NMFClient`` and
``master.families.nmf.NMFServer``, the pre-training exchange included) and the master's client
sampling; only the sockets are left out. K = 10 equal-sized clients with label proportions
from Dir(alpha p), alpha = 1 (:func:`common.data.partitions.dirichlet_equal`), a fraction C = 0.2 of
them per round. Fig. 4 sweeps alpha and K for FedAvg(+MI) and FedAdam(+MI) on stackoverflow.

Scale (to finish in about 25 minutes on 2 shared CPU cores): a seeded random subset of
``--docs`` (3,000) titles per dataset, a 2,000-word vocabulary, ``--rounds`` (50) rounds of
``--epochs`` (2) local epochs, so that the federated runs see as many titles as 20 epochs of the
centralized SGD; one seed. One real cluster (``fedctl run``: a master and 10 worker processes
over TCP loopback) is timed for the per-round time and bytes, with and without MI.

The +MI runs use the family's default ``mi_keeps_scale: true``; ``--mi-paper-update`` gives
them the paper's update instead (``mi_keeps_scale: false``, see docs/FEDNMF.md).

    python benchmarks/fednmf_tables.py [--docs 3000] [--rounds 50] [--epochs 2]
        [--mi-weight 1] [--mi-paper-update] [--quick]

Prints the tables and writes benchmarks/results/fednmf_tables.{json,md} and
benchmarks/results/fednmf_fig4.png; ``_lambda<lambda>`` is added to both names for another
``--mi-weight``, ``_paper_update`` for ``--mi-paper-update``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402
from sklearn.decomposition import NMF, LatentDirichletAllocation  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from common.atomic import atomic_write_bytes  # noqa: E402
from common.config import parse_config  # noqa: E402
from common.data.embedding import embed_texts  # noqa: E402
from common.data.partitions import dirichlet_equal  # noqa: E402
from common.data.reading import make_task, read_jsonl  # noqa: E402
from common.data.shards import LocalData  # noqa: E402
from common.data.text import bow_matrix  # noqa: E402
from common.eval.topics import (  # noqa: E402
    embedding_coherence,
    inverted_rbo,
    npmi_coherence,
    svm_scores,
    top_words,
    topic_diversity,
)
from common.models.nmf import COMPONENTS, SGDNMF  # noqa: E402
from common.net.transport import free_ports  # noqa: E402
from common.runlog import read_metrics  # noqa: E402
from master.families.nmf import NMFServer  # noqa: E402
from master.strategies import ClientResult, make_strategy  # noqa: E402
from worker.families.nmf import NMFClient  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DATASETS = ("stackoverflow", "sms_spam", "rt_polarity", "tagmynews_subset")
STRATEGIES = ("fedavg", "fedadagrad", "fedyogi", "fedadam")
LABELS = {"fedavg": "FedAvg", "fedadagrad": "FedAdagrad", "fedyogi": "FedYogi",
          "fedadam": "FedAdam"}
MI_WEIGHT = 1.0
CRITIC_BY_STRATEGY = "FedAdam+MI, critic stepped by FedAdam"
VOCAB_SIZE = 2000
#: The paper's numbers we could find. Its Tables III and IV were not available here (no
#: internet; the stored copies of the paper have the abstract only); the issue quotes one.
PAPER = {("stackoverflow", "FedAdam+MI", "macro_f1"): 0.647}


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


class Corpus:
    """One dataset: a seeded subset of titles, its 80/20 split, and the reference corpus."""

    def __init__(self, name: str, n_docs: int, seed: int = 0) -> None:
        path = SHARED / name / f"{name}.jsonl"
        self.name = name
        self.reference = read_jsonl(path)  # the whole file: the NPMI reference corpus
        self.dataset = read_jsonl(path, limit=n_docs, seed=seed)
        self.y, self.classes = make_task(self.dataset.labels, "multiclass")
        rows = np.arange(len(self.y))
        train, test = train_test_split(rows, test_size=0.2, random_state=seed, stratify=self.y)
        self.train, self.test = np.sort(train), np.sort(test)
        self._ref_bow: dict[tuple[str, ...], Any] = {}
        self._emb: dict[str, np.ndarray] = {}

    def reference_bow(self, vocab: list[str]) -> Any:
        key = tuple(vocab)
        if key not in self._ref_bow:
            self._ref_bow = {key: bow_matrix(self.reference.texts, vocab)}
        return self._ref_bow[key]

    def embed(self, words: list[str]) -> np.ndarray:
        missing = [w for w in words if w not in self._emb]
        if missing:
            vectors = embed_texts(missing, device="cpu", progress=False,
                                  backend="torch")  # the reference the tables were scored on
            self._emb.update(zip(missing, vectors, strict=True))
        return np.stack([self._emb[w] for w in words])


def scores(corpus: Corpus, vocab: list[str], components: np.ndarray, transform: Any,
           X: Any) -> dict[str, float]:
    """Topic quality and downstream classification of one model (see the module notes)."""
    topics = top_words(components, vocab, 10)
    h_train, h_test = transform(X[corpus.train]), transform(X[corpus.test])
    out = {"npmi": npmi_coherence(topics, corpus.reference_bow(vocab), vocab),
           "diversity": topic_diversity(topics),
           "inverted_rbo": inverted_rbo(topics),
           "embedding_coherence": embedding_coherence(topics, corpus.embed)}
    out.update(svm_scores(h_train, corpus.y[corpus.train], h_test, corpus.y[corpus.test]))
    out["topics_sample"] = [" ".join(t[:6]) for t in topics[:3]]
    return out


# --------------------------------------------------------------------------------------------
# Federated simulation with the cluster's own family code
# --------------------------------------------------------------------------------------------


def simulate(corpus: Corpus, strategy: str, n_topics: int, mi_weight: float, rounds: int,
             epochs: int, n_clients: int = 10, alpha: float = 1.0, fraction: float = 0.2,
             seed: int = 0, all_titles: bool = False, **model: Any
             ) -> tuple[NMFServer, dict[str, Any]]:
    """Run FedNMF(+MI) in-process; returns the master's family and timing figures.

    The clients share the training titles; with ``all_titles`` they hold every title,
    held-out ones included, and the figures carry ``doc_topic``: the topic weights H each
    client learned for its titles (pooled here for scoring only), rows in corpus order.
    """
    names = [f"w{i + 1}" for i in range(n_clients)]
    cfg = parse_config({
        "workers": names, "strategy": strategy, "rounds": rounds, "client_fraction": fraction,
        "seed": seed, "model": {"family": "nmf", "n_topics": n_topics, "mi_weight": mi_weight,
                                "local_epochs": epochs, "vocab_size": VOCAB_SIZE, **model}},
        source="<fednmf benchmark>")
    held = np.arange(len(corpus.y)) if all_titles else corpus.train
    parts = [held[part] for part in dirichlet_equal(corpus.y[held], n_clients, alpha, seed=seed)]
    no_test = np.zeros(0, dtype=np.int64)
    clients = {
        name: NMFClient(cfg, LocalData(corpus.dataset, corpus.y, corpus.classes, part, no_test),
                        "cpu", seed + 1000 + i)
        for i, (name, part) in enumerate(zip(names, parts, strict=True))}
    server = NMFServer(cfg, make_strategy(cfg.strategy["name"], **cfg.strategy_params))
    server.setup({name: c.registration_info() for name, c in clients.items()})
    for c in clients.values():
        c.setup(server.setup_info_)
    rng = np.random.default_rng(cfg.seed)  # as the master samples (master.server.Master)
    drift: list[float] = []
    t0 = time.perf_counter()
    for rnd in range(1, rounds + 1):
        k = max(1, round(fraction * len(names)))
        chosen = names if k >= len(names) else sorted(rng.choice(names, k, replace=False))
        results = []
        start = server.global_.arrays[COMPONENTS]
        for name in chosen:
            fit = clients[name].fit(rnd, server.global_.meta, server.global_.arrays)
            results.append(ClientResult(name, fit.arrays, fit.n_samples))
            drift.append(float(np.linalg.norm(fit.arrays[COMPONENTS] - start)
                               / max(np.linalg.norm(start), 1e-12)))
        server.aggregate(rnd, results)
    elapsed = time.perf_counter() - t0
    # client drift: how far one local update moves the topics, relative to their size
    out = {"seconds": elapsed, "seconds_per_round": elapsed / rounds,
           "client_drift": float(np.median(drift))}
    if all_titles:
        h = np.zeros((len(corpus.y), n_topics), dtype=np.float32)
        for name, part in zip(names, parts, strict=True):
            model_ = clients[name].model
            if model_ is not None and model_.n_steps_:  # never sampled: H stays 0
                h[part] = model_.doc_topic_
        out["doc_topic"] = h
    return server, out


def mi_options(args: argparse.Namespace) -> dict[str, Any]:
    """The MI term's options of every +MI run of this benchmark."""
    return {"mi_weight": args.mi_weight, "mi_keeps_scale": not args.mi_paper_update}


def fed_row(corpus: Corpus, strategy: str, n_topics: int, mi: bool, args: argparse.Namespace,
            mi_weight: float = MI_WEIGHT, **kw: Any) -> dict[str, Any]:
    server, timing = simulate(corpus, strategy, n_topics, mi_weight if mi else 0.0,
                              args.rounds, args.epochs, **kw)
    vocab = server.setup_info_["vocabulary"]
    model = server.params.model()
    model.set_arrays(server.global_.arrays)
    X = bow_matrix(corpus.dataset.texts, vocab)
    row = {**scores(corpus, vocab, model.components_, model.transform, X), **timing}
    h = row.pop("doc_topic", None)
    if h is not None:  # the clients' own H, as the paper presumably classifies
        tr, te, y = corpus.train, corpus.test, corpus.y
        row["learned_h"] = svm_scores(h[tr], y[tr], h[te], y[te])
    return row


# --------------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------------


def centralized_rows(corpus: Corpus, vocab: list[str], n_topics: int, args: argparse.Namespace
                     ) -> dict[str, dict[str, Any]]:
    X = bow_matrix(corpus.dataset.texts, vocab)
    Xtr = X[corpus.train]
    central_epochs = round(args.rounds * args.epochs * 0.2)  # as many titles as federated
    models: dict[str, Any] = {
        "LDA": lambda: LatentDirichletAllocation(n_topics, learning_method="batch",
                                                 max_iter=20, random_state=0).fit(Xtr),
        "NMF": lambda: NMF(n_topics, init="nndsvda", max_iter=400, random_state=0).fit(Xtr),
        "NMF+SGD": lambda: SGDNMF(n_topics, random_state=0).fit(Xtr, epochs=central_epochs),
        "NMF+SGD+MI": lambda: SGDNMF(n_topics, random_state=0, **mi_options(args)).fit(
            Xtr, epochs=central_epochs),
    }
    rows = {}
    for label, fit in models.items():
        t0 = time.perf_counter()
        m = fit()
        seconds = time.perf_counter() - t0
        rows[label] = {**scores(corpus, vocab, m.components_, m.transform, X),
                       "seconds": seconds}
    return rows


def tables(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in args.datasets:
        corpus = Corpus(name, args.docs)
        for k in args.topics:
            t0 = time.perf_counter()
            rows: dict[str, dict[str, Any]] = {}
            vocab = None
            for strategy in STRATEGIES:
                for mi in (False, True):
                    label = LABELS[strategy] + ("+MI" if mi else "")
                    rows[label] = fed_row(corpus, strategy, k, mi, args, **mi_options(args))
            # The centralized methods use the vocabulary the federation agreed on (the same
            # training titles, so the same words).
            server, _ = simulate(corpus, "fedavg", k, 0.0, 1, 1)
            vocab = server.setup_info_["vocabulary"]
            rows = {**centralized_rows(corpus, vocab, k, args), **rows}
            if name == "stackoverflow" and k == 50:
                rows[CRITIC_BY_STRATEGY] = fed_row(corpus, "fedadam", k, True, args,
                                                   critic_aggregation="strategy",
                                                   **mi_options(args))
            out[f"{name}/k={k}"] = rows
            print(f"\n## {name}, k = {k} ({len(corpus.train)} training titles, "
                  f"{time.perf_counter() - t0:.0f}s)\n")
            print(format_table(name, rows), flush=True)
    return out


def sweeps(args: argparse.Namespace, main: dict[str, Any]) -> dict[str, Any]:
    corpus = Corpus("stackoverflow", args.docs)
    methods = [("fedavg", False), ("fedavg", True), ("fedadam", False), ("fedadam", True)]
    res: dict[str, Any] = {"alpha": {}, "clients": {}}
    for alpha in args.alphas:
        for strategy, mi in methods:
            label = LABELS[strategy] + ("+MI" if mi else "")
            row = (main.get("stackoverflow/k=50", {}).get(label) if alpha == 1.0 else None) \
                or fed_row(corpus, strategy, 50, mi, args, alpha=alpha, **mi_options(args))
            res["alpha"].setdefault(label, {})[str(alpha)] = row
    for n_clients in args.clients:
        for strategy, mi in methods:
            label = LABELS[strategy] + ("+MI" if mi else "")
            row = (main.get("stackoverflow/k=50", {}).get(label) if n_clients == 10 else None) \
                or fed_row(corpus, strategy, 50, mi, args, n_clients=n_clients,
                           **mi_options(args))
            res["clients"].setdefault(label, {})[str(n_clients)] = row
    print("\n## Fig. 4 sweeps (stackoverflow, k = 50): macro-F1\n")
    for key, title in (("alpha", "alpha"), ("clients", "K")):
        cols = list(next(iter(res[key].values())))
        print(f"| method | {' | '.join(f'{title} = {c}' for c in cols)} |")
        print("|---|" + "---:|" * len(cols))
        for label, by in res[key].items():
            print(f"| {label} | " + " | ".join(f"{by[c]['macro_f1']:.3f}" for c in cols) + " |")
        print()
    return res


def plot(sweep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, xlabel in ((axes[0], "alpha", "Dirichlet alpha (K = 10)"),
                            (axes[1], "clients", "clients K (alpha = 1)")):
        for label, by in sweep[key].items():
            xs = [float(x) for x in by]
            ax.plot(xs, [by[x]["macro_f1"] for x in by], marker="o",
                    linestyle="-" if "+MI" in label else "--", label=label)
        if key == "alpha":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("macro-F1 (linear SVM on topic weights)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("FedNMF(+MI) on stackoverflow, k = 50 (cf. Si et al. 2022, Fig. 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# One real cluster: per-round time and bytes
# --------------------------------------------------------------------------------------------


def cluster_run(mi: bool, args: argparse.Namespace, critic: str = "fedavg") -> dict[str, Any]:
    """``fedctl run`` with 10 workers on stackoverflow; figures from its metrics.jsonl.
    ``critic``: the family's ``critic_aggregation`` for the +MI run."""
    with tempfile.TemporaryDirectory() as tmp:
        pub, rep = free_ports(2)
        out = Path(tmp) / "out"
        raw = {"master": {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                          "rep_port": rep},
               "workers": [f"w{i + 1}" for i in range(10)],
               "model": {"family": "nmf", "n_topics": 50, "local_epochs": args.epochs,
                         "vocab_size": VOCAB_SIZE, "critic_aggregation": critic,
                         **mi_options(args), "mi_weight": args.mi_weight if mi else 0.0},
               "strategy": "fedadam", "rounds": args.cluster_rounds, "client_fraction": 0.2,
               "min_workers": 10, "round_deadline": 300, "join_timeout": 300,
               "data": {"path": str(SHARED / "stackoverflow" / "stackoverflow.jsonl"),
                        "limit": args.docs, "task": "multiclass", "partition": "dirichlet",
                        "alpha": 1.0},
               "output_dir": str(out), "baselines": False, "seed": 0}
        cfg = Path(tmp) / "cluster.yaml"
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fedctl.cli", "run", "--config", str(cfg),
                               "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1200)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"fedctl run failed:\n{proc.stderr[-3000:]}")
        evs = read_metrics(out / "metrics.jsonl")
    rounds = [e for e in evs if e["event"] == "round"]
    workers = [e for e in evs if e["event"] == "worker_round"]
    later = rounds[1:] or rounds  # round 1 includes the setup's delivery
    return {
        "mi_weight": args.mi_weight if mi else 0.0, "critic": critic if mi else "-",
        "rounds": len(rounds), "wall_s": wall,
        "round_s_median": float(np.median([e["duration_s"] for e in later])),
        "train_s_median": float(np.median([e["slowest_train_s"] for e in later])),
        "overhead_ms_median": 1000 * float(np.median([e["overhead_s"] for e in later])),
        "aggregate_ms_median": 1000 * float(np.median([e["aggregate_s"] for e in later])),
        "broadcast_bytes": int(np.median([e["broadcast_bytes"] for e in later])),
        "round1_broadcast_bytes": int(rounds[0]["broadcast_bytes"]),
        "update_bytes": int(np.median([e["bytes_out"] for e in workers])),
        "bytes_in_per_round": int(np.median([e["bytes_in"] for e in later])),
        "updates_per_round": float(np.mean([e["n_updates"] for e in rounds])),
        "final_test_loss": float(np.mean([e["loss"] for e in workers
                                          if e["round"] == rounds[-1]["round"]])),
        "first_test_loss": float(np.mean([e["loss"] for e in workers if e["round"] == 1])),
    }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = (("npmi", "NPMI"), ("diversity", "TD"), ("inverted_rbo", "inv. RBO"),
           ("embedding_coherence", "emb. coh."), ("macro_f1", "macro-F1"),
           ("accuracy", "accuracy"))


def format_table(name: str, rows: dict[str, dict[str, Any]]) -> str:
    head = "| method | " + " | ".join(c for _, c in COLUMNS) + " | paper F1 | seconds |"
    lines = [head, "|---|" + "---:|" * (len(COLUMNS) + 2)]
    for label, r in rows.items():
        paper = PAPER.get((name, label, "macro_f1"))
        cells = [f"{r[key]:.3f}" if key in r else "n/a" for key, _ in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {paper if paper is not None else '-'} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def mi_summary(main: dict[str, Any]) -> list[str]:
    """For each dataset/k and strategy (and the centralized SGD): F1 with MI minus without."""
    lines = ["| dataset, k | " + " | ".join(["NMF+SGD", *LABELS.values()]) + " |",
             "|---|" + "---:|" * (len(LABELS) + 1)]
    wins = total = 0
    for key, rows in main.items():
        cells = []
        for base in ["NMF+SGD", *LABELS.values()]:
            d = rows[base + "+MI"]["macro_f1"] - rows[base]["macro_f1"]
            wins += d > 0
            total += 1
            cells.append(f"{d:+.3f}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"+MI has the higher macro-F1 in {wins} of {total} pairs.")
    return lines


def stems(args: argparse.Namespace) -> tuple[str, str]:
    """File stems of the tables and of the Fig. 4 plot."""
    suffix = f"_lambda{args.mi_weight:g}" if args.mi_weight != MI_WEIGHT else ""
    suffix += "_paper_update" if args.mi_paper_update else ""
    return f"fednmf_tables{suffix}", f"fednmf_fig4{suffix}"


def write_results(args: argparse.Namespace, main: dict[str, Any], sweep: dict[str, Any] | None,
                  cluster: list[dict[str, Any]], elapsed: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem, fig = stems(args)
    update = ("the paper's update, `mi_keeps_scale: false`" if args.mi_paper_update
              else "`mi_keeps_scale: true`, the family's default")
    setup = (f"{args.docs} titles per dataset (seeded subset; 80 % train / 20 % test, "
             f"stratified), {VOCAB_SIZE}-word vocabulary agreed by the clients, K = 10 clients "
             f"of equal size with Dir(alpha p) labels, alpha = 1, C = 0.2, {args.rounds} rounds "
             f"x {args.epochs} local epochs, batch 32, SGD lr 0.5, "
             f"lambda = {args.mi_weight:g} for +MI (critic averaged, {update}), FedOpt with "
             f"Flower's defaults (FedAdam eta 0.1, b1 0.9, b2 0.99, tau 1e-3; FedYogi eta "
             f"0.01; FedAdagrad eta 0.1); centralized SGD "
             f"{round(args.rounds * args.epochs * 0.2)} epochs (as many titles as the "
             f"federation sees); one seed. {os.cpu_count()} CPU cores (shared with other "
             f"work), Python {platform.python_version()}, torch {torch.__version__}, 1 thread. "
             f"Whole benchmark: {elapsed / 60:.1f} min.")
    md = ["# FedNMF / FedNMF+MI (Si et al., IJCNN 2022): Tables III/IV and Fig. 4, scaled down",
          "", setup, "",
          "NPMI: top-10 words, document co-occurrence in the whole dataset file, pairs that "
          "never co-occur count -1. TD: unique share of the top-10 words. inv. RBO: 1 - mean "
          "pairwise extrapolated RBO (p = 0.9). emb. coh.: mean pairwise cosine of the top-10 "
          "words' all-MiniLM-L6-v2 embeddings (stand-in for GloVe). macro-F1 / accuracy: "
          "linear SVM on topic weights solved with the topics fixed, trained on the training "
          "titles, scored on the held-out 20 %. Federated rows: in-process simulation with the "
          "cluster's family code (no sockets). seconds: training only (the federated rows: "
          "all rounds, clients one after another).", "",
          f"The last row of the stackoverflow k = 50 table, \"{CRITIC_BY_STRATEGY}\", is "
          "FedAdam+MI with `critic_aggregation: strategy`, i.e. the critic aggregated by the "
          "server optimizer like the topics, as the issue describes; every other +MI row "
          "averages the critic (the family's default).", "",
          "Paper F1: the paper's Tables III and IV were not available offline; the only value "
          "we have is the one the issue quotes (FedAdam+MI on stackoverflow, 0.647). The "
          "other cells are left empty rather than guessed.", ""]
    for key, rows in main.items():
        name = key.split("/")[0]
        md += [f"## {key}", "", format_table(name, rows), ""]
    md += ["## Does +MI help? macro-F1 with MI minus without", "", *mi_summary(main), "",
           "One seed: how far these differences are from chance is measured by "
           "`python benchmarks/fednmf_seeds.py` ([fednmf_seeds.md](fednmf_seeds.md)).", ""]
    if sweep:
        md += ["## Fig. 4: alpha and K sweeps (stackoverflow, k = 50), macro-F1", "",
               f"![Fig. 4]({fig}.png)", ""]
        for key, title in (("alpha", "alpha"), ("clients", "K")):
            cols = list(next(iter(sweep[key].values())))
            md.append(f"| method | {' | '.join(f'{title} = {c}' for c in cols)} |")
            md.append("|---|" + "---:|" * len(cols))
            for label, by in sweep[key].items():
                md.append(f"| {label} | "
                          + " | ".join(f"{by[c]['macro_f1']:.3f}" for c in cols) + " |")
            md.append("")
    if cluster:
        md += ["## A real cluster: per-round time and bytes", "",
               f"`fedctl run`: a master and 10 worker processes over TCP loopback, FedAdam, "
               f"k = 50, {args.cluster_rounds} rounds, C = 0.2 (2 workers per round), "
               f"{args.epochs} local epochs, stackoverflow ({args.docs} titles, the core's "
               "`dirichlet` partition, alpha = 1). Medians over rounds 2 onwards (round 1 also "
               "carries the vocabulary).", "",
               "| MI weight | critic | round (s) | slowest training (s) | overhead (ms) | "
               "aggregation (ms) | broadcast / round (bytes) | update / worker (bytes) | "
               "uploads / round (bytes) | round-1 broadcast (bytes) | test loss round 1 -> "
               "last |",
               "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in cluster:
            md.append(f"| {c['mi_weight']:g} | {c.get('critic', '-')} | "
                      f"{c['round_s_median']:.3f} | "
                      f"{c['train_s_median']:.3f} | {c['overhead_ms_median']:.1f} | "
                      f"{c['aggregate_ms_median']:.1f} | {c['broadcast_bytes']:,} | "
                      f"{c['update_bytes']:,} | {c['bytes_in_per_round']:,} | "
                      f"{c['round1_broadcast_bytes']:,} | {c['first_test_loss']:.3f} -> "
                      f"{c['final_test_loss']:.3f} |")
        md.append("")
    atomic_write_bytes(RESULTS / f"{stem}.md", ("\n".join(md) + "\n").encode())
    payload = {"setup": setup, "tables": main, "sweeps": sweep, "cluster": cluster,
               "paper": {f"{d}/{m}/{k}": v for (d, m, k), v in PAPER.items()},
               "elapsed_s": elapsed}
    atomic_write_bytes(RESULTS / f"{stem}.json",
                       json.dumps(payload, indent=2, default=float).encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--cluster-rounds", type=int, default=20)
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--topics", default="50,100")
    ap.add_argument("--alphas", default="0.1,1,10,100")
    ap.add_argument("--clients", default="1,10,30,50")
    ap.add_argument("--no-sweeps", action="store_true")
    ap.add_argument("--no-cluster", action="store_true")
    ap.add_argument("--mi-weight", type=float, default=MI_WEIGHT, help="lambda of the +MI runs")
    ap.add_argument("--mi-paper-update", action="store_true",
                    help="the +MI runs take the paper's update (mi_keeps_scale: false) instead "
                         "of the family's default")
    ap.add_argument("--quick", action="store_true",
                    help="one dataset, k = 50, 10 rounds: a smoke test of the script")
    args = ap.parse_args()
    if args.quick:
        args.datasets, args.topics, args.rounds, args.docs = "stackoverflow", "50", 10, 1000
        args.alphas, args.clients, args.cluster_rounds = "0.1,1", "1,10", 4
    args.datasets = args.datasets.split(",")
    args.topics = [int(k) for k in args.topics.split(",")]
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.clients = [int(k) for k in args.clients.split(",")]
    torch.set_num_threads(1)  # small models on a shared machine: one thread is fastest
    t0 = time.perf_counter()
    main_tables = tables(args)
    sweep = None if args.no_sweeps else sweeps(args, main_tables)
    if sweep:
        plot(sweep, RESULTS / f"{stems(args)[1]}.png")
    cluster = [] if args.no_cluster else [cluster_run(mi, args, critic) for mi, critic in
                                          ((False, "fedavg"), (True, "fedavg"), (True, "local"))]
    for c in cluster:
        print(f"cluster, MI weight {c['mi_weight']:g}, critic {c['critic']}: "
              f"round {c['round_s_median']:.3f}s "
              f"(training {c['train_s_median']:.3f}s), broadcast {c['broadcast_bytes']:,} B, "
              f"update {c['update_bytes']:,} B per worker")
    elapsed = time.perf_counter() - t0
    write_results(args, main_tables, sweep, cluster, elapsed)
    print(f"\nwrote {RESULTS / stems(args)[0]}.md ({elapsed / 60:.1f} min)")


if __name__ == "__main__":
    main()
