"""Federated neural topic models (ProdLDA, CombinedTM): the model, the synthetic LDA corpus and
its scores, and real clusters (``fedctl run``: master and workers as separate processes over TCP
loopback) in both training modes.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from common.aggregate import weighted_average
from common.config import ConfigError, build_params, load_config, parse_config
from common.data.shards import local_data, worker_seed
from common.data.text import bow_matrix
from common.models.ntm import (
    NeuralTopicModel,
    NTMParams,
    batch_schedule,
    simulate_sync,
    simulate_union,
)
from fedctl.datasets.synthetic_lda import (
    document_similarity_score,
    make_federated_lda,
    topic_similarity_score,
)
from tests.conftest import ROOT, MakeConfig, child_env, events, fedctl_command, kill_tree


def _run(cfg: Path, cache: Path, timeout: float = 150) -> None:
    proc = subprocess.Popen(fedctl_command("run", "--config", str(cfg)), cwd=ROOT,
                            env=child_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, f"fedctl run failed:\n{stderr[-3000:]}"


def _final(out: Path) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(out / "model.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    return arrays, json.loads((out / "model.json").read_text())


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the machine's few cores are shared, and more threads only contend."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


def test_params_are_validated() -> None:
    assert build_params(NTMParams, {"mode": "fedavg", "n_topics": 5}, "m").n_topics == 5
    with pytest.raises(ConfigError, match="mode"):
        build_params(NTMParams, {"mode": "async"}, "m")
    with pytest.raises(ConfigError, match="dropout"):
        build_params(NTMParams, {"dropout": 1.5}, "m")
    with pytest.raises(ConfigError, match="unknown field"):
        build_params(NTMParams, {"topics": 5}, "m")


def test_a_blown_up_models_perplexity_is_inf_not_an_error() -> None:
    """DP-FedAvg's noise (clip 1, sigma 0.5, three honest workers) or a hostile member's
    update blew a ProdLDA model up: exp() of its bound overflowed, and every worker scoring
    it stopped with OverflowError."""
    corpus = make_federated_lda(n_nodes=1, vocab_size=60, n_topics=4, n_shared=4,
                                docs_per_node=40, random_state=1)
    model = NeuralTopicModel(n_topics=4, random_state=3).initialize(60)
    with torch.no_grad():
        model.net_.beta.mul_(1e4)  # the bound a word: ~2,300 nats, past exp()'s 709
    assert model.perplexity(corpus.X[0]) == math.inf
    # The final report leaves it out (the master refuses a report holding one, and the worker
    # failed at its job's end).
    from worker.client import _reportable
    assert _reportable({"perplexity": math.inf, "c_v": 0.4, "npmi_doc": math.nan},
                       "federated") == {"c_v": 0.4}
    # Finite but past MAX_METRIC (beta x 200: 2.7e20), or outside a score's range: refused too.
    assert _reportable({"perplexity": 2.7e20, "c_v": 1.5, "diversity": 0.5}, "federated"
                       ) == {"diversity": 0.5}


@pytest.mark.parametrize("contextual_size", [0, 8])
def test_model_api_fit_transform_topics_save_load(tmp_path: Path, contextual_size: int) -> None:
    corpus = make_federated_lda(n_nodes=1, vocab_size=60, n_topics=4, n_shared=4,
                                docs_per_node=120, eta=0.05, alpha=0.3, random_state=1)
    X = corpus.X[0]
    # An informative "embedding": a random projection of the word frequencies.
    freqs = X.toarray() / X.sum(1).A
    ctx = (freqs @ np.random.default_rng(0).normal(size=(60, contextual_size)) * 10
           if contextual_size else None)
    # A larger step than the reference's 2e-3 so that a few hundred steps suffice.
    model = NeuralTopicModel(n_topics=4, contextual_size=contextual_size, lr=0.02, beta1=0.9,
                             batch_size=32, random_state=3)
    before = model.initialize(60).perplexity(X, ctx)
    assert model.fit(X, ctx, epochs=60) is model
    model.vocabulary_ = corpus.vocabulary
    assert model.perplexity(X, ctx) < 0.9 * before  # training lowers the bound
    theta = model.transform(X, ctx)
    assert theta.shape == (120, 4) and np.allclose(theta.sum(1), 1)
    assert model.get_topic_word_matrix().shape == (4, 60)
    dist = model.get_topic_word_distribution()
    assert np.allclose(dist.sum(1), 1)
    topics = model.get_topics(5)
    assert len(topics) == 4 and all(len(t) == 5 for t in topics)
    model.save(tmp_path / "ntm.npz")
    again = NeuralTopicModel.load(tmp_path / "ntm.npz")
    assert again.get_topics(5) == topics
    np.testing.assert_allclose(again.transform(X, ctx), theta, atol=1e-6)


def test_batch_schedule_covers_every_row_each_epoch() -> None:
    it = batch_schedule(10, 4, random_state=0)
    epoch = np.concatenate([next(it) for _ in range(3)])
    assert sorted(epoch.tolist()) == list(range(10))
    again = batch_schedule(10, 4, random_state=0)
    assert np.array_equal(next(again), epoch[:4])


def test_sync_simulation_equals_union_batches_without_randomness() -> None:
    c = make_federated_lda(n_nodes=3, vocab_size=200, n_topics=6, n_shared=3,
                           docs_per_node=60, eta=0.05, random_state=0)
    shards = [(X, None) for X in c.X]
    ids = [np.arange(60) + 60 * i for i in range(3)]
    exact = NTMParams(n_topics=6, dropout=0.0, batch_stats=False, doc_noise=True,
                      batch_size=16)
    fed = simulate_sync(shards, exact, 50, doc_ids=ids).get_arrays()
    central = simulate_union(shards, exact, 50, doc_ids=ids).get_arrays()
    for name in fed:
        np.testing.assert_allclose(fed[name], central[name], rtol=0, atol=1e-5, err_msg=name)
    # With the reference's randomness (dropout, batch statistics, shared noise) they differ.
    noisy = NTMParams(n_topics=6, batch_size=16)
    a = simulate_sync(shards, noisy, 5).get_arrays()["beta"]
    b = simulate_union(shards, noisy, 5).get_arrays()["beta"]
    assert np.abs(a - b).max() > 1e-4


#: Directions batch norm leaves the loss flat in (a bias just before a batch norm, and the
#: running mean that tracks it): their gradients are rounding noise, which Adam scales up to
#: steps of the learning rate's size in a federated and a centralized run alike.
BN_FLAT = {"f_mu.bias", "f_sigma.bias", "bn_mu.running_mean", "bn_sigma.running_mean"}


def _assert_same_weights(fed: dict[str, np.ndarray], ref: dict[str, np.ndarray],
                         atol: float = 1e-5) -> None:
    assert set(fed) == set(ref)
    for name in sorted(set(ref) - BN_FLAT):
        # The learned prior mean is pulled to the batch-normalized posterior means' average,
        # 0 up to rounding: it hovers within a few learning rates of 0 in either run.
        tol = 5e-3 if name == "prior_mean" else atol
        np.testing.assert_allclose(fed[name], ref[name], rtol=1e-5, atol=tol, err_msg=name)


def test_sync_batch_norm_simulation_equals_union_batches_with_dropout_and_statistics() -> None:
    # Label-skewed nodes (each its own private topics): per-node batch norm would normalize
    # each node's batch by its own statistics; synchronized, by the union's, as centralized.
    # Dropout (0.2) and noise on, drawn per document, so both runs draw the same.
    c = make_federated_lda(n_nodes=3, vocab_size=200, n_topics=6, n_shared=0,
                           docs_per_node=60, eta=0.05, random_state=0)
    shards = [(X, None) for X in c.X]
    ids = [np.arange(60) + 60 * i for i in range(3)]
    exact = NTMParams(n_topics=6, doc_noise=True, batch_size=16)
    assert exact.batch_stats and exact.synced_batch_norm and exact.rounds_per_step == 5
    assert exact.dropout > 0
    central = simulate_union(shards, exact, 50, doc_ids=ids).get_arrays()
    _assert_same_weights(simulate_sync(shards, exact, 50, doc_ids=ids).get_arrays(), central)
    # Each node normalizing its own batch trains another model.
    local = NTMParams(n_topics=6, doc_noise=True, batch_size=16, sync_batch_norm=False)
    apart = simulate_sync(shards, local, 50, doc_ids=ids).get_arrays()
    assert np.abs(apart["beta"] - central["beta"]).max() > 1e-2


def test_union_moments_and_sums_merge_exactly() -> None:
    from common.models.ntm_sync_bn import merge_moments, sum_uploads

    rng = np.random.default_rng(0)
    parts = [rng.normal(3.0 * i, 1.0 + i, size=(n, 7)) for i, n in enumerate([5, 11, 2])]
    ups = [{"mean": x.mean(0), "m2": ((x - x.mean(0)) ** 2).sum(0)} for x in parts]
    merged = merge_moments(ups, [len(x) for x in parts])
    union = np.concatenate(parts)
    np.testing.assert_allclose(merged["mean"], union.mean(0), rtol=1e-12)
    np.testing.assert_allclose(merged["var"], union.var(0), rtol=1e-12)  # biased, as BN uses
    assert float(merged["n"]) == 18
    sums = sum_uploads([{"sum_g": x.sum(0)} for x in parts])
    np.testing.assert_allclose(sums["sum_g"], union.sum(0), rtol=1e-12)


def test_merged_running_stats_are_those_of_the_union_batch() -> None:
    # Label-skewed nodes: each node's batch-norm inputs have their own mean and scale.
    rng = np.random.default_rng(0)
    glob = NeuralTopicModel(n_topics=5, random_state=0).initialize(30)
    for _ in range(3):  # running statistics away from their (0, 1) start
        glob.set_arrays(_bn_step(glob, rng.normal(1.0, 2.0, size=(8, 30))))
    sizes = [16, 20, 7]
    inputs = [rng.normal(loc=3.0 * i, scale=1.0 + i, size=(n, 30)) for i, n in enumerate(sizes)]
    uploads = [_bn_step(glob, x) for x in inputs]
    union = _bn_step(glob, np.concatenate(inputs))
    merged = glob.merge_running_stats(uploads, sizes)
    assert sorted(merged) == sorted(glob.buffer_names())
    for name, value in merged.items():
        np.testing.assert_allclose(value, union[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # The plain average of the uploads misses the spread of the nodes' means (about 4.4
    # here, a tenth of it, the momentum, in one step).
    plain = weighted_average(uploads, sizes)
    short = union["bn_beta.running_var"] - plain["bn_beta.running_var"]
    assert (short > 0).all() and short.mean() > 0.3
    with pytest.raises(ValueError, match="batch size"):
        glob.merge_running_stats(uploads, [16, 20, 1])


def _bn_step(model: NeuralTopicModel, x: np.ndarray) -> dict[str, np.ndarray]:
    """The running statistics of ``model``'s batch-norm layers after one training batch
    ``x`` (the first columns of it for the narrower layers), on a copy of the model."""
    import torch

    node = NeuralTopicModel(n_topics=model.n_topics).set_arrays(model.get_arrays())
    node.net_.train()
    with torch.no_grad():
        for bn in (node.net_.bn_mu, node.net_.bn_sigma, node.net_.bn_beta):
            bn(torch.as_tensor(x[:, :bn.num_features], dtype=torch.float32))
    arrays = node.get_arrays()
    return {n: arrays[n] for n in node.buffer_names()}


# --------------------------------------------------------------------------------------------
# synthetic corpus, DSS and TSS
# --------------------------------------------------------------------------------------------


def test_synthetic_corpus_shapes_and_scores() -> None:
    c = make_federated_lda(n_nodes=3, vocab_size=100, n_topics=9, n_shared=3,
                           docs_per_node=40, eta=0.1, random_state=0)
    assert len(c.X) == 3 and all(X.shape == (40, 100) for X in c.X)
    lengths = np.concatenate([np.asarray(X.sum(1)).ravel() for X in c.X])
    assert lengths.min() >= 150 and lengths.max() <= 250
    for node, (theta, idx) in enumerate(zip(c.theta, c.node_topics, strict=True)):
        assert list(idx[:3]) == [0, 1, 2] and len(idx) == 5  # 3 shared + (9 - 3) / 3 private
        others = np.setdiff1d(np.arange(9), idx)
        assert np.all(theta[:, others] == 0) and np.allclose(theta.sum(1), 1), node
    assert np.allclose(c.beta.sum(1), 1)
    # The truth scores perfectly; a uniform guess does not.
    assert document_similarity_score(c.theta[0], c.theta[0]) == pytest.approx(0)
    assert document_similarity_score(c.theta[0], np.ones((40, 9))) > 1
    assert topic_similarity_score(c.beta, c.beta) == pytest.approx(9)
    assert topic_similarity_score(c.beta, np.ones((9, 100))) < 5
    with pytest.raises(ValueError, match="divisible"):
        make_federated_lda(n_nodes=4, n_topics=9, n_shared=3)


def test_federated_beats_non_collaborative_for_few_shared_topics() -> None:
    # 3 nodes, 30 topics of which 3 shared: alone, a node sees 12 of them.
    c = make_federated_lda(n_nodes=3, vocab_size=400, n_topics=30, n_shared=3,
                           docs_per_node=150, eta=0.01, random_state=0)
    p = NTMParams(n_topics=30, lr=0.01, beta1=0.9)  # a larger step: 200 steps suffice
    steps = 200
    fed = simulate_sync([(X, None) for X in c.X], p, steps, random_state=0)
    local = [p.model(random_state=1 + i).fit(X, steps=steps) for i, X in enumerate(c.X)]
    dss_fed = np.mean([document_similarity_score(th, fed.transform(X))
                       for X, th in zip(c.X, c.theta, strict=True)])
    dss_local = np.mean([document_similarity_score(th, m.transform(X))
                         for X, th, m in zip(c.X, c.theta, local, strict=True)])
    tss_fed = topic_similarity_score(c.beta, fed.get_topic_word_distribution())
    tss_local = np.mean([topic_similarity_score(c.beta, m.get_topic_word_distribution())
                         for m in local])
    assert dss_fed < dss_local, (dss_fed, dss_local)
    assert tss_fed > tss_local, (tss_fed, tss_local)


# --------------------------------------------------------------------------------------------
# real clusters
# --------------------------------------------------------------------------------------------

EXACT = {"family": "prodlda", "mode": "sync", "n_topics": 8, "vocab_size": 300,
         "dropout": 0.0, "doc_noise": True, "batch_size": 16}


@pytest.mark.slow
@pytest.mark.parametrize("batch_norm", [
    # One round a step; batch norm on fixed statistics, so no document depends on another.
    {"batch_stats": False},
    # Five rounds a step; batch norm over the union of the three workers' batches, dropout on
    # (masks drawn per document). In float64: dividing by the batch's scale makes float32
    # rounding grow past 1e-5 within 30 steps.
    {"batch_stats": True, "sync_batch_norm": True, "dropout": 0.2, "dtype": "float64"},
    # The same under secure aggregation: the master learns only each phase's sums
    # (common/models/ntm_secure.py), in the 64-bit ring.
    {"batch_stats": True, "sync_batch_norm": True, "dropout": 0.2, "dtype": "float64",
     "secure": True},
], ids=["fixed-statistics", "synchronized-batch-norm", "secure-synchronized-batch-norm"])
def test_sync_cluster_equals_centralized_training_on_the_union_batches(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path,
        batch_norm: dict) -> None:
    batch_norm = dict(batch_norm)
    secure = batch_norm.pop("secure", False)
    steps = (30 if not batch_norm["batch_stats"] else 20) // (2 if secure else 1)
    per_step = NTMParams(**{k: v for k, v in {**EXACT, **batch_norm}.items()
                            if k != "family"}).rounds_per_step
    cfg_path = make_config(tmp_path, workers=3, rounds=steps * per_step,
                           model={**EXACT, **batch_norm},
                           **({"privacy": {"secure_aggregation": {}}} if secure else {}))
    _run(cfg_path, embed_cache)
    out = tmp_path / "out"
    fed, meta = _final(out)
    rounds = events(out, "round")
    assert [e["round"] for e in rounds] == list(range(1, steps * per_step + 1))
    assert all(e["n_updates"] == 3 for e in rounds)
    assert meta["meta"]["step"] == steps
    if secure:  # every round was a secure sum of the three
        sums = events(out, "secagg")
        assert [e["round"] for e in sums] == list(range(1, steps * per_step + 1))
        assert all(len(e["survivors"]) == 3 and e["error_bound"] < 1e-6 for e in sums)

    # Centralized: one model from the same seed, one Adam step per round on the union of the
    # batches the three workers drew (each in its own seeded order), same per-document noise.
    cfg = load_config(cfg_path)
    vocab = meta["setup"]["vocabulary"]
    params = build_params(NTMParams, cfg.family_params, "model")
    central = params.model(0, cfg.seed).initialize(len(vocab))
    shards = [local_data(cfg, w.name) for w in cfg.workers]
    texts = shards[0].dataset.texts
    X_all = bow_matrix(texts, vocab)
    orders = [(s.train_index, batch_schedule(s.n_train, params.batch_size,
                                             worker_seed(cfg, w.name)))
              for s, w in zip(shards, cfg.workers, strict=True)]
    for t in range(steps):
        ids = np.concatenate([idx[next(order)] for idx, order in orders])
        loss = central.batch_loss(X_all, None, ids, doc_ids=ids, step=t)
        central.optimizer_.zero_grad(set_to_none=True)
        loss.backward()
        central.optimizer_.step()
    ref = central.get_arrays()
    assert set(fed) == set(ref)
    moved = max(float(np.abs(ref[n] - central_init).max()) for n, central_init in
                params.model(0, cfg.seed).initialize(len(vocab)).get_arrays().items())
    assert moved > 1e-2  # the steps did change the weights
    _assert_same_weights(fed, ref)


@pytest.mark.slow
def test_combinedtm_fedavg_cluster_reports_topic_scores(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path) -> None:
    cfg_path = make_config(tmp_path, workers=2, rounds=3, baselines=True,
                           model={"family": "combinedtm", "mode": "fedavg", "n_topics": 6,
                                  "vocab_size": 400, "local_epochs": 2})
    _run(cfg_path, embed_cache)
    out = tmp_path / "out"
    arrays, meta = _final(out)
    vocab = meta["setup"]["vocabulary"]
    assert arrays["beta"].shape == (6, len(vocab)) and len(vocab) <= 400
    assert arrays["hidden.0.weight"].shape == (100, len(vocab) + 384)  # BoW + embedding
    wr = events(out, "worker_round")
    assert {e["round"] for e in wr} == {1, 2, 3}
    ppl = {r: np.mean([e["perplexity"] for e in wr if e["round"] == r]) for r in (1, 3)}
    assert ppl[3] < ppl[1], ppl  # the global model gets better on held-out documents
    # Every round: the document NPMI; gensim's window coherences cost seconds, so they are
    # computed for the closing report only.
    assert all("npmi" not in e and -1 <= e["npmi_doc"] <= 1 and "c_v" not in e for e in wr)
    summary = json.loads((out / "summary.json").read_text())
    for row in summary["comparison"]:
        assert 0 <= row["federated_macro_f1"] <= 1 and 0 <= row["local_only_macro_f1"] <= 1
        assert all(row[f"{c}_{k}"] is not None for c in ("federated", "local_only")
                   for k in ("npmi_doc", "c_npmi", "c_v"))
    assert "No labels" not in (out / "comparison.md").read_text()  # every worker had labels
    model = NeuralTopicModel(n_topics=6, contextual_size=384).set_arrays(arrays)
    X = sp.random(4, len(vocab), density=0.1, format="csr", random_state=0)
    assert model.transform(X, np.zeros((4, 384))).shape == (4, 6)


def test_master_steps_adam_on_weighted_gradients_and_stops_on_tol() -> None:
    from master.families.ntm import ProdLDAServer
    from master.strategies import ClientResult, make_strategy

    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 100,
                        "model": {"family": "prodlda", "n_topics": 3, "vocab_size": 50,
                                  "min_df": 1, "tol": 1e-3, "eval_every": 10,
                                  "beta1": 0.5, "sync_batch_norm": False}}, "<test>")
    server = ProdLDAServer(cfg, make_strategy("fedavg"))
    regs = {w: {"vocabulary": {f"word{j}": [3, 2] for j in range(i, i + 30)}, "n_docs": 5}
            for i, w in enumerate(["w1", "w2"])}
    first = server.setup(regs)
    assert len(server.setup_info_["vocabulary"]) == 31 and first.meta["evaluate"]
    # Two workers' "gradients": the step must follow their batch-size-weighted mean.
    model = NTMParams(n_topics=3, beta1=0.5).model(0, cfg.seed).initialize(31)
    names = model.param_names()
    g1 = {n: np.ones_like(a) if n in names else a for n, a in first.arrays.items()}
    g2 = {n: -np.ones_like(a) if n in names else a for n, a in first.arrays.items()}
    with pytest.raises(Exception, match="NaN"):
        server.check_update({**g1, "beta": np.full_like(g1["beta"], np.nan)})
    server.check_update(g1)
    new = server.aggregate(1, [ClientResult("w1", g1, 30), ClientResult("w2", g2, 10)])
    model.apply_gradients({n: 0.5 * np.ones_like(first.arrays[n]) for n in names})
    np.testing.assert_allclose(new.arrays["beta"], model.get_arrays()["beta"], atol=1e-6)
    assert not new.meta["evaluate"] and not server.finished()
    # Zero gradients from here on: Adam's momentum decays, the steps shrink below tol.
    zero = {n: np.zeros_like(a) if n in names else a for n, a in first.arrays.items()}
    for r in range(2, 100):
        server.aggregate(r, [ClientResult("w1", zero, 4)])
        if server.finished():
            break
    assert 2 < r < 100 and server.changes_[-1] < 1e-3 <= server.changes_[0]
    assert server.global_.meta["evaluate"]  # the last step is scored
    meta, arrays = server.state()
    kept = {n: a.copy() for n, a in arrays.items()}
    again = ProdLDAServer(cfg, make_strategy("fedavg"))
    again.setup_info_, again.global_ = server.setup_info_, server.global_
    again.load_state(meta, arrays)
    assert again.changes_ == server.changes_
    # The checkpoint is written on another thread after later steps: what state() gave must
    # not move with them (Adam updates its moments in place).
    server.aggregate(r + 1, [ClientResult("w1", g1, 4)])
    for name, array in kept.items():
        assert np.array_equal(arrays[name], array), name


def _regs() -> dict:
    return {w: {"vocabulary": {f"word{j}": [3, 2] for j in range(i, i + 30)}, "n_docs": 5}
            for i, w in enumerate(["w1", "w2"])}


def test_master_runs_synchronized_steps_and_redoes_one_a_worker_leaves() -> None:
    from common.models.ntm_sync_bn import ABSTAIN, SyncBNStep
    from common.net.wire import ProtocolError
    from master.families.ntm import ProdLDAServer
    from master.strategies import ClientResult, make_strategy

    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 13,
                        "model": {"family": "prodlda", "n_topics": 3, "vocab_size": 50,
                                  "min_df": 1, "batch_size": 8}}, "<test>")
    server = ProdLDAServer(cfg, make_strategy("fedavg"))
    first = server.setup(_regs())
    assert first.meta == {"step": 0, "phase": 0, "evaluate": True}
    assert server.participants() is None  # phase 0: the master samples
    rng = np.random.default_rng(0)
    data = {w: sp.csr_matrix(rng.poisson(0.5, size=(8, 31)).astype(float)) for w in ("w1", "w2")}
    params = build_params(NTMParams, cfg.family_params, "m")
    nodes = {w: params.model(0, 1 + i).initialize(31) for i, w in enumerate(data)}

    def start(payload):
        steps = {}
        for w, node in nodes.items():
            node.set_arrays(payload.arrays)
            steps[w] = SyncBNStep(node, data[w], None, np.arange(8), None, payload.meta["step"])
        return steps

    def phase(steps, payload, who=("w1", "w2"), round_=1):
        ph = payload.meta["phase"]
        ups = [ClientResult(w, steps[w].upload(ph, payload.arrays), 8) for w in who]
        for r in ups:
            server.check_update(r.arrays)
        return server.aggregate(round_, ups)

    # A whole step: five rounds, the same two workers throughout, then new weights.
    steps, payload = start(first), first
    for ph in range(1, 5):
        payload = phase(steps, payload)
        assert payload.meta == {"step": 0, "phase": ph, "evaluate": False}
        assert server.participants() == ["w1", "w2"]
        with pytest.raises(ProtocolError, match="missing"):
            server.check_update({"beta": np.zeros((3, 31), np.float32)})  # not this phase's
    payload = phase(steps, payload)
    assert payload.meta["phase"] == 0 and payload.meta["step"] == 1 and server.steps_ == 1
    assert np.abs(payload.arrays["beta"] - first.arrays["beta"]).max() > 1e-4
    assert server.participants() is None

    # w2 drops out in phase 1 (the round closed without it): the step is redone from the
    # same weights; the same for a worker that abstains (it lost the step's state).
    for leave in ("missing", "abstains"):
        before, steps = payload, start(payload)
        payload = phase(steps, payload)
        if leave == "missing":
            payload = phase(steps, payload, who=("w1",))
        else:
            ups = [ClientResult("w1", steps["w1"].upload(1, payload.arrays), 8),
                   ClientResult("w2", {ABSTAIN: np.zeros(0)}, 1)]
            server.check_update(ups[1].arrays)
            payload = server.aggregate(2, ups)
        assert payload.meta == before.meta and server.steps_ == 1
        # The redone step builds on the workers' state at its first start (the step began in
        # round 2, after the first step's last phase closed round 1 here), whatever round redoes it.
        assert server.base_round(9) == 1 and server.resume_base(9) == 1
        for name, value in before.arrays.items():
            np.testing.assert_array_equal(payload.arrays[name], value, err_msg=name)

    # A checkpoint taken mid-step keeps the weights; the resumed master redoes that step.
    steps = start(payload)
    mid = phase(steps, payload)
    assert mid.meta["phase"] == 1
    meta, arrays = server.state()
    again = ProdLDAServer(cfg, make_strategy("fedavg"))
    again.setup_info_, again.global_ = server.setup_info_, mid
    again.load_state(meta, arrays)
    assert again.global_.meta == payload.meta and again.steps_ == 1
    np.testing.assert_array_equal(again.global_.arrays["beta"], payload.arrays["beta"])

    # The budget is in steps (13 // 5 = 2): round 13 ends nothing; the rounds' hard cap (2 x 13)
    # ends a step midway, and the final payload is the weights, not statistics.
    assert not server.budget_spent(13) and server.total_steps == 2
    final = phase(steps, mid, round_=26)
    assert final.meta["phase"] == 0 and set(final.arrays) == set(payload.arrays)


def test_master_redoes_a_secure_step_a_worker_drops_out_of_or_abstains_in() -> None:
    # Under secure aggregation the master sees one sum a phase, who is in it and who of them
    # abstained: a phase summed without one of the step's workers, or with an abstainer in
    # it, is redone from the step's start, as in plain rounds.
    from common.models import ntm_secure
    from common.models.ntm_sync_bn import ABSTAIN, SyncBNStep
    from master.families.ntm import ProdLDAServer
    from master.strategies import ClientResult, make_strategy

    names = ("w1", "w2", "w3")
    cfg = parse_config({"workers": list(names), "rounds": 20,
                        "privacy": {"secure_aggregation": {}},
                        "model": {"family": "prodlda", "n_topics": 3, "vocab_size": 50,
                                  "min_df": 1, "batch_size": 8}}, "<test>")
    server = ProdLDAServer(cfg, make_strategy("fedavg"))
    regs = {w: {"vocabulary": {f"word{j}": [3, 2] for j in range(i, i + 30)}, "n_docs": 5}
            for i, w in enumerate(names)}
    first = server.setup(regs)
    assert server.secure_ring(32) == (64, ntm_secure.CLIPS[0])
    rng = np.random.default_rng(0)
    data = {w: sp.csr_matrix(rng.poisson(0.5, size=(8, 32)).astype(float)) for w in names}
    params = build_params(NTMParams, cfg.family_params, "m")
    nodes = {w: params.model(0, 1 + i).initialize(32) for i, w in enumerate(names)}

    def start(payload):
        for node in nodes.values():
            node.set_arrays(payload.arrays)
        return {w: SyncBNStep(nodes[w], data[w], None, np.arange(8), None,
                              payload.meta["step"]) for w in names}

    def phase(steps, payload, who=names, abstains=()):
        ph = payload.meta["phase"]
        vecs = []
        for w in who:
            up = ({ABSTAIN: np.zeros(0)} if w in abstains
                  else steps[w].upload(ph, payload.arrays))
            vecs.append(ntm_secure.worker_vector(nodes[w], ph, up, 8, first.arrays,
                                                 getattr(steps[w], "n_union", 0.0)))
        assert server.secure_size() == vecs[0].size
        arrays = server.secure_result(np.sum(vecs, axis=0), 1, len(who))
        server.check_update(arrays)
        # An abstainer says so in the clear: the master names it in the result.
        return server.aggregate(1, [ClientResult("secure-sum", arrays, 8 * len(who),
                                                 members=tuple(who),
                                                 abstained=tuple(abstains))])

    steps = start(first)
    payload = phase(steps, first)
    assert payload.meta["phase"] == 1 and server.participants() == list(names)
    redone = phase(steps, payload, who=("w1", "w2"))  # w3 dropped after sharing its keys
    assert redone.meta == first.meta and server.steps_ == 0
    steps = start(redone)
    payload = phase(steps, phase(steps, redone), abstains=("w3",))  # w3 lost the step
    assert payload.meta == first.meta and server.steps_ == 0
    steps, payload = start(payload), first
    for _ in range(5):
        payload = phase(steps, payload)
    assert server.steps_ == 1 and payload.meta["phase"] == 0
    assert np.abs(payload.arrays["beta"] - first.arrays["beta"]).max() > 1e-4


def test_worker_abstains_from_a_step_it_holds_no_state_of(tmp_path: Path) -> None:
    from common.models.ntm_sync_bn import ABSTAIN
    from tests.conftest import config_dict
    from worker.families.ntm import ProdLDAClient

    raw = config_dict(tmp_path / "out", tmp_path / "cache", workers=2,
                      model={"family": "prodlda", "n_topics": 4, "batch_size": 16})
    cfg = parse_config(raw, "<test>")
    client = ProdLDAClient(cfg, local_data(cfg, "w1"), "cpu", worker_seed(cfg, "w1"))
    vocab = sorted(client.registration_info()["vocabulary"])[:200]
    client.setup({"vocabulary": vocab, "contextual_size": 0})
    weights = NTMParams(n_topics=4).model(0, 0).initialize(len(vocab)).get_arrays()
    stats = {"mean": np.zeros(8), "var": np.ones(8), "n": np.asarray(32.0)}
    # Phase 1 of a step whose phase 0 this worker never saw (it restarted mid-step).
    lost = client.fit(6, {"step": 1, "phase": 1}, stats)
    assert set(lost.arrays) == {ABSTAIN} and lost.metrics["abstain"] == 1.0
    # Having begun step 1, it answers its phase 1, but not a phase of another step.
    first = client.fit(7, {"step": 1, "phase": 0, "evaluate": False}, weights)
    assert set(first.arrays) == {"mean", "m2"} and first.arrays["mean"].shape == (8,)
    assert first.n_samples == 16
    assert set(client.fit(8, {"step": 2, "phase": 1}, stats).arrays) == {ABSTAIN}
    with pytest.raises(ValueError, match="expected array 'var' of shape"):  # a broken payload
        client.fit(8, {"step": 1, "phase": 1}, {**stats, "var": np.ones(3)})
    assert set(client.fit(8, {"step": 1, "phase": 1}, stats).arrays) == {"mean", "m2"}


@pytest.mark.slow
def test_dp_noise_leaves_the_topic_model_usable_and_its_lost_scores_explained(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path) -> None:
    """DP-FedAvg's noise (1.0 a coordinate, 3 workers) took the prior's variance below zero:
    every score NaN, every document one topic, the run ended 0 with every federated
    perplexity n/a, unexplained. Every variance is held above zero, and the table says why
    a score is missing."""
    change = {"privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}}
    cfg_path = make_config(tmp_path, workers=3, rounds=2, baselines=True,
                           model={"family": "prodlda", "mode": "fedavg", "n_topics": 6,
                                  "vocab_size": 400}, **change)
    _run(cfg_path, embed_cache)
    out = tmp_path / "out"
    arrays, _ = _final(out)
    assert arrays["prior_variance"].min() > 0
    assert all(arrays[n].min() >= 0 for n in arrays if n.endswith("running_var"))
    # A perplexity past float's range on so much noise (the noise is the system's: in every
    # run seen), said so under the table.
    rows = json.loads((out / "summary.json").read_text())["comparison"]
    assert all(r["federated_perplexity"] is not None for r in rows) or (
        "Federated perplexity: n/a on every worker, where the local-only models have one: "
        "not finite") in (out / "comparison.md").read_text()


def test_fedadam_averages_the_running_statistics_and_floors_the_priors_variance() -> None:
    """FedAdam stepped batch norm's running statistics as if they were weights (the decoder's
    variances 4e-4 -> 0.77 in two rounds, a perplexity of 1e11); they are the workers' average
    now. An aggregate's prior variance below zero (DP-FedAvg's noise) made every score NaN."""
    from master.families.ntm import PRIOR_VARIANCE_FLOOR, ProdLDAServer
    from master.strategies import ClientResult, make_strategy

    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 10,
                        "model": {"family": "prodlda", "mode": "fedavg", "n_topics": 3,
                                  "vocab_size": 50, "min_df": 1}}, "<test>")
    server = ProdLDAServer(cfg, make_strategy("fedadam"))
    regs = {w: {"vocabulary": {f"word{j}": [3, 2] for j in range(i, i + 30)}, "n_docs": 5}
            for i, w in enumerate(["w1", "w2"])}
    first = server.setup(regs)
    up1 = {n: a + 0.02 for n, a in first.arrays.items()}
    up2 = {n: a - 0.03 for n, a in first.arrays.items()}
    up2["prior_variance"] = np.full_like(up2["prior_variance"], -5.0)
    new = server.aggregate(1, [ClientResult("w1", up1, 30), ClientResult("w2", up2, 10)]).arrays
    for name in (n for n in first.arrays if ".running_" in n):
        np.testing.assert_allclose(new[name], 0.75 * up1[name] + 0.25 * up2[name], rtol=1e-6,
                                   err_msg=name)
    assert not np.allclose(new["beta"], 0.75 * up1["beta"] + 0.25 * up2["beta"])  # stepped
    dp = ProdLDAServer(cfg, make_strategy("fedavg"))
    dp.setup(regs)
    low = dp.aggregate(1, [ClientResult("w2", up2, 10)]).arrays["prior_variance"]
    assert low.min() == np.float32(PRIOR_VARIANCE_FLOOR)
