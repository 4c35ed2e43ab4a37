"""Tests of master/strategies: weighted_average, MeanPooling, FedAvg and make_strategy,
against sums worked out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.aggregate import BufferPool, weighted_average
from master.strategies import STRATEGIES, ClientResult, FedAvg, MeanPooling, make_strategy
from master.strategies.base import Strategy


def results(arrays: list[dict[str, np.ndarray]], ns: list[int]) -> list[ClientResult]:
    return [ClientResult(f"w{i + 1}", a, n) for i, (a, n) in enumerate(zip(arrays, ns,
                                                                             strict=True))]


THREE = [{"x": np.array([1.0, 2.0])}, {"x": np.array([3.0, 4.0])}, {"x": np.array([5.0, 6.0])}]
CURRENT = {"x": np.array([100.0, 100.0])}


# ---------------------------------------------------------------------------- weighted_average
def test_weighted_average_by_hand():
    out = weighted_average(THREE, [1, 1, 2])
    # (1*1 + 1*3 + 2*5) / 4, (1*2 + 1*4 + 2*6) / 4
    np.testing.assert_allclose(out["x"], [14 / 4, 18 / 4])
    np.testing.assert_allclose(weighted_average(THREE, [1, 0, 0])["x"], [1.0, 2.0])
    np.testing.assert_allclose(weighted_average(THREE, [0.5, 0.5, 0])["x"], [2.0, 3.0])
    # Only the ratios matter.
    np.testing.assert_allclose(weighted_average(THREE, [10, 10, 20])["x"], [3.5, 4.5])


def test_weighted_average_does_not_modify_inputs():
    inputs = [{"x": a["x"].copy()} for a in THREE]
    weighted_average(inputs, [1, 2, 3])
    for got, want in zip(inputs, THREE, strict=True):
        np.testing.assert_array_equal(got["x"], want["x"])


def test_weighted_average_accepts_read_only_inputs():
    ro = []
    for a in THREE:
        x = a["x"].copy()
        x.flags.writeable = False
        ro.append({"x": x})
    np.testing.assert_allclose(weighted_average(ro, [1, 1, 2])["x"], [3.5, 4.5])


@pytest.mark.parametrize("weights", [[], [1, 1], [1, 1, 1, 1], [[1, 1, 1]]])
def test_weighted_average_needs_one_weight_per_client(weights):
    with pytest.raises(ValueError, match="weights"):
        weighted_average(THREE, weights)


@pytest.mark.parametrize("weights", [[-1, 1, 1], [1, -0.5, 2], [-1, -1, -1]])
def test_weighted_average_refuses_negative_weights(weights):
    with pytest.raises(ValueError, match="non-negative"):
        weighted_average(THREE, weights)


@pytest.mark.parametrize("weights", [[0, 0, 0], [0.0, 0.0, 0.0]])
def test_weighted_average_refuses_zero_total_weight(weights):
    with pytest.raises(ValueError, match="positive sum"):
        weighted_average(THREE, weights)


def test_weighted_average_refuses_nothing():
    with pytest.raises(ValueError, match="nothing to aggregate"):
        weighted_average([], [])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weighted_average_refuses_non_finite_weights(bad):
    with pytest.raises(ValueError):
        weighted_average(THREE, [bad, 1, 1])


# ---------------------------------------------------------------------------- the strategies
def test_mean_pooling_by_hand():
    out = MeanPooling().aggregate(CURRENT, results(THREE, [1, 1, 2]))
    np.testing.assert_allclose(out["x"], [3.0, 4.0])  # n_samples ignored
    out = MeanPooling().aggregate(CURRENT, results(THREE, [1000, 1, 0]))
    np.testing.assert_allclose(out["x"], [3.0, 4.0])


def test_fedavg_by_hand():
    out = FedAvg().aggregate(CURRENT, results(THREE, [1, 1, 2]))
    np.testing.assert_allclose(out["x"], [(1 + 3 + 10) / 4, (2 + 4 + 12) / 4])
    np.testing.assert_allclose(out["x"], [3.5, 4.5])
    # A client with no samples does not count.
    out = FedAvg().aggregate(CURRENT, results(THREE, [3, 0, 1]))
    np.testing.assert_allclose(out["x"], [(3 * 1 + 5) / 4, (3 * 2 + 6) / 4])


def two_layer(seed: float) -> dict[str, np.ndarray]:
    return {"w": np.array([[1.0, 2.0], [3.0, 4.0]]) * seed, "b": np.array([1.0, -1.0]) * seed}


def test_multi_array_models():
    clients = [two_layer(1.0), two_layer(2.0), two_layer(4.0)]
    mean = MeanPooling().aggregate({}, results(clients, [1, 1, 1]))
    fed = FedAvg().aggregate({}, results(clients, [2, 1, 1]))
    assert set(mean) == set(fed) == {"w", "b"}
    # mean factor (1 + 2 + 4) / 3; FedAvg factor (2*1 + 1*2 + 1*4) / 4 = 2
    np.testing.assert_allclose(mean["w"], np.array([[1, 2], [3, 4]]) * 7 / 3)
    np.testing.assert_allclose(mean["b"], np.array([1, -1]) * 7 / 3)
    np.testing.assert_allclose(fed["w"], [[2, 4], [6, 8]])
    np.testing.assert_allclose(fed["b"], [2, -2])
    assert fed["w"].shape == (2, 2) and fed["b"].shape == (2,)
    assert list(fed) == ["w", "b"]  # names in the clients' order


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("strategy", [MeanPooling(), FedAvg()])
def test_dtype_preserved(dtype, strategy):
    clients = [{"w": np.full((2, 2), v, dtype=dtype), "b": np.full(3, -v, dtype=dtype)}
               for v in (1.0, 2.0, 6.0)]
    out = strategy.aggregate({}, results(clients, [1, 1, 1]))
    for name in ("w", "b"):
        assert out[name].dtype == dtype
    np.testing.assert_allclose(out["w"], np.full((2, 2), 3.0))
    np.testing.assert_allclose(out["b"], np.full(3, -3.0))


def test_mixed_dtypes_each_keep_their_own():
    clients = [{"a": np.array([1.0, 2.0], np.float32), "b": np.array([1.0], np.float64)},
               {"a": np.array([3.0, 4.0], np.float32), "b": np.array([2.0], np.float64)}]
    out = FedAvg().aggregate({}, results(clients, [1, 3]))
    assert out["a"].dtype == np.float32 and out["b"].dtype == np.float64
    np.testing.assert_allclose(out["a"], [2.5, 3.5])
    np.testing.assert_allclose(out["b"], [1.75])


def test_float32_accuracy_of_many_clients():
    rng = np.random.default_rng(0)
    clients = [{"w": rng.standard_normal(1000).astype(np.float32)} for _ in range(50)]
    ns = [int(n) for n in rng.integers(1, 100, size=50)]
    out = FedAvg().aggregate({}, results(clients, ns))
    want = sum(n * c["w"].astype(np.float64) for c, n in zip(clients, ns, strict=True)) / sum(ns)
    assert out["w"].dtype == np.float32
    np.testing.assert_allclose(out["w"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [MeanPooling(), FedAvg()])
def test_single_client_returns_its_own_arrays(strategy):
    rng = np.random.default_rng(3)
    mine = {"w": rng.standard_normal((4, 3)).astype(np.float32),
            "b": rng.standard_normal(3)}
    out = strategy.aggregate({"w": np.zeros((4, 3), np.float32), "b": np.zeros(3)},
                             [ClientResult("w1", mine, 17)])
    assert set(out) == {"w", "b"}
    for name in mine:
        assert out[name].dtype == mine[name].dtype
        np.testing.assert_array_equal(out[name], mine[name])


@pytest.mark.parametrize("strategy", [MeanPooling(), FedAvg()])
def test_no_results_is_an_error(strategy):
    with pytest.raises(ValueError, match="nothing to aggregate"):
        strategy.aggregate(CURRENT, [])


def test_fedavg_zero_total_samples_is_an_error():
    with pytest.raises(ValueError, match="positive sum"):
        FedAvg().aggregate(CURRENT, results(THREE, [0, 0, 0]))


def test_fedavg_negative_samples_is_an_error():
    with pytest.raises(ValueError, match="non-negative"):
        FedAvg().aggregate(CURRENT, results(THREE, [5, -1, 5]))


def test_strategies_have_no_server_state():
    for strategy in (MeanPooling(), FedAvg()):
        assert strategy.state() == {}
        strategy.load_state({})


# ---------------------------------------------------------------------------- registry
def test_make_strategy_by_name():
    assert isinstance(make_strategy("mean"), MeanPooling)
    assert isinstance(make_strategy("fedavg"), FedAvg)
    assert set(STRATEGIES) == {"mean", "fedavg", "fedadagrad", "fedyogi", "fedadam", "fedavgm",
                               "fedmedian", "fedtrimmedavg", "krum", "fedprox", "scaffold"}
    for name, cls in STRATEGIES.items():
        s = make_strategy(name)
        assert isinstance(s, Strategy) and type(s) is cls and s.name == name


@pytest.mark.parametrize("name", ["ditto", "FedAvg", "", "mean "])
def test_make_strategy_unknown_name_lists_known_ones(name):
    with pytest.raises(ValueError) as info:
        make_strategy(name)
    msg = str(info.value)
    assert repr(name) in msg
    assert ("known: fedadagrad, fedadam, fedavg, fedavgm, fedmedian, fedprox, fedtrimmedavg, "
            "fedyogi, krum, mean, scaffold") in msg
    assert "\n" not in msg


def test_make_strategy_refuses_unknown_parameters():
    with pytest.raises(ValueError, match="server_lr: fedavg takes no option 'server_lr'"):
        make_strategy("fedavg", server_lr=0.1)
    with pytest.raises(ValueError, match="eta: expected a number, got 'x'"):
        make_strategy("fedadam", eta="x")


# --------------------------------------------------------------------------------------------
# FedOpt: one step against a hand computation (Reddi et al. 2021, Algorithm 2)
# --------------------------------------------------------------------------------------------


def _one_step(strategy, current, clients, weights):
    results = [ClientResult(f"c{i}", {"x": np.array(c)}, n)
               for i, (c, n) in enumerate(zip(clients, weights, strict=True))]
    return strategy.aggregate({"x": np.array(current)}, results)["x"]


def test_fedadam_one_and_two_steps_by_hand():
    from master.strategies import FedAdam

    s = FedAdam(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    x = np.array([1.0, -2.0])
    # Clients [2, 0] (n=1) and [4, -4] (n=3): weighted mean [3.5, -3], delta [2.5, -1].
    got = _one_step(s, x, [[2.0, 0.0], [4.0, -4.0]], [1, 3])
    m = 0.1 * np.array([2.5, -1.0])
    v = 0.01 * np.array([2.5, -1.0]) ** 2
    np.testing.assert_allclose(got, x + 0.1 * m / (np.sqrt(v) + 1e-3))
    # Second step from the new point with the moments carried over.
    got2 = _one_step(s, got, [[got[0] + 1, got[1]]], [1])
    delta = np.array([1.0, 0.0])
    m2 = 0.9 * m + 0.1 * delta
    v2 = 0.99 * v + 0.01 * delta**2
    np.testing.assert_allclose(got2, got + 0.1 * m2 / (np.sqrt(v2) + 1e-3))


def test_fedyogi_one_step_by_hand():
    from master.strategies import FedYogi

    s = FedYogi(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)
    got = _one_step(s, [0.0], [[2.0]], [5])
    # v0 = 0: v = 0 - 0.01 * 4 * sign(0 - 4) = 0.04
    np.testing.assert_allclose(got, [0.01 * 0.2 / (np.sqrt(0.04) + 1e-3)])
    assert set(s.state()) == {"m/x", "v/x"}


def test_fedadagrad_one_step_by_hand_and_state_roundtrip():
    from master.strategies import FedAdagrad

    s = FedAdagrad(eta=0.1, tau=1e-9)
    got = _one_step(s, [1.0, 1.0], [[3.0, 0.0]], [1])
    delta = np.array([2.0, -1.0])
    np.testing.assert_allclose(got, 1.0 + 0.1 * delta / (np.abs(delta) + 1e-9))
    again = FedAdagrad(eta=0.1, tau=1e-9)
    again.load_state(s.state())
    np.testing.assert_array_equal(again.v_["x"], s.v_["x"])


def test_fedopt_keeps_dtype_and_refuses_bad_parameters():
    from master.strategies import FedAdam

    got = _one_step(FedAdam(), np.zeros(3, dtype=np.float32),
                    [np.ones(3, dtype=np.float32)], [1])
    assert got.dtype == np.float32
    with pytest.raises(ValueError, match="eta"):
        FedAdam(eta=0)
    with pytest.raises(ValueError, match="beta_1"):
        FedAdam(beta_1=1.0)
    assert make_strategy("fedyogi", eta=0.5).eta == 0.5


def test_blocked_average_equals_the_plain_formula_across_block_edges(monkeypatch) -> None:
    import common.aggregate as agg

    monkeypatch.setattr(agg, "CHUNK", 7)  # 7 does not divide 5 x 13: a short last block
    rng = np.random.default_rng(3)
    clients = [{"w": rng.normal(size=(5, 13)).astype(np.float32),
                "n": np.arange(4, dtype=np.int64) * i} for i in range(1, 4)]
    got = agg.weighted_average(clients, [1.0, 2.0, 5.0])
    w = np.array([1.0, 2.0, 5.0]) / 8.0
    assert got["w"].dtype == np.float32 and got["w"].shape == (5, 13)
    pairs = list(zip(w, clients, strict=True))
    # float32 accumulation: each element within a few float32 ulps of the terms' scale (an
    # element near 0 after cancellation has no tighter relative bound).
    np.testing.assert_allclose(got["w"], sum(wi * c["w"] for wi, c in pairs), rtol=1e-6,
                               atol=1e-6)
    # Integer arrays are averaged in float64 and truncated, as before the blocking.
    np.testing.assert_array_equal(got["n"], sum(wi * c["n"] for wi, c in pairs).astype(np.int64))


def test_all_finite_finds_a_nan_in_any_block(monkeypatch) -> None:
    import common.aggregate as agg

    monkeypatch.setattr(agg, "CHUNK", 4)
    a = np.zeros(11, dtype=np.float32)
    assert agg.all_finite(a) and agg.all_finite(np.zeros(0)) and agg.all_finite(a[:, None])
    for i in (0, 3, 4, 10):
        b = a.copy()
        b[i] = np.nan if i % 2 else np.inf
        assert not agg.all_finite(b), i
    assert agg.all_finite(np.arange(5))  # integers are always finite


# ---------------------------------------------------------------------------- BufferPool
def test_buffer_pool_recycles_only_what_nobody_holds():
    pool = BufferPool(size=3)
    first = weighted_average(THREE, [1, 1, 2], pool=pool)
    held = first["x"]
    del first
    second = weighted_average(THREE, [1, 0, 0], pool=pool)
    # The first result is still referenced: the second must not have overwritten it.
    np.testing.assert_allclose(held, [14 / 4, 18 / 4])
    np.testing.assert_allclose(second["x"], [1.0, 2.0])
    assert not np.shares_memory(held, second["x"])
    del held
    third = weighted_average(THREE, [0, 0, 1], pool=pool)
    np.testing.assert_allclose(third["x"], [5.0, 6.0])
    # Recycled: the first result's memory, now that nothing references it.
    assert len(pool._buffers["x"]) == 2


def test_buffer_pool_results_are_read_only_and_a_derived_view_keeps_them():
    pool = BufferPool()
    out = weighted_average(THREE, [1, 1, 2], pool=pool)["x"]
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 0.0
    flat = out.reshape(-1)[:1]  # a view of a view references the memory's owner
    del out
    again = weighted_average(THREE, [1, 0, 0], pool=pool)["x"]
    assert not np.shares_memory(flat, again)
    np.testing.assert_allclose(flat, [14 / 4])


def test_buffer_pool_is_bounded_when_everything_is_held():
    pool = BufferPool(size=2)
    kept = [weighted_average(THREE, [1, 1, 1], pool=pool)["x"] for _ in range(5)]
    assert len(pool._buffers["x"]) == 2
    for k in kept:
        np.testing.assert_allclose(k, [3.0, 4.0])


# ---------------------------------------------------------------------------- robust and momentum
def _one(values: list[float], ns: list[int] | None = None) -> list[ClientResult]:
    return results([{"x": np.array([v], dtype=np.float32)} for v in values],
                   ns or [1] * len(values))


def test_fedavgm_two_steps_by_hand_and_state_roundtrip():
    from master.strategies import FedAvgM

    clients = results([{"x": np.array([3.0, 4.0])}, {"x": np.array([5.0, 6.0])}], [1, 3])
    s = FedAvgM(server_learning_rate=0.5, server_momentum=0.9)
    # mean (4.5, 5.5); delta = x - mean = -3.5; v = delta; x = x - 0.5 v = (2.75, 3.75)
    x1 = s.aggregate({"x": np.array([1.0, 2.0])}, clients)
    np.testing.assert_allclose(x1["x"], [2.75, 3.75])
    again = FedAvgM(server_learning_rate=0.5, server_momentum=0.9)
    again.load_state(s.state())
    # delta = (2.75 - 4.5) = -1.75; v = 0.9 (-3.5) - 1.75 = -4.9; x = 2.75 + 2.45 = 5.2
    x2 = again.aggregate(x1, clients)
    np.testing.assert_allclose(x2["x"], [5.2, 6.2])
    # The defaults are FedAvg.
    np.testing.assert_allclose(FedAvgM().aggregate({"x": np.array([1.0, 2.0])}, clients)["x"],
                               FedAvg().aggregate({}, clients)["x"])
    with pytest.raises(ValueError, match="server_momentum"):
        FedAvgM(server_momentum=1.0)


def test_fedmedian_by_hand_ignores_claimed_sample_counts():
    out = make_strategy("fedmedian").aggregate({}, results(
        [{"x": np.array([1.0, 10.0])}, {"x": np.array([2.0, 20.0])},
         {"x": np.array([100.0, -5.0])}], [1, 1, 10**6]))
    np.testing.assert_array_equal(out["x"], [2.0, 10.0])
    four = make_strategy("fedmedian").aggregate({}, _one([1, 2, 3, 100]))
    assert four["x"].dtype == np.float32 and four["x"][0] == 2.5


def test_trimmed_mean_cuts_int_beta_n_from_each_end():
    assert make_strategy("fedtrimmedavg").aggregate({}, _one([4, 1, 100, 3, 2]))["x"][0] == 3
    # beta 0.1 of 5 cuts int(0.5) = 0 values: the plain mean
    assert make_strategy("fedtrimmedavg", beta=0.1).aggregate(
        {}, _one([4, 1, 100, 3, 2]))["x"][0] == 22
    with pytest.raises(ValueError, match="beta"):
        make_strategy("fedtrimmedavg", beta=0.5)


def test_krum_and_multi_krum_by_hand():
    from master.strategies import Krum

    # Squared distances on a line 0, 1, 2, 10; n - f - 2 = 2 nearest: scores 5, 2, 5, 145.
    four = _one([0, 1, 2, 10], [1, 1, 1, 1])
    krum = Krum()
    assert krum.aggregate({}, four)["x"][0] == 1 and krum.last_kept_ == ["w2"]
    # Multi-Krum keeps the best two, w2 and (tied with w3, first in worker order) w1.
    multi = Krum(num_clients_to_keep=2)
    assert multi.aggregate({}, four)["x"][0] == 0.5 and multi.last_kept_ == ["w2", "w1"]
    # f = 1: one nearest neighbour each: scores 1, 1, 1, 64
    assert Krum(num_malicious_clients=1).aggregate({}, four)["x"][0] == 0
    with pytest.raises(ValueError, match="num_malicious_clients"):
        Krum(num_malicious_clients=-1)


@pytest.mark.parametrize("name, params", [("fedmedian", {}), ("fedtrimmedavg", {"beta": 0.2}),
                                          ("krum", {"num_malicious_clients": 1})])
def test_one_hostile_client_of_five_cannot_move_a_robust_rule(name, params):
    """Four honest updates near 1, one sign-flipped and scaled x10 (claiming many samples):
    FedAvg goes far off; the robust rules stay within the honest ones' range."""
    rng = np.random.default_rng(0)
    honest = [{"x": (1 + 0.05 * rng.standard_normal(50)).astype(np.float32)} for _ in range(4)]
    hostile = {"x": -10 * honest[0]["x"]}
    clients = results([*honest, hostile], [100, 100, 100, 100, 1000])
    low = np.min([h["x"] for h in honest], axis=0)
    high = np.max([h["x"] for h in honest], axis=0)
    assert (FedAvg().aggregate({}, clients)["x"] < 0).all()
    out = make_strategy(name, **params).aggregate({}, clients)["x"]
    assert ((out >= low) & (out <= high)).all()


