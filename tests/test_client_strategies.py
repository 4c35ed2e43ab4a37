"""Strategies that need the workers: FedProx and SCAFFOLD, who may use them, and what each
family's local training does with them."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from common.config import ConfigError, parse_config
from master.families import make_server_family
from master.strategies import ClientResult, FedAvg, make_strategy


def test_fedprox_aggregates_as_fedavg_and_sends_mu():
    clients = [ClientResult("w1", {"x": np.array([1.0, 2.0])}, 1),
               ClientResult("w2", {"x": np.array([3.0, 6.0])}, 3)]
    prox = make_strategy("fedprox", proximal_mu=0.1)
    np.testing.assert_array_equal(prox.aggregate({}, clients)["x"],
                                  FedAvg().aggregate({}, clients)["x"])
    assert prox.client_settings() == {"proximal_mu": 0.1}
    assert make_strategy("fedavg").client_settings() == {}
    with pytest.raises(ValueError, match="proximal_mu"):
        make_strategy("fedprox", proximal_mu=-1)


@pytest.mark.parametrize("model, refusal", [
    ({"family": "mlp"}, None), ({"family": "nmf"}, None),
    ({"family": "prodlda", "mode": "fedavg"}, None),
    ({"family": "prodlda", "mode": "sync"}, "would not be used in mode sync"),
    ({"family": "fstc"}, "no global head"), ({"family": "lda"}, "iFTM's merge")])
def test_only_families_whose_workers_apply_mu_take_fedprox(model, refusal, tmp_path):
    cfg = parse_config({"model": model, "workers": ["w1", "w2"], "rounds": 10,
                        "strategy": {"name": "fedprox", "proximal_mu": 0.1},
                        "data": {"path": str(tmp_path / "unused.jsonl")}}, source="c.yaml")
    if refusal is None:
        assert make_server_family(cfg).strategy.client_settings() == {"proximal_mu": 0.1}
    else:
        with pytest.raises(ConfigError, match=refusal) as info:  # (and why, in one line)
            make_server_family(cfg)
        assert "\n" not in str(info.value) and str(info.value).startswith("c.yaml: strategy")


@pytest.mark.parametrize("family", ["fstc", "lda", "sentencelda"])
def test_families_with_their_own_rule_refuse_a_strategy_rather_than_ignore_it(family, tmp_path):
    base = {"model": {"family": family}, "workers": ["w1", "w2"], "rounds": 10,
            "data": {"path": str(tmp_path / "unused.jsonl")}}
    make_server_family(parse_config(base, source="c.yaml"))  # the default: nothing to refuse
    for name in ("krum", "fedmedian", "fedadam"):
        with pytest.raises(ConfigError, match=f"strategy: {name} would not be used by {family}"):
            make_server_family(parse_config({**base, "strategy": name}, source="c.yaml"))


def _moved(before: list[np.ndarray], after: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, after, strict=True))))


def test_mlp_proximal_term_holds_the_weights_near_the_start():
    from common.models.mlp import MLPClassifier

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((64, 8)).astype(np.float32), rng.integers(0, 3, 64)
    start = MLPClassifier(8, 3, hidden=16, epochs=3).get_arrays()

    def run(**kw):
        m = MLPClassifier(8, 3, hidden=16, epochs=3)
        m.set_arrays(start)
        m.fit(X, y, **kw)
        return list(m.get_arrays().values())

    plain, zero, strong = run(), run(proximal_mu=0.0), run(proximal_mu=100.0)
    assert all(np.array_equal(a, b) for a, b in zip(plain, zero, strict=True))  # mu 0: FedAvg
    base = list(start.values())
    assert _moved(base, strong) < 0.5 * _moved(base, plain)


def test_nmf_proximal_term_holds_the_topics_near_the_start():
    from common.models.nmf import SGDNMF

    X = sp.random(40, 30, density=0.3, random_state=0, format="csr", dtype=np.float32) * 5
    first = SGDNMF(n_topics=4, epochs=1, random_state=0).fit(X)
    start = first.get_arrays()

    def run(**kw):
        m = SGDNMF(n_topics=4, epochs=3, random_state=0, lr=0.05)
        m.set_arrays(start)
        return m.fit(X, **kw).components_

    plain, zero, strong = run(), run(proximal_mu=0.0), run(proximal_mu=10.0)
    np.testing.assert_array_equal(plain, zero)
    c0 = start["components"]
    assert np.abs(strong - c0).sum() < 0.5 * np.abs(plain - c0).sum()


def test_ntm_proximal_term_holds_the_weights_near_the_start():
    from common.models.ntm import NTMParams

    rng = np.random.default_rng(0)
    X = sp.csr_matrix(rng.poisson(0.5, size=(32, 20)).astype(np.float32))
    params = NTMParams(n_topics=3, batch_size=16, mode="fedavg")

    def run(mu: float) -> list[np.ndarray]:
        m = params.model(0, 0).initialize(20)
        before = [p.detach().clone() for p in m._trainable()]
        anchor = [p.detach().clone() for p in m._trainable()] if mu else None
        for start in (0, 16, 0, 16):
            m.step(X, None, np.arange(start, start + 16), None, anchor, mu)
        return [b.numpy() for b in before], [p.detach().numpy() for p in m._trainable()]

    base, plain = run(0.0)
    _, strong = run(1e4)
    assert _moved(base, strong) < 0.5 * _moved(base, plain)


def test_every_round_carries_mu_to_the_workers(tmp_path):
    from master.families import Payload
    from master.server import Master

    cfg = parse_config({"model": {"family": "mlp"}, "workers": ["w1"],
                        "strategy": {"name": "fedprox", "proximal_mu": 0.25},
                        "output_dir": str(tmp_path / "out"),
                        "data": {"path": str(tmp_path / "unused.jsonl")}}, source="c.yaml")
    master = Master(cfg)
    try:
        body = master._payload_body(Payload({"step": 3}), with_setup=False)
    finally:
        master.close()
    assert body["meta"] == {"step": 3, "proximal_mu": 0.25}


def test_scaffold_worker_keeps_its_control_variate_and_sends_its_change(tmp_path, embed_cache):
    """Option II on the MLP worker: with c = c_i = 0 its new c_i is (x - y) / (K lr), sent as
    the change; the next round corrects each step by c - c_i."""
    from common.constants import SCAFFOLD_CHANGE, SCAFFOLD_CONTROL
    from common.data.shards import local_data, worker_seed
    from tests.conftest import config_dict
    from worker.client import split_payload
    from worker.families import make_client_family

    raw = config_dict(tmp_path / "out", embed_cache, workers=2, rounds=3,
                      model={"family": "mlp", "hidden": 16, "optimizer": "sgd", "lr": 0.05},
                      strategy="scaffold", data={"task": "multiclass"})
    cfg = parse_config(raw, source="<test>")
    server = make_server_family(cfg)
    regs = {w: make_client_family(cfg, local_data(cfg, w), "cpu", worker_seed(cfg, w))
            .registration_info() for w in ("w1", "w2")}
    server.setup(regs)
    x = server.global_.arrays
    arrays = {**x, **server.strategy.client_arrays(x)}
    meta, model = split_payload({}, arrays)
    assert set(model) == set(x) and set(meta["strategy_arrays"]) == {
        SCAFFOLD_CONTROL + n for n in x}
    fam = make_client_family(cfg, local_data(cfg, "w1"), "cpu", worker_seed(cfg, "w1"))
    fam.setup(server.setup_info_)
    out = fam.fit(1, meta, model)
    k_lr = fam.model.last_steps_ * 0.05
    for n in x:
        want = (x[n] - out.arrays[n]) / k_lr
        np.testing.assert_allclose(out.arrays[SCAFFOLD_CHANGE + n], want, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(fam.control_[n], want, rtol=1e-4, atol=1e-6)
    assert any(np.abs(fam.control_[n]).max() > 0 for n in x)
    assert fam.local_state()["control"].keys() == x.keys()  # in its snapshots
