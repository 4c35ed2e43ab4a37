"""Baselines only a simulated cluster allows: the master can read every worker's shard.

At the end of a ``fedctl run`` on one shared dataset (``baselines: true``), the master trains,
for comparison with the federated model, a model on each worker's data alone (local-only) and
one on all the workers' training data pooled (centralized), with the same hyperparameters and
the same budget of epochs, and scores them on each worker's test split and on all of them
together. In a real deployment nobody can see all the data, and :func:`simulation_baselines`
returns None.

One function per family; a plug-in family supplies its own by overriding
:meth:`master.families.base.ServerFamily.simulation_baselines`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from common.data.shards import LocalData, local_data, sentence_features, simulated, worker_seed
from common.data.text import bow_matrix
from common.eval.topics import lda_topic_scores, neural_topic_scores
from common.models.fstc import CENTERS, score_clustering
from common.models.iftm import topic_normalize
from common.models.lda_mh import corpus_from_texts
from common.models.nmf import heldout_scores
from common.models.numerics import flush_denormals
from master.families.base import ServerFamily
from master.families.fstc import FSTCServer
from master.families.lda import LDAServer
from master.families.mlp import MLPServer
from master.families.nmf import NMFServer
from master.families.ntm import ProdLDAServer

Baselines = dict[str, Any]


def simulation_baselines(family: ServerFamily) -> Baselines | None:
    """``centralized``: worker id -> scores on that worker's test split of a model trained on
    all workers' training data pooled; ``pooled``: model name -> scores on all the workers'
    test splits together, for each local-only model, the federated model and the centralized
    one. None where the family has no baselines or the cluster is not simulated."""
    flush_denormals()  # as the workers train (common/models/numerics.py)
    for cls, make in _BASELINES.items():
        if isinstance(family, cls):
            return make(family)
    return family.simulation_baselines()


def simulation_mismatch(cfg: Any, reports: Mapping[str, Any]) -> str | None:
    """Why the simulation's split of ``data.path`` is not what this run's workers trained on
    (``reports``: the registered workers' final reports), or None: a configured worker that
    never joined would have its documents pooled, and one started with ``--data`` of its own
    reports other sizes than its share's. Baselines from the split would then compare the
    federated model with data it never saw."""
    absent = sorted(w.name for w in cfg.workers if w.name not in reports)
    if absent:
        return (f"{', '.join(absent)} never joined, and the pooled data would hold "
                f"{'its' if len(absent) == 1 else 'their'} share")
    for w in cfg.workers:
        report = reports[w.name]
        if not report:
            continue
        shard = local_data(cfg, w.name)
        sizes = (report.get("n_train"), report.get("n_test"))
        if sizes != (shard.n_train, len(shard.test_index)):
            return (f"{w.name} trained on {sizes[0]} documents and tested on {sizes[1]}, not "
                    f"its share of data.path ({shard.n_train} and {len(shard.test_index)}): "
                    f"data of its own (`fedctl worker --data`)")
    return None


def _rows(y: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    return None if y is None else y[rows]


def _shards(cfg: Any) -> tuple[dict[str, LocalData], np.ndarray, np.ndarray]:
    """Every worker's shard, and all their training and test rows."""
    shards = {w.name: local_data(cfg, w.name) for w in cfg.workers}
    train = np.concatenate([s.train_index for s in shards.values()])
    test = np.concatenate([s.test_index for s in shards.values()])
    return shards, train, test


def _pooled_bow(family: ServerFamily
                ) -> tuple[dict[str, LocalData], np.ndarray, np.ndarray, LocalData, Any] | None:
    """For a family over an agreed vocabulary: every worker's shard, all their training and
    test rows, the first shard (its dataset is everyone's), and the dataset's counts over the
    vocabulary. None outside a simulation, or before the vocabulary was agreed."""
    if not simulated(family.cfg) or not family.setup_info_:
        return None
    shards, train, test = _shards(family.cfg)
    first = next(iter(shards.values()))
    return (shards, train, test, first,
            bow_matrix(first.dataset.texts, family.setup_info_["vocabulary"]))


def mlp_baselines(family: MLPServer) -> Baselines | None:
    """The classifier trained on each worker's embeddings alone and on all of them pooled."""
    if not simulated(family.cfg):
        return None
    cfg, p = family.cfg, family.params
    shards, train, test = _shards(cfg)
    first = next(iter(shards.values()))
    # The workers' classes and their order come from the pre-training exchange (a member may
    # have brought classes the data here does not hold); map into them.
    classes = family.setup_info_["classes"]
    X, y, n_classes = sentence_features(cfg, first.dataset), first.y, len(classes)
    to_global = np.array([classes.index(c) for c in first.classes])
    y = to_global[y]
    epochs = cfg.rounds * p.local_epochs
    central = p.classifier(X.shape[1], n_classes, random_state=cfg.seed)
    central.fit(X[train], y[train], epochs=epochs)
    federated = p.classifier(X.shape[1], n_classes)
    federated.set_arrays(family.global_.arrays)
    pooled = {}
    for name, s in shards.items():
        local = p.classifier(X.shape[1], n_classes, random_state=worker_seed(cfg, name))
        local.fit(X[s.train_index], y[s.train_index], epochs=epochs)
        pooled[f"local-only {name}"] = local.score(X[test], y[test])
    pooled["federated"] = federated.score(X[test], y[test])
    pooled["centralized"] = central.score(X[test], y[test])
    return {"centralized": {name: central.score(X[s.test_index], y[s.test_index])
                            for name, s in shards.items()},
            "pooled": pooled}


def nmf_baselines(family: NMFServer) -> Baselines | None:
    """NMF by SGD on each worker's bag of words alone and on all of them pooled, scored by the
    SVM on the topic weights that ``transform`` solves."""
    pooled_bow = _pooled_bow(family)
    if pooled_bow is None:
        return None
    shards, train, test, first, X = pooled_bow
    cfg, p = family.cfg, family.params
    y = np.asarray(first.y)
    epochs = cfg.rounds * p.local_epochs
    central = p.model(random_state=cfg.seed).fit(X[train], epochs=epochs)
    federated = p.model()
    federated.set_arrays(family.global_.arrays)

    def scores(model: Any, tr: np.ndarray, te: np.ndarray) -> dict[str, float]:
        return heldout_scores(model, X[tr], y[tr], X[te], y[te], cfg.seed)

    pooled = {}
    for name, s in shards.items():
        local = p.model(random_state=worker_seed(cfg, name))
        local.fit(X[s.train_index], epochs=epochs)
        pooled[f"local-only {name}"] = scores(local, train, test)
    pooled["federated"] = scores(federated, train, test)
    pooled["centralized"] = scores(central, train, test)
    return {"centralized": {name: scores(central, s.train_index, s.test_index)
                            for name, s in shards.items()},
            "pooled": pooled}


def fstc_baselines(family: FSTCServer) -> Baselines | None:
    """Local-only, federated and centralized clusterings scored on each worker's documents
    and on all of them (frozen encoder only: fine-tuning three more models is a GPU job)."""
    if not simulated(family.cfg) or family.params.encoder != "frozen":
        return None
    cfg, p, k = family.cfg, family.params, family.n_clusters
    shards, _, _ = _shards(cfg)
    first = next(iter(shards.values()))
    X = sentence_features(cfg, first.dataset)
    y = first.y if first.labelled else None
    rows = {n: np.sort(np.concatenate([s.train_index, s.test_index]))
            for n, s in shards.items()}
    everything = np.concatenate(list(rows.values()))
    budget = cfg.rounds * p.iterations
    central = p.clusterer(k, random_state=cfg.seed, iterations=budget).fit(X[everything])
    if "head.weight" in family.global_.arrays:
        federated = p.clusterer(k).set_arrays(family.global_.arrays).predict(X)
    else:  # no final model came back: the global centres' clustering
        C = family.global_.arrays[CENTERS]
        federated = ((X[:, None, :] - C[None]) ** 2).sum(-1).argmin(axis=1)
    central_pred = central.predict(X)
    pooled = {}
    for name, r in rows.items():
        local = p.clusterer(k, random_state=worker_seed(cfg, name), iterations=budget)
        local.fit(X[r])
        pooled[f"local-only {name}"] = local.score(X[everything], _rows(y, everything))
    pooled["federated"] = score_clustering(_rows(y, everything), federated[everything])
    pooled["centralized"] = score_clustering(_rows(y, everything), central_pred[everything])
    return {"centralized": {n: score_clustering(_rows(y, r), central_pred[r])
                            for n, r in rows.items()},
            "pooled": pooled}


def ntm_baselines(family: ProdLDAServer) -> Baselines | None:
    """ProdLDA / CombinedTM trained on all the workers' training documents pooled, with the
    federation's budget: in ``mode: sync`` as many Adam steps as it took, each on a batch the
    size of its union batch; in ``mode: fedavg``, ``rounds x local_epochs`` epochs. Scored as
    the workers score the federated model (:func:`common.eval.topics.neural_topic_scores`,
    each worker's own documents the coherence reference). The local-only models are the
    workers' own (the per-worker table); training them again here would double the run."""
    pooled_bow = _pooled_bow(family)
    if pooled_bow is None:
        return None
    shards, train, test, first, X = pooled_bow
    cfg, p = family.cfg, family.params
    vocab = family.setup_info_["vocabulary"]
    texts = first.dataset.texts
    y = np.asarray(first.y) if first.labelled else None
    ctx = (sentence_features(cfg, first.dataset) if family.contextual_size else None)

    def rows(a: np.ndarray | None, r: np.ndarray) -> np.ndarray | None:
        return None if a is None else a[r]

    if p.mode == "sync":
        union = replace(p, batch_size=p.batch_size * len(shards))
        central = union.model(family.contextual_size, cfg.seed).initialize(len(vocab))
        central.fit(X[train], rows(ctx, train), steps=family.steps_, doc_ids=train)
    else:
        central = p.model(family.contextual_size, cfg.seed).initialize(len(vocab))
        central.fit(X[train], rows(ctx, train), epochs=cfg.rounds * p.local_epochs,
                    doc_ids=train)
    federated = p.model(family.contextual_size, cfg.seed).initialize(len(vocab))
    federated.set_arrays(family.global_.arrays)

    def scores(model: Any, tr: np.ndarray, te: np.ndarray) -> dict[str, float]:
        return neural_topic_scores(model, vocab, X[tr], rows(ctx, tr), rows(y, tr), X[te],
                                   rows(ctx, te), rows(y, te), cfg.seed,
                                   [texts[i] for i in np.concatenate([tr, te])])

    return {"centralized": {name: scores(central, s.train_index, s.test_index)
                            for name, s in shards.items()},
            "pooled": {"federated": scores(federated, train, test),
                       "centralized": scores(central, train, test)}}


def lda_baselines(family: LDAServer) -> Baselines | None:
    """The same sampler, ``n_topics`` topics and total sweeps (rounds x sweeps) on all the
    parties' training documents pooled, without the parties' Laplace noise (nothing of it
    leaves anyone), scored as each party scores the federated model: on its test split, its
    own documents the coherence reference. The local-only models are the parties' own (the
    per-worker table); the federated model is composed per party, so there is no one model
    to score on the pooled test splits."""
    if not simulated(family.cfg) or not family.setup_info_:
        return None
    cfg, p = family.cfg, replace(family.params, epsilon=0.0)
    shards, _, _ = _shards(cfg)
    vocab = list(family.setup_info_["vocabulary"])
    pooled = [t for s in shards.values() for t in s.train_texts]
    model = p.model(p.n_topics, family.sentence, cfg.seed, n_iter=cfg.rounds * p.sweeps,
                    warm_start=False).fit(corpus_from_texts(pooled, vocab))
    topics = topic_normalize(model.components_, p.beta)
    return {"centralized": {
        name: lda_topic_scores(topics, corpus_from_texts(s.test_texts, vocab),
                               bow_matrix(s.train_texts, vocab), vocab, p.alpha, p.eval_iter,
                               cfg.seed, s.train_texts)
        for name, s in shards.items()}, "pooled": None}


_BASELINES: dict[type, Callable[[Any], Baselines | None]] = {
    MLPServer: mlp_baselines, NMFServer: nmf_baselines, FSTCServer: fstc_baselines,
    ProdLDAServer: ntm_baselines, LDAServer: lda_baselines}