def test_scaffold_two_rounds_by_hand_and_state_roundtrip():
    from common.constants import SCAFFOLD_CHANGE, SCAFFOLD_CONTROL
    from master.strategies import Scaffold

    s = Scaffold()
    current = {"x": np.array([1.0, 2.0], dtype=np.float32)}
    assert s.client_arrays(current) == {SCAFFOLD_CONTROL + "x": pytest.approx([0.0, 0.0])}
    assert s.upload_arrays(current) == {SCAFFOLD_CHANGE + "x": ((2,), np.dtype(np.float32))}

    def result(wid, y, n, dc):
        return ClientResult(wid, {"x": np.array(y, np.float32)}, n,
                            {SCAFFOLD_CHANGE + "x": np.array(dc, np.float32)})

    # x = the sample-weighted mean (eta_g 1); c += |S|/N mean(dc) = 1 * (1 + 3) / 2
    x1 = s.aggregate(current, [result("w1", [3, 4], 1, [1, 1]), result("w2", [5, 6], 3, [3, 3])])
    np.testing.assert_allclose(x1["x"], [4.5, 5.5])
    np.testing.assert_allclose(s.control_["x"], [2.0, 2.0])
    again = Scaffold(server_learning_rate=0.5)
    again.load_state(s.state())
    assert again.seen_ == {"w1", "w2"}
    # Only w1 of the two reports: c += 1/2 * 2; x moves half way (eta_g 0.5) to w1's 6.5
    x2 = again.aggregate(x1, [result("w1", [6.5, 7.5], 1, [2, 2])])
    np.testing.assert_allclose(x2["x"], [5.5, 6.5])
    np.testing.assert_allclose(again.control_["x"], [3.0, 3.0])
    assert again.client_settings() == {"scaffold": True}


