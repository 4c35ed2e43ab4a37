"""The checks on a round's values (master/screening.py), fair service's rate limiter, the
roster's reports and the metrics log's numbers."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from common import constants as C
from common.net import messages as M
from common.net.wire import ProtocolError
from master import screening
from master.rounds import RateLimiter
from master.strategies import ClientResult


def _model(scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": (scale * rng.normal(size=(30, 20))).astype(np.float32),
            "b": np.zeros(20, np.float32)}


def test_distance_and_norm_survive_float32_max_and_nan() -> None:
    base = _model()
    huge = {n: np.full_like(a, np.finfo(np.float32).max) for n, a in base.items()}
    assert screening.distance(huge, base) == math.inf
    nan = {n: np.full_like(a, np.nan) for n, a in base.items()}
    assert screening.norm(nan) == math.inf
    moved = {n: a + 1 for n, a in base.items()}
    assert screening.distance(moved, base) == pytest.approx(math.sqrt(30 * 20 + 20), rel=1e-5)


def test_outliers_need_three_updates_and_use_the_lower_median() -> None:
    assert screening.outliers({"w1": 1e30, "w2": 1.0}) == {}  # two: nothing says which
    assert set(screening.outliers({"w1": math.inf, "w2": 1.0})) == {"w1"}
    out = screening.outliers({"w1": 1e30, "w2": 1.0, "w3": 1.3})
    assert set(out) == {"w1"} and "median" in out["w1"]
    # Honest spread (a factor of a few) is not an outlier; a near-zero update moves nothing.
    assert screening.outliers({"w1": 5.0, "w2": 1.0, "w3": 2.0, "w4": 0.0}) == {}


def test_an_exploding_or_non_finite_aggregate_is_a_problem() -> None:
    before = _model()
    assert screening.aggregate_problem(before, _model(2.0)) is None
    assert "100 times" in screening.aggregate_problem(before, _model(1e3))
    nan = {n: np.full_like(a, np.nan) for n, a in before.items()}
    assert "NaN" in screening.aggregate_problem(before, nan)
    # A value finite in float64 that a float32 worker could not square (phase statistics
    # have no model to grow from); the check looks at values only past the norm's bound.
    stats = {"sum_g": np.array([1e30, 1.0])}
    assert "float32 worker can square" in screening.aggregate_problem({}, stats)
    assert screening.aggregate_problem({}, {"sum_g": np.full(10**4, 1e17)}) is None
    # A model that grows by design (other arrays) is only checked for being finite.
    assert screening.aggregate_problem({"t": np.zeros((0, 5), np.float32)},
                                       {"t": np.full((3, 5), 1e6, np.float32)}) is None


def test_growth_is_held_over_a_window_of_published_models() -> None:
    window = screening.GrowthWindow(rounds=3)
    model = {"w": np.ones(4)}
    # Each under the limit against the model it replaces; the third is 2,500 x the first
    # published (the model the job started from is not in the window: honest training moves
    # furthest from it).
    for factor in (50.0, 50.0, 50.0):
        grown = {"w": model["w"] * factor}
        problem = window.problem(model, grown)
        if problem is None:
            window.published()
            model = grown
    assert problem is not None and "smallest of the last" in problem
    assert window.problem(model, {"w": model["w"] * 1.5}) is None  # honest growth passes
    window.published()
    # A model of another form has its own window: 20 x its own is no growth past the limit,
    # whatever the floor of the first form's (100; 28,284 is past 100 x that).
    assert window.problem({"c": np.full(2, 1000.0)}, {"c": np.full(2, 20000.0)}) is None


def test_growth_just_under_the_window_once_a_window_stops_at_the_jobs_bound() -> None:
    """A member stepping 99 x once a window (and holding the model still between) compounded
    without end under the window alone; the job's smallest published model bounds it."""
    window = screening.GrowthWindow(rounds=3)
    model = {"w": np.ones(4)}
    assert window.problem(model, model) is None
    window.published()
    grew, refused = 1.0, None
    for rnd in range(12):
        factor = 99.0 if rnd % 3 == 0 else 1.0
        step = {"w": model["w"] * factor}
        refused = window.problem(model, step)
        if refused is not None:
            break
        window.published()
        model, grew = step, grew * factor
    assert refused is not None and "NORM_JOB_GROWTH_LIMIT" in refused, refused
    assert grew == 99.0**2 < C.NORM_JOB_GROWTH_LIMIT  # (a third 99 x step would pass it)


