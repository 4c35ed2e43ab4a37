"""FedNMF / FedNMF+MI: the SMILE bound, the SGD NMF model, both family sides, a real cluster."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.decomposition import NMF

from common.config import ConfigError, build_params, parse_config
from common.data.shards import local_data, worker_seed
from common.data.text import bow_matrix, local_vocabulary, merge_vocabularies
from common.models.nmf import (
    COMPONENTS,
    SGDNMF,
    NMFParams,
    heldout_scores,
    reconstruction_loss,
)
from common.models.smile import SmileCritic, smile_lower_bound
from common.net.wire import ProtocolError
from master.baselines import simulation_baselines
from master.families import make_server_family
from master.strategies import ClientResult, FedAdam
from tests.conftest import ROOT, MakeConfig, Procs, events
from worker.families import make_client_family

STACKOVERFLOW = ROOT / "data" / "stackoverflow" / "stackoverflow_1500.jsonl"


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are small, and on a shared 2-core machine a second
    thread mostly waits for the other processes (measured 8x slower per step)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def titles() -> tuple[list[str], np.ndarray]:
    with STACKOVERFLOW.open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return [r["text"] for r in rows], np.array([r["label"] for r in rows])


@pytest.fixture(scope="module")
def bow(titles: tuple[list[str], np.ndarray]) -> tuple[sp.csr_matrix, list[str]]:
    vocab = merge_vocabularies([local_vocabulary(titles[0])], max_size=800, min_df=2)
    return bow_matrix(titles[0], vocab), vocab


# --------------------------------------------------------------------------------------------
# SMILE
# --------------------------------------------------------------------------------------------


def _gaussians(rho: float, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n draws of (x, z), standard normal with correlation rho: I(x; z) = -log(1 - rho^2)/2."""
    x = rng.standard_normal(n)
    return x, rho * x + math.sqrt(1 - rho**2) * rng.standard_normal(n)


def _true_mi(rho: float) -> float:
    return -0.5 * math.log(1 - rho**2)


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.8])
def test_smile_with_the_optimal_critic_is_the_true_mutual_information(rho: float) -> None:
    # The optimal critic is the log density ratio log p(x, z) / (p(x) p(z)), in closed form
    # for Gaussians; with it E_joint[T] = I and E_marginals[e^T] = 1, so the bound is tight.
    x, z = _gaussians(rho, 2000, np.random.default_rng(0))
    s = 1 - rho**2
    xx, zz = x[:, None] ** 2, z[None, :] ** 2
    scores = -0.5 * math.log(s) - (xx - 2 * rho * x[:, None] * z[None, :] + zz) / (2 * s) \
        + (xx + zz) / 2
    t = torch.as_tensor(scores)
    value = float(smile_lower_bound(t.diagonal(), t, tau=5.0))
    assert value == pytest.approx(_true_mi(rho), abs=0.03)


def test_smile_value_by_hand_and_its_gradients() -> None:
    scores = torch.tensor([[2.0, 0.5, 9.0], [-1.0, 1.0, 0.0], [0.3, -8.0, 3.0]],
                          requires_grad=True)
    off = [0.5, 9.0, -1.0, 0.0, 0.3, -8.0]
    clipped = [min(max(v, -5.0), 5.0) for v in off]  # tau = 5: 9 -> 5, -8 -> -5
    expected = (2 + 1 + 3) / 3 - math.log(sum(math.exp(v) for v in clipped) / 6)
    js = smile_lower_bound(scores.diagonal(), scores)
    plain = smile_lower_bound(scores.diagonal(), scores, js_gradient=False)
    assert float(js.detach()) == pytest.approx(expected)
    assert float(plain.detach()) == pytest.approx(expected)
    (g_js,) = torch.autograd.grad(js, scores)
    (g_plain,) = torch.autograd.grad(plain, scores)
    # Clipped entries give no gradient through the plain bound; the JS gradient sees them.
    assert g_plain[0, 2] == 0 and g_plain[2, 1] == 0
    assert g_js[0, 2] < 0 and not torch.allclose(g_js, g_plain)
    with pytest.raises(ValueError):
        smile_lower_bound(torch.zeros(2), torch.zeros(2, 3))


