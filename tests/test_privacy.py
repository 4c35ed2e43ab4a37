"""Differential privacy (docs/PRIVACY.md): the accountant against Opacus's own, DP-SGD's
per-document clipping on real documents, DP-FedAvg's bound and noise, the refusals, and real
clusters over loopback that report ε every round and stop at ``target_epsilon``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from common.config import ConfigError, parse_config
from common.models.mlp import MLPClassifier
from common.privacy.dp import DPSGDParams, clip_update, epsilon, sgd_sample_rate
from master.families import make_server_family
from master.strategies import ClientResult
from master.strategies.dpfedavg import DPFedAvg
from tests.conftest import ROOT, MakeConfig, events, run_fedctl, run_job

DATA = ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"


@pytest.mark.parametrize("sigma, q, steps", [(1.1, 0.01, 1000), (0.8, 0.3, 40), (2.0, 1.0, 7)])
def test_epsilon_is_opacus_accountants_own(sigma: float, q: float, steps: int) -> None:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    assert epsilon(sigma, q, steps, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5),
                                                           rel=1e-12)
    assert epsilon(sigma, q, 0, 1e-5) == 0.0
    # More steps, more ε; more noise or a smaller sample, less.
    assert epsilon(sigma, q, steps + 1, 1e-5) > epsilon(sigma, q, steps, 1e-5)
    assert epsilon(2 * sigma, q, steps, 1e-5) < epsilon(sigma, q, steps, 1e-5)


def _real_batch(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Real documents: the bundled abstracts' embeddings (the real sentence model, cached by
    the session) would take a minute; their TF-IDF projections are real text features too."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    x = TfidfVectorizer(max_features=384).fit_transform([r["text"] for r in rows])
    y = np.array([r["label"] == rows[0]["label"] for r in rows], dtype=np.int64)
    return np.asarray(x.todense(), dtype=np.float32), y


def test_dp_sgd_clips_every_documents_gradient() -> None:
    """With every document in every step (q = 1), plain SGD and noise near 0, a step moves the
    weights by lr · (Σ clipped gradients) / batch: at most lr · C, however large the raw
    gradients, which here are many times C."""
    import torch

    x, y = _real_batch()
    bound = 1e-3
    model = MLPClassifier(x.shape[1], 2, hidden=16, batch_size=len(y), optimizer="sgd", lr=1.0,
                          dp=DPSGDParams(noise_multiplier=1e-9, max_grad_norm=bound))
    start = [p.detach().clone() for p in model.model_.parameters()]
    raw = torch.nn.functional.cross_entropy(model.model_(torch.as_tensor(x)), torch.as_tensor(y))
    grads = torch.autograd.grad(raw, list(model.model_.parameters()))
    assert math.sqrt(sum(float((g ** 2).sum()) for g in grads)) > 10 * bound
    model.fit(x, y, epochs=1)  # one step: ceil(n / batch)
    assert model.dp_steps_ == 1
    moved = math.sqrt(sum(float(((p.detach() - s) ** 2).sum())
                          for p, s in zip(model.model_.parameters(), start, strict=True)))
    assert 0 < moved <= bound * (1 + 1e-4)
    assert list(model.get_arrays()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_dp_sgd_noise_is_not_the_seeds() -> None:
    """Two classifiers of the same random_state start alike but draw different noise."""
    x, y = _real_batch()
    a, b = (MLPClassifier(x.shape[1], 2, hidden=16, random_state=0, dp=DPSGDParams())
            for _ in range(2))
    assert all(np.array_equal(v, b.get_arrays()[k]) for k, v in a.get_arrays().items())
    a.fit(x, y)
    b.fit(x, y)
    assert not np.array_equal(a.get_arrays()["0.weight"], b.get_arrays()["0.weight"])


def test_dp_fedavg_clips_each_change_and_divides_by_the_expected_count() -> None:
    current = {"w": np.zeros(4, dtype=np.float32)}
    far = [ClientResult(w, {"w": np.full(4, v, dtype=np.float32)}, n)
           for w, v, n in (("a", 10.0, 1), ("b", -3.0, 1000), ("c", 0.01, 5))]
    plain = DPFedAvg(clip=1.0, noise_multiplier=0.0, expected_clients=4)
    out = plain.aggregate(current, far)
    # Each change clipped to norm 1 (c's is 0.02, kept), equal weights, over m = 4.
    expected = (np.full(4, 0.5) - np.full(4, 0.5) + np.full(4, 0.01)) / 4
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)
    assert plain.clipped_norms_ == pytest.approx([20.0, 6.0, 0.02])
    # The noise: N(0, (σC)²) on the sum, so σC / m on the mean.
    noisy = DPFedAvg(clip=0.5, noise_multiplier=2.0, expected_clients=4)
    zeros = {"w": np.zeros(200_000, dtype=np.float32)}
    drawn = noisy.aggregate(zeros, [ClientResult("a", zeros, 1)])["w"]
    assert np.std(drawn) == pytest.approx(2.0 * 0.5 / 4, rel=0.01)
    # Its generator is checkpointed: a restored one draws the same noise.
    again = DPFedAvg(clip=0.5, noise_multiplier=2.0, expected_clients=4)
    again.load_state(noisy.state())
    np.testing.assert_array_equal(noisy.aggregate(zeros, [ClientResult("a", zeros, 1)])["w"],
                                  again.aggregate(zeros, [ClientResult("a", zeros, 1)])["w"])


def test_clip_update_bounds_the_change_not_the_weights() -> None:
    base = {"a": np.full(3, 100.0, dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}
    new = {"a": base["a"] + 3, "b": np.full(2, 4.0, dtype=np.float32)}
    clipped, norm = clip_update(new, base, 1.0)
    assert norm == pytest.approx(math.sqrt(3 * 9 + 2 * 16))
    change = math.sqrt(sum(float(((clipped[k] - base[k]).astype(np.float64) ** 2).sum())
                           for k in base))
    assert change == pytest.approx(1.0, rel=1e-5) and clipped["a"].dtype == np.float32


@pytest.mark.parametrize("model, privacy, refusal", [
    ({"family": "nmf"}, {"dp_sgd": {}}, "privacy.dp_sgd: nmf cannot take it"),
    ({"family": "prodlda"}, {"dp_sgd": {}}, "batch norm"),
    ({"family": "fstc"}, {"client_dp": {}}, "privacy.client_dp: fstc cannot take it"),
    ({"family": "lda"}, {"dp_sgd": {}}, "privacy.laplace"),
    ({"family": "prodlda", "mode": "sync"}, {"client_dp": {}}, "mode sync"),
])
def test_a_privacy_a_family_cannot_honour_is_refused_in_one_line(model, privacy, refusal,
                                                                  tmp_path: Path) -> None:
    cfg = parse_config({"model": model, "workers": ["w1", "w2"], "rounds": 10,
                        "privacy": privacy, "data": {"path": str(tmp_path / "x.jsonl")}},
                       source="c.yaml")
    with pytest.raises(ConfigError, match=refusal) as info:
        make_server_family(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("extra, refusal", [
    ({"privacy": {"dp_sgd": {"noise_multiplier": 0}}}, "noise_multiplier: expected"),
    ({"privacy": {"delta": 2}}, "privacy.delta"),
    ({"privacy": {"dp_sgd": {"clip": 1}}}, "privacy.dp_sgd.clip: unknown field"),
    ({"privacy": {"client_dp": {}}, "strategy": "fedadam"}, "DP-FedAvg replaces"),
    ({"privacy": {"dp_sgd": {}}, "strategy": {"name": "fedprox", "proximal_mu": 0.1}},
     "no place in DP-SGD"),
    ({"privacy": {"laplace": {"epsilon": 2}}}, "topic models'"),
])
def test_fedctl_check_refuses_a_bad_privacy_section(extra, refusal, tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"workers": ["w1", "w2"], "model": {"family": "mlp"},
                                    "data": {"path": str(DATA)}, **extra}))
    done = run_fedctl("check", "-c", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("Error:")]
    assert refusal in line, line


def test_fedctl_check_says_what_privacy_a_file_asks_for() -> None:
    done = run_fedctl("check", "-c", str(ROOT / "examples" / "mlp_dp.yaml"))
    assert done.returncode == 0, done.stderr
    assert ("Privacy: record-level DP-SGD (σ 1.9, per-document clip 1), ε at δ 1e-05, training "
            "ends before ε passes 8.") in done.stdout, done.stdout
    assert "In the clear all the same: the round's metrics and sample counts" in done.stdout


def test_fedctl_check_says_what_no_privacy_mechanism_covers() -> None:
    """iFTM's Laplace noise is on the document–topic counts; the vocabulary and the
    word–topic counts leave exact, and check says so rather than let ε seem to cover them."""
    done = run_fedctl("check", "-c", str(ROOT / "examples" / "lda_privacy.yaml"), "--no-ports")
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert "iFTM's Laplace noise (ε 11) on each party's document–topic counts" in said, said
    assert "vocabulary, every word with its term and document counts" in said, said
    assert "the word–topic counts, exactly" in said, said
    # The noise is on by default (ε 11), and off at 0: check said nothing, then "ε 0".
    default = run_fedctl("check", "-c", str(ROOT / "examples" / "lda_privacy.yaml"),
                         "--no-ports", "--set", "privacy={}").stdout
    assert "iFTM's Laplace noise (ε 11)" in default, default
    off = run_fedctl("check", "-c", str(ROOT / "examples" / "lda_privacy.yaml"), "--no-ports",
                     "--set", "privacy={}", "--set", "model.epsilon=0").stdout
    assert "Privacy:" not in off, off


def test_laplace_moves_under_privacy_with_its_meaning(tmp_path: Path) -> None:
    base = {"workers": ["w1"], "data": {"path": str(tmp_path / "x.jsonl")}}
    cfg = parse_config({**base, "model": {"family": "lda"},
                        "privacy": {"laplace": {"epsilon": 3.0, "tau": 0.1}}}, "c.yaml")
    assert cfg.family_params == {"epsilon": 3.0, "tau": 0.1}
    with pytest.raises(ConfigError, match="write it once"):
        parse_config({**base, "model": {"family": "lda", "epsilon": 5.0},
                      "privacy": {"laplace": {"epsilon": 3.0}}}, "c.yaml")


def _round_epsilons(out: Path, key: str) -> list[float]:
    return [e[key] for e in events(out, "round")]


@pytest.mark.slow
def test_dp_sgd_cluster_reports_each_workers_epsilon_and_stops_at_the_target(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path) -> None:
    batch, sigma, delta, target = 32, 1.0, 1e-5, 6.0
    config = make_config(tmp_path, workers=2, rounds=30,
                         model={"family": "mlp", "hidden": 16, "batch_size": batch, "lr": 0.01},
                         privacy={"dp_sgd": {"noise_multiplier": sigma, "max_grad_norm": 1.0},
                                  "delta": delta, "target_epsilon": target})
    run_job(config, tmp_path / "logs", embed_cache, ("w1", "w2"))
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    n = {r["worker"]: r["n_train"] for r in summary["comparison"]}
    rounds = summary["rounds"]

    def eps(w: str, r: int) -> float:  # the library's own, from each worker's document count
        return epsilon(sigma, sgd_sample_rate(batch, n[w]), r * math.ceil(n[w] / batch), delta)

    # Every round's ε is the largest worker's after that round; the run ended at the last
    # round whose successor would pass the target.
    assert _round_epsilons(out, "epsilon") == pytest.approx(
        [max(eps(w, r) for w in n) for r in range(1, rounds + 1)], rel=1e-9)
    assert 1 < rounds < 30
    assert max(eps(w, rounds) for w in n) <= target < max(eps(w, rounds + 1) for w in n)
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(max(eps(w, rounds) for w in n))
    assert "past target_epsilon 6" in privacy["stopped"]
    assert "privacy budget: one more round" in (tmp_path / "logs" / "master.log").read_text()
    table = (out / "comparison.md").read_text()
    assert "Privacy: the federated model at record-level" in table


@pytest.mark.slow
def test_client_dp_cluster_clips_updates_and_counts_rounds(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path) -> None:
    """Half the workers sampled a round: the accountant counts that sampling (rate 0.5)."""
    clip, sigma = 0.05, 0.5
    config = make_config(tmp_path, workers=2, rounds=3, client_fraction=0.5,
                         model={"family": "mlp", "hidden": 16},
                         privacy={"client_dp": {"clip": clip, "noise_multiplier": sigma}})
    run_job(config, tmp_path / "logs", embed_cache, ("w1", "w2"))
    out = tmp_path / "out"
    assert [e["n_updates"] for e in events(out, "round")] == [1, 1, 1]
    assert _round_epsilons(out, "client_epsilon") == pytest.approx(
        [epsilon(sigma, 0.5, r, 1e-5) for r in (1, 2, 3)], rel=1e-9)
    assert epsilon(sigma, 0.5, 3, 1e-5) < epsilon(sigma, 1.0, 3, 1e-5)
    # Each worker measured its change before clipping it; one epoch moves far more than 0.05.
    norms = [e["update_norm"] for e in events(out, "worker_round")]
    assert len(norms) == 3 and min(norms) > clip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["client_dp"] == {"clip": clip, "noise_multiplier": sigma}


@pytest.mark.slow
def test_a_target_the_first_round_would_pass_never_starts(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path, procs) -> None:
    config = make_config(tmp_path, workers=2, rounds=3, model={"family": "mlp", "hidden": 16},
                         privacy={"dp_sgd": {"noise_multiplier": 0.3}, "target_epsilon": 1.0})
    master = procs.master(config)
    for w in ("w1", "w2"):
        procs.worker(config, w)
    assert master.wait(timeout=300) != 0
    said = procs.log("master")
    assert "the first round would take" in said and "past target_epsilon 1" in said, said
    assert not events(tmp_path / "out", "round")


def test_a_claimed_epsilon_no_honest_worker_could_reach_does_not_end_the_job() -> None:
    """A worker reports its own ε; one claiming more than its registered documents allow
    after the rounds so far (which would end training for everyone) is taken at that most,
    while an honest claim past the target still ends the job."""
    from common.privacy.dp import epsilon, sgd_sample_rate, sgd_steps_per_round
    from master.privacy import PrivacyLedger

    cfg = parse_config({"workers": ["w1", "w2", "w3"], "rounds": 50,
                        "privacy": {"dp_sgd": {"noise_multiplier": 1.0},
                                    "target_epsilon": 8.0}}, "<test>")
    ledger = PrivacyLedger(cfg.privacy, cfg.client_fraction)
    n, batch, epochs = 1000, 64, 1
    assert ledger.first_round_refusal({"w1": n, "w2": n}, batch, epochs) is None

    def honest(rounds: int) -> float:
        return epsilon(1.0, sgd_sample_rate(batch, n),
                       rounds * sgd_steps_per_round(batch, n, epochs), cfg.privacy.delta)

    ledger.record({"w1": {"epsilon": honest(1), "epsilon_next": 1e12},
                   "w2": {"epsilon": honest(1), "epsilon_next": honest(2)}}, 1)
    assert not ledger.must_stop(1)
    # A worker the job did not start with (joined late; any, after a resume) is bounded by the
    # sizes the master gives with its metrics: it was believed, and ended the job in round 2.
    ledger.record({"w3": {"epsilon": honest(1), "epsilon_next": 1e6}}, 1,
                  {"w3": (n, batch, epochs)})
    assert not ledger.must_stop(1)
    # The ε the run states is bounded alike: a claim of 1e12 made the statement say 1e12.
    stated = ledger.record({"w1": {"epsilon": 1e12, "epsilon_next": honest(2)}}, 1)
    assert stated["epsilon"] == pytest.approx(honest(1)), stated
    rounds = next(r for r in range(2, 1000) if honest(r + 1) > 8.0)
    ledger.record({w: {"epsilon": honest(rounds), "epsilon_next": honest(rounds + 1)}
                   for w in ("w1", "w2")}, rounds)
    assert ledger.must_stop(rounds) and "past target_epsilon 8" in ledger.stopped_


def test_client_level_epsilon_is_counted_at_the_rate_workers_are_drawn() -> None:
    """k = max(1, round(C·N)) of N workers a round: at C = 0.1 and 3 workers each is drawn at
    1/3, and ε is that rate's (it was C's: 4.2 after 20 rounds at σ = 1, where 1/3 gives 11.6).
    Under DP-FedAvg the draw ignores liveness: a down worker's chance does not go to the rest."""
    from common.privacy.dp import client_sample_rate, epsilon
    from master.privacy import PrivacyLedger
    from master.rounds import Roster

    assert client_sample_rate(0.1, 3) == pytest.approx(1 / 3)
    assert client_sample_rate(0.5, 4) == pytest.approx(0.5)
    assert client_sample_rate(1.0, 5) == 1.0
    cfg = parse_config({"workers": ["w1", "w2", "w3"], "rounds": 20, "client_fraction": 0.1,
                        "privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}},
                       "<test>")
    ledger = PrivacyLedger(cfg.privacy, cfg.client_fraction)
    assert ledger.first_round_refusal({"w1": 10, "w2": 10, "w3": 10}, 8, 1) is None
    said = ledger.record({}, 20)["client_epsilon"]
    assert said == pytest.approx(epsilon(1.0, 1 / 3, 20, cfg.privacy.delta), rel=1e-9)
    assert said > 2.5 * epsilon(1.0, 0.1, 20, cfg.privacy.delta)
    # Two of the three left: the rounds drew one of two, and what is stated counts that.
    ledger.note_workers(2)
    assert ledger.record({}, 20)["client_epsilon"] == pytest.approx(
        epsilon(1.0, 0.5, 20, cfg.privacy.delta), rel=1e-9)
    ledger.note_workers(3)  # the highest rate stays
    assert ledger.client_epsilon(20) == pytest.approx(epsilon(1.0, 0.5, 20, cfg.privacy.delta))
    # A resumed master's ledger takes the checkpoint's rate (it said client_fraction's).
    resumed = PrivacyLedger(cfg.privacy, cfg.client_fraction)
    resumed.note_rate(ledger.client_rate_)
    assert resumed.summary(20)["client_epsilon"] == pytest.approx(ledger.client_epsilon(20))

    roster = Roster(heartbeat_timeout=5.0, client_fraction=0.5, seed=0, among_live=False)
    for w in ("w1", "w2", "w3", "w4"):
        roster.add(w, 10, "cpu", {})
    roster.workers["w1"].last_seen -= 60  # down
    drawn = [w for _ in range(400) for w in roster.sample()]
    assert 0.4 < drawn.count("w1") / 400 < 0.6  # still drawn at k/N = 1/2
    # A round that drew only down workers closes at its deadline rather than wait for ever.
    from master.rounds import RoundState, may_close

    now = time.monotonic()
    rnd = RoundState(7, now, now + 10, ["w1"])
    assert not may_close(rnd, roster, 1, now + 1)
    assert may_close(rnd, roster, 1, now + 11)
    live_only = Roster(heartbeat_timeout=5.0, client_fraction=0.5, seed=0)
    for w in ("w1", "w2", "w3", "w4"):
        live_only.add(w, 10, "cpu", {})
    live_only.workers["w1"].last_seen -= 60
    assert all("w1" not in live_only.sample() for _ in range(50))


def test_going_back_to_an_earlier_round_never_draws_its_noise_again() -> None:
    """A worker sent round 2's update from model A; a resumed (or lying) master asks for round
    2 again from model B. Replayed with the snapshot's noise, the two releases would differ by
    the clipped gradients alone (the noise cancels); the worker goes back as
    ``Worker._go_back`` does, keeping its privacy stream, so the noise is fresh and the steps
    count twice."""
    x, y = _real_batch()
    sigma = 50.0  # noise far above the clipped gradients: only fresh noise moves the release
    model = MLPClassifier(x.shape[1], 2, hidden=16, random_state=0, optimizer="sgd", lr=1.0,
                          batch_size=len(x),  # one plain step a round: the release is linear
                          dp=DPSGDParams(noise_multiplier=sigma, max_grad_norm=1.0))
    model.fit(x, y, epochs=1)
    snapshot = model.local_state()  # after round 1
    steps = model.dp_steps_
    start_a = model.get_arrays()
    start_b = {k: v + 0.01 for k, v in start_a.items()}

    def release(start: dict[str, np.ndarray]) -> np.ndarray:
        model.set_arrays(start)
        model.fit(x, y, epochs=1)
        return np.concatenate([(model.get_arrays()[k] - start[k]).ravel() for k in start])

    first = release(start_a)
    # What the worker did before: load the snapshot whole, noise stream included.
    model.load_local_state(snapshot)
    rewound = release(start_b)
    assert np.linalg.norm(rewound - first) < 0.1 * np.linalg.norm(first)
    # What it does now: the snapshot, but the privacy stream as it is.
    stream = model.privacy_stream()
    model.load_local_state(snapshot)
    model.resume_privacy_stream(stream)
    fresh = release(start_b)
    assert np.linalg.norm(fresh - first) > 0.5 * np.linalg.norm(first)
    assert model.dp_steps_ == stream["steps"] + steps  # the replay's steps count on top