def test_nearest_neighbor_mixing_by_hand():
    from common.aggregate import nearest_neighbor_mixing

    four = [{"x": np.array([v], np.float32)} for v in (0.0, 1.0, 2.0, 10.0)]
    # f = 1: each the mean of its 3 nearest, itself first; ties to the first in order.
    # 0 -> {0,1,2}; 1 -> {1,0,2}; 2 -> {2,1,0}; 10 -> {10,2,1}
    mixed = [m["x"][0] for m in nearest_neighbor_mixing(four, 1)]
    assert mixed == pytest.approx([1.0, 1.0, 1.0, 13 / 3])
    assert [m["x"].dtype for m in nearest_neighbor_mixing(four, 1)] == [np.float32] * 4
    # the robust rules on the mixed values: median of 1, 1, 1, 13/3 is 1 (plain: 1.5)
    assert make_strategy("fedmedian").aggregate({}, _one([0, 1, 2, 10]))["x"][0] == 1.5
    assert make_strategy("fedmedian", num_malicious_clients=1, mixing=True).aggregate(
        {}, _one([0, 1, 2, 10]))["x"][0] == pytest.approx(1.0)
    # f >= n - 1: each keeps only itself, the rule is unchanged
    assert make_strategy("fedtrimmedavg", beta=0.25, num_malicious_clients=3, mixing=True
                         ).aggregate({}, _one([0, 1, 2, 10]))["x"][0] == 1.5