def test_trained_critic_estimate_rises_with_correlation() -> None:
    estimates = []
    for rho in (0.0, 0.5, 0.9):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        critic = SmileCritic(1, 1, hidden=(32, 64))
        opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
        for _ in range(250):
            x, z = (torch.tensor(a, dtype=torch.float32)[:, None]
                    for a in _gaussians(rho, 32, rng))
            loss = -critic.bound(x, z)
            opt.zero_grad()
            loss.backward()
            opt.step()
        x, z = (torch.tensor(a, dtype=torch.float32)[:, None] for a in _gaussians(rho, 500, rng))
        with torch.no_grad():
            estimates.append(float(critic.bound(x, z)))
        assert estimates[-1] < _true_mi(rho) + 0.1  # a lower bound, up to sampling noise
    assert estimates[0] < estimates[1] < estimates[2]
    assert estimates[2] > 0.6  # I = 0.83 at rho = 0.9


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


def test_sgd_nmf_learns_topics(bow: tuple[sp.csr_matrix, list[str]]) -> None:
    X, vocab = bow
    model = SGDNMF(n_topics=20, random_state=0)
    model.fit(X, epochs=1)
    first = model.last_loss_
    model.fit(X, epochs=14)
    assert model.last_loss_ < 0.9 * first
    assert model.components_.shape == (20, len(vocab)) and (model.components_ >= 0).all()
    assert model.doc_topic_.shape == (X.shape[0], 20) and (model.doc_topic_ >= 0).all()
    H = model.transform(X)
    assert H.shape == (X.shape[0], 20) and (H >= 0).all()
    # transform solves for H: it reconstructs at least as well as the H learned by SGD
    assert model.reconstruction_loss(X, H) <= model.reconstruction_loss(X, model.doc_topic_)
    untrained = SGDNMF(n_topics=20, random_state=0)
    untrained.initialize(len(vocab), X.mean())
    assert model.reconstruction_loss(X) < 0.9 * untrained.reconstruction_loss(X)
    topics = model.get_topics(vocab, 5)
    assert len(topics) == 20 and all(len(t) == 5 for t in topics)