def test_a_model_shrunk_past_the_bounds_is_not_published() -> None:
    """One member of two sent the model times 1e-8 with a large weight: a model that small
    kept every honest aggregate after it past the growth bounds, for the rest of the job.
    Honest models shrank at most 1.3 x a round and 2.9 x over a job."""
    window = screening.GrowthWindow(rounds=3)
    model = {"w": np.ones(4)}
    assert window.problem(model, model) is None
    window.published()
    refused = window.problem(model, {"w": model["w"] * 1e-8})
    assert refused is not None and "under the model's" in refused, refused
    assert window.problem(model, {"w": model["w"] / 2}) is None  # honest shrinking passes
    # 99 x smaller a round for as long as a member rules the rounds: held by the window's
    # largest, then the job's
    shrunk = []
    for _ in range(8):
        step = {"w": model["w"] / 99}
        if window.problem(model, step) is not None:
            break
        window.published()
        model = step
        shrunk.append(step)
    assert len(shrunk) == 1  # (the window's largest: 99 x again is past 100 x under it)


def test_weight_caps_hold_every_share_at_most_the_fraction() -> None:
    results = [ClientResult(w, {}, n) for w, n in (("w1", 2**40), ("w2", 100), ("w3", 300))]
    assert [r.n_samples for r in screening.cap_weights(results, None)] == [2**40, 100, 300]
    capped = screening.cap_weights(results, 0.5)
    weights = np.array([r.n_samples for r in capped], dtype=float)
    shares = weights / weights.sum()
    assert shares.max() <= 0.5 + 1e-12 and shares[0] == pytest.approx(0.5)
    assert shares[1] / shares[2] == pytest.approx(100 / 300)  # the others keep their ratio
    even = screening.cap_weights(results, 0.2)  # cannot be met by 3: all weigh the same
    assert {r.n_samples for r in even} == {1}


def test_rate_limiter_grants_a_burst_then_the_rate() -> None:
    limiter = RateLimiter(rate=10, burst=5)
    assert all(limiter.allow("w1", now=0.0) for _ in range(5))
    assert not limiter.allow("w1", now=0.0)
    assert limiter.allow("w2", now=0.0)  # one sender's flood is its own
    assert limiter.allow("w1", now=0.1) and not limiter.allow("w1", now=0.1)


@pytest.mark.parametrize("kind, body", [
    ("register", {"worker_id": "w1", "n_samples": 2**63, "device": "cpu", "info": {}}),
    ("register", {"worker_id": "w1", "n_samples": 1, "device": "cpu\nFORGED", "info": {}}),
    ("ping", {"worker_id": "w1\nFORGED"}),
    ("update", {"worker_id": "w1", "round": 1, "version": 0, "n_samples": 1,
                "metrics": {"train_time": True}}),
    ("update", {"worker_id": "w1", "round": 1, "version": 0, "n_samples": 1, "metrics": {},
                "sent_at": math.nan}),
])
def test_requests_with_values_that_cannot_be_right_are_refused(kind: str, body: dict) -> None:
    with pytest.raises(ProtocolError) as info:
        M.check_request(kind, body)
        M.check_metrics(body.get("metrics", {}), "update.metrics")
    assert info.value.code == "bad_field"


def test_an_updates_metrics_out_of_range_are_left_out_not_the_update() -> None:
    """An honest worker's loss on a model another member blew up passes MAX_METRIC, then
    float32's range: refusing its update for it blamed, then excluded, the honest member."""
    kept, dropped = M.in_range_metrics(
        {"loss": 1e13, "train_time": 1e308, "wait_s": -1.0, "f1": 0.5, "train_loss": math.inf,
         "nll": math.nan}, "update.metrics")
    assert kept == {"f1": 0.5} and dropped == ["loss", "train_time", "wait_s", "train_loss",
                                               "nll"]
    with pytest.raises(ProtocolError, match="finite number"):  # not a number at all
        M.in_range_metrics({"loss": "1"}, "update.metrics")
    with pytest.raises(ProtocolError, match="out of range"):  # a report's are refused
        M.check_metrics({"loss": 1e13}, "report.federated")


def test_a_report_takes_only_known_fields() -> None:
    with pytest.raises(ProtocolError, match="unknown field"):
        M.check_report({"federated": {"macro_f1": 0.5}, "junk": [[]]})
    M.check_report({"federated": {"macro_f1": 0.5}, "local_only": None, "n_train": 3,
                    "n_test": 1, "version": 2, "labelled": True})
    # A score outside its range (a macro-F1 of 1e12 made the table's mean row 3.3e11); a
    # score of no known range (a perplexity, a plug-in's) is only checked for being finite.
    for bad, message in (({"macro_f1": 1e12}, "macro_f1 1e+12 is outside [0, 1]"),
                         ({"accuracy": -0.1}, "accuracy -0.1 is outside [0, 1]"),
                         ({"npmi_doc": 1.5}, "npmi_doc 1.5 is outside [-1, 1]")):
        with pytest.raises(ProtocolError, match=re.escape(message)):
            M.check_report({"federated": bad})
    M.check_report({"federated": {"perplexity": 1e6, "npmi_doc": -0.2, "nmi": 1.0}})