@pytest.mark.parametrize("name, params", [("fedmedian", {}), ("fedtrimmedavg", {"beta": 0.2}),
                                          ("krum", {})])
def test_mixing_makes_one_hostile_client_of_five_cost_nothing(name, params):
    """Four honest updates spread apart (skewed data), one sign-flipped x10: plain, a robust
    rule lands on one honest update or an order statistic of them; mixed (f = 1), each honest
    update becomes the honest mean and the rule returns it."""
    rng = np.random.default_rng(1)
    honest = [{"x": (1 + 0.3 * rng.standard_normal(50)).astype(np.float32)} for _ in range(4)]
    clients = results([*honest, {"x": -10 * honest[0]["x"]}], [100] * 5)
    mean = np.mean([h["x"] for h in honest], axis=0)
    plain = make_strategy(name, num_malicious_clients=1, **params).aggregate({}, clients)["x"]
    mixed = make_strategy(name, num_malicious_clients=1, mixing=True, **params).aggregate(
        {}, clients)["x"]
    assert np.abs(plain - mean).max() > 0.05
    np.testing.assert_allclose(mixed, mean, atol=1e-6)


@pytest.mark.parametrize("params, match", [
    ({"mixing": True}, "mixing needs num_malicious_clients >= 1"),
    ({"mixing": "yes", "num_malicious_clients": 1}, "mixing must be true or false"),
    ({"num_malicious_clients": -1}, "num_malicious_clients must be an integer >= 0")])