def test_zero_mi_weight_is_plain_projected_sgd(bow: tuple[sp.csr_matrix, list[str]]) -> None:
    """lambda = 0 is exactly NMF by projected gradient steps, checked against a reference
    written out here (full batches, so the batch order plays no part)."""
    X = bow[0][:200]
    n, v = X.shape
    k, lr, epochs = 5, 0.05, 6
    rng = np.random.default_rng(1)
    c0 = np.abs(rng.standard_normal((k, v))) * 0.1
    h0 = np.abs(rng.standard_normal((n, k))) * 0.1

    def run(mi_weight: float) -> SGDNMF:
        m = SGDNMF(n_topics=k, mi_weight=mi_weight, batch_size=n, lr=lr, random_state=0,
                   critic_hidden=(8, 8))
        m.initialize(v)
        m.set_arrays({**m.get_arrays(), COMPONENTS: c0.astype(np.float32)})
        return m.fit(X, epochs=epochs, doc_topic=h0.astype(np.float32))

    A = X.toarray().astype(np.float64)
    C, H = c0.copy(), h0.copy()
    for _ in range(epochs):
        R = H @ C - A  # the loss is mean_j ||x_j - h_j C||^2
        grad_c = 2 / n * H.T @ R
        grad_h = 2 * R @ C.T  # each row: its own document's term
        C, H = np.maximum(C - lr * grad_c, 0), np.maximum(H - lr * grad_h, 0)

    plain = run(0.0)
    assert plain.critic_ is None and set(plain.get_arrays()) == {COMPONENTS}
    np.testing.assert_allclose(plain.components_, C, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(plain.doc_topic_, H, rtol=1e-4, atol=1e-6)
    with_mi = run(1.0)
    assert not np.allclose(with_mi.doc_topic_, H, rtol=1e-4, atol=1e-6)


def test_mi_keeps_scale_moves_h_without_changing_its_sums(
        bow: tuple[sp.csr_matrix, list[str]]) -> None:
    """``mi_keeps_scale``: the MI step redistributes each h over the topics at the sum the
    reconstruction's step gave it; C's step is the reconstruction's, as without MI."""
    X = bow[0][:200]
    n, v = X.shape
    k = 6
    rng = np.random.default_rng(3)
    c0 = (np.abs(rng.standard_normal((k, v))) * 0.1).astype(np.float32)
    h0 = (np.abs(rng.standard_normal((n, k))) * 0.1).astype(np.float32)

    def one_step(mi_weight: float, keeps: bool) -> SGDNMF:
        m = SGDNMF(n_topics=k, mi_weight=mi_weight, batch_size=n, lr=0.002,
                   mi_keeps_scale=keeps, critic_hidden=(8, 8), random_state=0)
        m.initialize(v)
        m.set_arrays({**m.get_arrays(), COMPONENTS: c0})
        return m.fit(X, epochs=1, doc_topic=h0)

    plain, kept, paper = one_step(0.0, False), one_step(1.0, True), one_step(1.0, False)
    assert (plain.doc_topic_.sum(1) > 0).mean() > 0.9
    np.testing.assert_allclose(kept.components_, plain.components_, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kept.doc_topic_.sum(1), plain.doc_topic_.sum(1), rtol=1e-4,
                               atol=1e-6)
    assert not np.allclose(kept.doc_topic_, plain.doc_topic_, rtol=1e-3, atol=1e-6)
    assert not np.allclose(paper.doc_topic_.sum(1), plain.doc_topic_.sum(1), rtol=1e-6,
                           atol=0)  # the paper's joint step moves the sums too
    np.testing.assert_array_equal(one_step(0.0, True).doc_topic_, plain.doc_topic_)
    with pytest.raises(ValueError, match="mi_keeps_scale"):
        SGDNMF(mi_weight=1.0, optimizer="adam")  # the default keeps the scale: plain SGD only
    late = SGDNMF(n_topics=k, optimizer="adam")
    late.mi_weight = 1.0
    with pytest.raises(ValueError, match="mi_keeps_scale"):
        late.fit(X)


def test_mi_keeps_scale_holds_h_where_the_reconstruction_puts_it(
        bow: tuple[sp.csr_matrix, list[str]]) -> None:
    """Over 25 epochs the paper's update lets the MI term grow H (and shrink C, the start of
    the collapse in docs/FEDNMF.md); with ``mi_keeps_scale`` H stays near its size without
    MI while the bound is as high."""
    X = bow[0]

    def fit(mi_weight: float, keeps: bool) -> SGDNMF:
        return SGDNMF(n_topics=20, mi_weight=mi_weight, mi_keeps_scale=keeps,
                      random_state=0).fit(X, epochs=25)

    plain, kept, paper = fit(0.0, False), fit(1.0, True), fit(1.0, False)
    size = {name: float(m.doc_topic_.sum(1).mean())
            for name, m in (("plain", plain), ("kept", kept), ("paper", paper))}
    assert size["paper"] > 1.5 * size["plain"], size
    assert size["kept"] < 1.25 * size["plain"], size
    assert kept.last_mi_ > 0.5 * paper.last_mi_ > 0
    assert kept.last_loss_ < paper.last_loss_


def test_master_warns_of_long_training_with_the_mi_term(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    def warnings(**model: object) -> list[str]:
        caplog.clear()
        cfg = parse_config({"workers": ["w1"], "rounds": 30,
                            "model": {"family": "nmf", "local_epochs": 2, **model}})
        make_server_family(cfg)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    (line,) = warnings(mi_weight=1, mi_keeps_scale=False)
    assert "30 rounds x 2 local epochs" in line and "mi_keeps_scale: false" in line
    assert warnings(mi_weight=1) == []  # the default keeps the scale
    assert warnings(mi_weight=0, mi_keeps_scale=False) == []
    # 30 epochs: within the range where the paper's update is stable
    assert warnings(mi_weight=1, mi_keeps_scale=False, local_epochs=1) == []


def test_mi_keeps_scale_through_the_config() -> None:
    cfg = parse_config({"workers": ["w1"], "model": {
        "family": "nmf", "mi_weight": 1, "mi_keeps_scale": True}})
    params = build_params(NMFParams, cfg.family_params, "cluster.yaml: model")
    assert params.model().mi_keeps_scale is True
    assert NMFParams().model().mi_keeps_scale is True  # the default keeps the scale
    paper = {"mi_weight": 1, "mi_keeps_scale": False}
    assert build_params(NMFParams, paper, "cluster.yaml: model").model().mi_keeps_scale is False
    adam = {"mi_weight": 1, "optimizer": "adam"}
    for bad in ({"mi_keeps_scale": "yes"}, adam):
        with pytest.raises(ConfigError, match="mi_keeps_scale"):
            build_params(NMFParams, bad, "cluster.yaml: model")
    # adam trains the MI term with the paper's update, and without the term the option is moot
    assert build_params(NMFParams, {**adam, "mi_keeps_scale": False}, "m").optimizer == "adam"
    assert build_params(NMFParams, {"optimizer": "adam"}, "m").mi_keeps_scale is True


def test_arrays_travel_without_h(bow: tuple[sp.csr_matrix, list[str]]) -> None:
    X, vocab = bow
    model = SGDNMF(n_topics=8, mi_weight=0.5, random_state=0).fit(X[:300], epochs=1)
    arrays = model.get_arrays()
    assert arrays[COMPONENTS].shape == (8, len(vocab))
    critic = {k for k in arrays if k.startswith("critic.")}
    assert critic and set(arrays) == {COMPONENTS} | critic
    assert all(a.dtype == np.float32 for a in arrays.values())
    assert not any(a.shape[0] == 300 for a in arrays.values())  # nothing per document
    other = SGDNMF(n_topics=8, mi_weight=0.5, random_state=5)
    other.set_arrays(arrays)
    assert all(np.array_equal(other.get_arrays()[k], a) for k, a in arrays.items())
    assert math.isfinite(model.last_mi_)


def test_transform_is_scikit_learns_solver(bow: tuple[sp.csr_matrix, list[str]]) -> None:
    X = bow[0]
    ref = NMF(n_components=10, init="nndsvda", max_iter=300, random_state=0).fit(X)
    model = SGDNMF(n_topics=10)
    model.set_arrays({COMPONENTS: ref.components_.astype(np.float32)})
    np.testing.assert_allclose(model.transform(X[:100]), ref.transform(X[:100]), atol=2e-3)


def test_reconstruction_loss_matches_the_dense_product() -> None:
    rng = np.random.default_rng(0)
    X = sp.random(30, 12, density=0.3, random_state=0, format="csr") * 3
    H, C = rng.random((30, 4)), rng.random((4, 12))
    dense = ((X.toarray() - H @ C) ** 2).sum() / 30
    assert reconstruction_loss(X, H, C) == pytest.approx(dense)


def test_heldout_scores(bow: tuple[sp.csr_matrix, list[str]],
                        titles: tuple[list[str], np.ndarray]) -> None:
    X, y = bow[0], titles[1]
    model = SGDNMF(n_topics=20, random_state=0).fit(X[::2], epochs=15)
    scores = heldout_scores(model, X[::2], y[::2], X[1::2], y[1::2])
    assert set(scores) == {"loss", "accuracy", "macro_f1"}
    assert scores["accuracy"] > 0.25  # 20 tags: chance is 0.05
    only_loss = heldout_scores(model, X[:10], np.zeros(10), X[10:20], y[10:20])
    assert set(only_loss) == {"loss"}


def test_params_are_checked() -> None:
    where = "cluster.yaml: model"
    assert build_params(NMFParams, {"n_topics": 7, "mi_weight": 1}, where).mi_weight == 1
    for bad, field in (({"optimizer": "rmsprop"}, "optimizer"),
                       ({"critic_aggregation": "median"}, "critic_aggregation"),
                       ({"n_topic": 3}, "n_topic"), ({"lr": 0}, "lr"),
                       ({"n_topics": 2.5}, "n_topics")):
        with pytest.raises(ConfigError, match=field):
            build_params(NMFParams, bad, where)


# --------------------------------------------------------------------------------------------
# The master's side, in-process
# --------------------------------------------------------------------------------------------


def _server(strategy: str | dict, **model: object):
    cfg = parse_config({"workers": ["w1", "w2"], "strategy": strategy,
                        "model": {"family": "nmf", "n_topics": 3, "vocab_size": 4,
                                  "min_df": 2, **model}})
    return make_server_family(cfg)


def test_server_agrees_on_a_vocabulary_and_starts_non_negative() -> None:
    server = _server("fedavg")
    infos = {"w1": {"vocabulary": {"apple": [9, 5], "banana": [3, 3], "kiwi": [1, 1]},
                    "n_docs": 10},
             "w2": {"vocabulary": {"banana": [5, 4], "cherry": [2, 2], "kiwi": [1, 1]},
                    "n_docs": 10}}
    for info in infos.values():
        server.check_info(info)
    payload = server.setup(infos)
    # tf x holders: banana 8 x 2, apple 9 x 1, kiwi 2 x 2, cherry 2 x 1
    assert server.setup_info_ == {"vocabulary": ["banana", "apple", "kiwi", "cherry"]}
    assert set(payload.arrays) == {COMPONENTS}  # no MI: no critic on the wire
    comp = payload.arrays[COMPONENTS]
    assert comp.shape == (3, 4) and comp.dtype == np.float32 and (comp > 0).all()


@pytest.mark.parametrize("info", [
    {"n_docs": 3},
    {"vocabulary": {"a": [1, 1]}, "n_docs": -1},
    {"vocabulary": {"a": [1]}, "n_docs": 3},
    {"vocabulary": {"a": [1, "x"]}, "n_docs": 3},
    {"vocabulary": ["a"], "n_docs": 3},
])
def test_server_refuses_bad_registrations(info: dict) -> None:
    with pytest.raises(ProtocolError) as err:
        _server("fedavg").check_info(info)
    assert err.value.code == "bad_field"


def test_server_optimizer_keeps_topics_non_negative() -> None:
    server = _server("fedadam", mi_weight=1.0)
    server.setup({w: {"vocabulary": {"apple": [4, 2], "banana": [4, 2], "cherry": [4, 2]},
                      "n_docs": 400} for w in ("w1", "w2")})  # sparse: small initial topics
    start = {k: a.copy() for k, a in server.global_.arrays.items()}
    # Both clients drive the first topic to zero: FedAdam steps ~eta = 0.1 towards it, past
    # zero for the small entries.
    results = []
    for wid in ("w1", "w2"):
        arrays = {k: (a + 0.01 if k != COMPONENTS else a.copy()) for k, a in start.items()}
        arrays[COMPONENTS][0] = 0.0
        results.append(ClientResult(wid, arrays, 5))
    unclipped = FedAdam().aggregate({COMPONENTS: start[COMPONENTS]},
                                    [ClientResult(r.worker_id, {COMPONENTS: r.arrays[COMPONENTS]},
                                                  5) for r in results])[COMPONENTS]
    assert (unclipped < 0).any()
    new = server.aggregate(1, results).arrays
    np.testing.assert_array_equal(new[COMPONENTS], np.maximum(unclipped, 0))
    # The critic is averaged, not stepped: the mean of the clients' (start + 0.01).
    for k in start:
        if k != COMPONENTS:
            np.testing.assert_allclose(new[k], start[k] + 0.01, rtol=1e-5, atol=1e-6)


def test_server_can_step_the_critic_with_the_strategy() -> None:
    server = _server("fedadam", mi_weight=1.0, critic_aggregation="strategy")
    server.setup({w: {"vocabulary": {"apple": [4, 2], "banana": [4, 2]}, "n_docs": 4}
                  for w in ("w1", "w2")})
    start = {k: a.copy() for k, a in server.global_.arrays.items()}
    results = [ClientResult(w, {k: a + 0.01 for k, a in start.items()}, 5) for w in ("w1", "w2")]
    new = server.aggregate(1, results).arrays
    key = next(k for k in start if k.startswith("critic."))
    # FedAdam's first step: eta * (1 - b1) d / (sqrt((1 - b2) d^2) + tau), d = 0.01
    step = 0.1 * 0.1 * 0.01 / (math.sqrt(0.01 * 0.01**2) + 1e-3)
    np.testing.assert_allclose(new[key], start[key] + step, rtol=1e-4, atol=1e-6)


def test_local_critic_never_leaves_its_worker(tmp_path: Path) -> None:
    """``critic_aggregation: local``: C alone travels both ways, and each worker's critic
    carries on from round to round instead of being replaced by the master's."""
    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 2, "seed": 0,
                        "data": {"path": str(STACKOVERFLOW), "task": "multiclass",
                                 "partition": "iid"},
                        "model": {"family": "nmf", "n_topics": 6, "vocab_size": 300,
                                  "mi_weight": 0.5, "critic_aggregation": "local"}},
                       source=str(tmp_path / "c.yaml"))
    server = make_server_family(cfg)
    clients = {w.name: make_client_family(cfg, local_data(cfg, w.name), "cpu",
                                          worker_seed(cfg, w.name)) for w in cfg.workers}
    server.setup({name: c.registration_info() for name, c in clients.items()})
    assert set(server.global_.arrays) == {COMPONENTS}
    for c in clients.values():
        c.setup(server.setup_info_)
    critics = []
    for rnd in (1, 2):
        results = []
        for name, c in clients.items():
            fit = c.fit(rnd, {}, server.global_.arrays)
            assert set(fit.arrays) == {COMPONENTS} and math.isfinite(fit.metrics["train_mi"])
            server.check_update(fit.arrays)
            results.append(ClientResult(name, fit.arrays, fit.n_samples))
        critics.append({name: c.model.get_arrays() for name, c in clients.items()})
        assert set(server.aggregate(rnd, results).arrays) == {COMPONENTS}
    w1, w2 = critics[1]["w1"], critics[1]["w2"]
    key = next(k for k in w1 if k.startswith("critic."))
    assert not np.allclose(w1[key], w2[key])  # each its own, never averaged
    assert not np.allclose(critics[0]["w1"][key], w1[key])  # and it kept training
    # Loading the next global C leaves the worker's critic as it was.
    clients["w1"].model.set_arrays(server.global_.arrays)
    np.testing.assert_array_equal(clients["w1"].model.get_arrays()[key], w1[key])