def test_registering_again_cannot_take_back_a_report() -> None:
    from master.rounds import Roster

    roster = Roster(heartbeat_timeout=5, client_fraction=1.0, seed=0)
    roster.add("w2", 100, "cpu", {})
    roster.workers["w2"].report = {"federated": {"macro_f1": 0.9}}
    assert roster.add("w2", 100, "cpu", {}) is True
    assert roster.workers["w2"].report == {"federated": {"macro_f1": 0.9}}


def test_the_metrics_log_writes_no_nan_or_infinity(tmp_path) -> None:
    from common.runlog import MetricsLog, read_metrics

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write("round", loss=math.nan, scores=np.array([1.0, np.inf]), upload_s=np.float32(2))
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"event": "round", "loss": None, "scores": [1.0, None], "upload_s": 2.0}]


def test_growth_windows_come_back_from_their_state() -> None:
    window = screening.GrowthWindow(rounds=3)
    model = {"w": np.ones(4)}
    for factor in (50.0, 50.0):
        grown = {"w": model["w"] * factor}
        assert window.problem(model, grown) is None
        window.published()
        model = grown
    state = json.loads(json.dumps(window.state()))  # as a checkpoint keeps it
    again = screening.GrowthWindow(rounds=3)
    again.restore(state)
    step = {"w": model["w"] * 50}
    assert again.problem(model, step) is not None  # 125,000 x the window's first
    assert screening.GrowthWindow(rounds=3).problem(model, step) is None  # what an empty one let by
    for bad in ([[[["w", [4]]], [float("inf")], 1.0]], [[[["w", [4]]], [1.0], 0.0]],
                [[["w"], [1.0], 1.0]], [[[["w", [4]]], [1.0]]], 5):
        with pytest.raises(ValueError, match="growth windows are malformed"):
            again.restore(bad)


def test_with_fewer_than_three_updates_the_aggregated_rounds_are_the_reference() -> None:
    history = screening.DistanceHistory(rounds=3)
    form = screening.form_of({"w": np.zeros(4)})
    forms = {"w1": form, "w2": form}
    assert history.outliers({"w1": 1e17, "w2": 0.1}, forms) == {}  # nothing to compare yet
    history.aggregated({"w1": 0.1, "w2": 0.3}, forms)
    out = history.outliers({"w1": 1e17, "w2": 0.1}, forms)
    assert list(out) == ["w1"] and "too few updates" in out["w1"], out
    assert history.outliers({"w1": 5.9}, forms) == {}  # under 20 x 0.3: honest steps vary
    # what a member got accepted does not raise its next allowance (the window's smallest)
    history.aggregated({"w1": 5.7, "w2": 0.25}, forms)
    assert list(history.outliers({"w1": 19 * 5.7, "w2": 0.25}, forms)) == ["w1"]
    # nor can a member sending tiny changes lower it (each round's largest), nor alone
    history.aggregated({"w1": 1e-9, "w2": 0.3}, forms)
    history.aggregated({"w1": 1e-9}, forms)
    assert history.outliers({"w1": 1e-9, "w2": 0.35}, forms) == {}
    # another form (a synchronized step's next phase) has a history of its own
    other = screening.form_of({"g": np.zeros(2)})
    assert history.outliers({"w1": 50.0}, {"w1": other}) == {}
    # with three or more, the round's own median decides, as before
    three = {"w1": 1e17, "w2": 0.1, "w3": 0.2}
    assert list(history.outliers(three, {w: form for w in three})) == ["w1"]
    state = json.loads(json.dumps(history.state()))
    again = screening.DistanceHistory(rounds=3)
    again.restore(state)
    assert again.outliers({"w1": 7.0}, forms) != {}
    with pytest.raises(ValueError, match="update distances are malformed"):
        again.restore([[[["w", [4]]], [-1.0], 1.0]])


def test_a_negligible_round_or_sum_never_becomes_the_floor() -> None:
    """A synchronized step whose members all sat out (their zeros, and the ring's rounding:
    a secure sum of 4e-10) was recorded as the floor, and every honest step after it (12.8)
    was refused, redone and refused again until the budget ran out (5 of 20 steps trained,
    exit 0: a recovery test caught it one time in four)."""
    history = screening.DistanceHistory(rounds=3)
    form = screening.form_of({"w": np.zeros(4)})
    history.sum_aggregated(form, 3.0)
    history.sum_aggregated(form, 4.27e-10)
    assert history.sum_problem(form, 12.8) is None
    assert history.sum_problem(form, 61.0) is not None  # the real floor still holds
    forms = {"w1": form, "w2": form}
    history.aggregated({"w1": 0.2, "w2": 0.3}, forms)
    history.aggregated({"w1": 1e-9, "w2": 2e-9}, forms)
    assert history.outliers({"w1": 5.0}, forms) == {}