@pytest.mark.parametrize("name", ["fedmedian", "fedtrimmedavg", "krum"])
def test_mixing_settings_are_checked_in_one_line(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(name, **params)


@pytest.mark.parametrize("name, options, few, enough", [
    ("krum", {}, 2, 3), ("krum", {"num_malicious_clients": 1}, 4, 5),
    ("fedmedian", {}, 2, 3), ("fedtrimmedavg", {}, 4, 5),
    ("fedtrimmedavg", {"beta": 0.1}, 9, 10)])
def test_a_robust_rule_says_when_its_updates_are_too_few_to_protect_anything(
        name: str, options: dict, few: int, enough: int, tmp_path: Path) -> None:
    """Krum of two (a tie, taken by the first worker), the median of two (their mean), a trim
    that cuts nothing: a user who chose a robust rule is told, at `fedctl check` and the
    master's start, that it protects nothing with so few workers a round."""
    from common.config import parse_config
    from master.families import make_server_family

    def notes(n: int) -> list[str]:
        raw = {"master": {"host": "127.0.0.1"}, "workers": [f"w{i}" for i in range(n)],
               "model": {"family": "mlp"}, "strategy": {"name": name, **options},
               "data": {"path": "data.jsonl"}}
        return make_server_family(parse_config(raw, str(tmp_path / "c.yaml"))).notes
    assert any(f"strategy {name} " in note and f"{few} update(s)" in note
               for note in notes(few)), notes(few)
    assert not any(name in note for note in notes(enough))