def test_in_process_round_and_simulation_baselines(tmp_path: Path) -> None:
    """Both sides in one process, as the cluster runs them minus the sockets: the pre-training
    exchange, a round, and the master's pooled baselines (where it can see every share)."""
    cfg = parse_config({"workers": ["w1", "w2", "w3"], "rounds": 2, "seed": 0,
                        "data": {"path": str(STACKOVERFLOW), "task": "multiclass",
                                 "partition": "iid"},
                        "model": {"family": "nmf", "n_topics": 10, "vocab_size": 500,
                                  "mi_weight": 0.5}}, source=str(tmp_path / "c.yaml"))
    server = make_server_family(cfg)
    clients = {w.name: make_client_family(cfg, local_data(cfg, w.name), "cpu",
                                          worker_seed(cfg, w.name)) for w in cfg.workers}
    infos = {name: c.registration_info() for name, c in clients.items()}
    for info in infos.values():
        server.check_info(info)
    server.setup(infos)
    for c in clients.values():
        c.setup(server.setup_info_)
    before = [c.evaluate({}, server.global_.arrays)["loss"] for c in clients.values()]
    for rnd in (1, 2):
        results = []
        for name, c in clients.items():
            fit = c.fit(rnd, {}, server.global_.arrays)
            server.check_update(fit.arrays)
            assert fit.n_samples == c.n_samples and fit.metrics["train_time"] > 0
            results.append(ClientResult(name, fit.arrays, fit.n_samples))
        server.aggregate(rnd, results)
    after = [c.evaluate({}, server.global_.arrays) for c in clients.values()]
    assert np.mean([a["loss"] for a in after]) < np.mean(before)
    sim = simulation_baselines(server)
    assert set(sim["centralized"]) == {"w1", "w2", "w3"}
    assert set(sim["pooled"]) == {"local-only w1", "local-only w2", "local-only w3",
                                  "federated", "centralized"}
    for scores in [*sim["centralized"].values(), *sim["pooled"].values()]:
        assert 0 <= scores["macro_f1"] <= 1 and scores["loss"] > 0
    local = clients["w1"].local_baseline()
    assert set(local) == {"loss", "macro_f1", "accuracy"}


# --------------------------------------------------------------------------------------------
# A real cluster
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cluster_fednmf_mi_reconstruction_loss_falls(tmp_path: Path, make_config: MakeConfig,
                                                     procs: Procs) -> None:
    """A master and 3 workers as processes over TCP loopback, FedNMF+MI with FedAvg on the
    1,500 stackoverflow titles: the reconstruction loss of the global topics on the workers'
    own held-out titles falls from round to round."""
    rounds, k = 4, 20
    cfg = make_config(tmp_path, workers=3, rounds=rounds,
                      data={"path": str(STACKOVERFLOW), "limit": None, "task": "multiclass",
                            "partition": "dirichlet", "alpha": 1.0},
                      model={"family": "nmf", "n_topics": k, "mi_weight": 1.0,
                             "local_epochs": 4, "vocab_size": 600})
    out = tmp_path / "out"
    procs.master(cfg)
    for w in ("w1", "w2", "w3"):
        procs.worker(cfg, w)
    codes = procs.wait_all(timeout=240)
    assert codes == {"master": 0, "w1": 0, "w2": 0, "w3": 0}, procs.logs_tail()

    model = json.loads((out / "model.json").read_text())
    vocab = model["setup"]["vocabulary"]
    assert model["family"] == "nmf" and len(vocab) == 600 == len(set(vocab))
    with np.load(out / "model.npz") as npz:
        arrays = {name: npz[name] for name in npz.files}
    assert arrays[COMPONENTS].shape == (k, 600) and (arrays[COMPONENTS] >= 0).all()
    assert any(name.startswith("critic.") for name in arrays)

    rows = events(out, "worker_round")
    assert sorted((e["worker"], e["round"]) for e in rows) == [
        (w, r) for w in ("w1", "w2", "w3") for r in range(1, rounds + 1)]
    for e in rows:
        assert e["loss"] > 0 and math.isfinite(e["train_mi"]) and e["train_time"] > 0
    loss = [np.mean([e["loss"] for e in rows if e["round"] == r]) for r in range(1, rounds + 1)]
    assert all(b < a for a, b in zip(loss, loss[1:], strict=False)), loss
    assert loss[-1] < 0.95 * loss[0], loss
    # The model on the wire is C and the critic, never a worker's H: a few hundred KB.
    payload = sum(a.nbytes for a in arrays.values())
    assert all(e["bytes_out"] >= payload for e in rows)
    assert all(e["bytes_out"] < payload + 64 * 1024 for e in rows)
