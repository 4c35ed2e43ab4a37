"""A member cheating in a secure round (tests/secagg_hostile.py): a share it corrupts, a
commitment to another seed, a ring value past the top level. Real processes over TCP
loopback; each cheat was reproduced against the master before it was mended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common import constants as C
from fedctl.launch import child_env
from tests.conftest import ROOT, MakeConfig, Procs, events
from tests.test_secagg import FAST


def _hostile(procs: Procs, config: Path, worker: str, forge: str) -> subprocess.Popen:
    with open(procs.logs / f"{worker}.log", "wb") as fh:
        p = subprocess.Popen([sys.executable, "-m", "tests.secagg_hostile", "--config",
                              str(config), "--id", worker, "--forge", forge], cwd=ROOT,
                             env=child_env(procs.cache_dir), stdout=fh, stderr=subprocess.STDOUT)
    procs.procs[worker] = p
    return p


def _cluster(procs: Procs, cfg: Path, forge: str) -> subprocess.Popen:
    """The master, honest w2 and w3, and w1 forging ``forge`` (tests/secagg_hostile.py)."""
    procs.master(cfg)
    for w in ("w2", "w3"):
        procs.worker(cfg, w)
    return _hostile(procs, cfg, "w1", forge)


def _hostile_job(tmp_path: Path, make_config: MakeConfig, rounds: int) -> Path:
    return make_config(tmp_path, workers=3, rounds=rounds, min_workers=2,
                       privacy={"secure_aggregation": {"threshold": 2}},
                       **{**FAST, "model": {"family": "mlp", "hidden": 32}})


@pytest.mark.slow
def test_a_member_corrupting_anothers_share_gets_no_one_excluded(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """w1 flips a byte of the share it sends w2. w2 sat every round out for it, was waited
    for SECAGG_STAGE_TIMEOUT (60 s) a round and counted silent: excluded in round 3, w1 never
    named. w2 now goes on without that share (its pair mask with w1 needs none), and w1's seed
    opens from the shares of w1 and w3."""
    cfg = _hostile_job(tmp_path, make_config, rounds=3)
    _cluster(procs, cfg, "share:w2")
    codes = procs.wait_all(timeout=240)
    assert set(codes.values()) == {0}, procs.logs_tail()
    out = tmp_path / "out"
    assert [(e["round"], e["survivors"]) for e in events(out, "secagg")] == [
        (r, ["w1", "w2", "w3"]) for r in (1, 2, 3)]
    assert not json.loads((out / "summary.json").read_text()).get("excluded")
    said = procs.log("w2")
    assert "secure aggregation: from w1, the share does not decrypt" in said, said
    assert "sits the round out" not in said
    durations = [e["duration_s"] for e in events(out, "round") if e.get("duration_s")]
    assert max(durations) < C.SECAGG_STAGE_TIMEOUT / 2, durations


@pytest.mark.slow
def test_a_member_committing_to_another_seed_is_left_out_then_excluded(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """w1 commits to the hash of random bytes: its seed's shares never open the commitment,
    and every attempt of every round failed (nothing was trained, no one named). The next
    attempt now goes on without it, and since three members revealed its shares (more than
    the threshold, 2: one forger among them could not have caused it) it counts as silent,
    excluded at ABSTAIN_LIMIT."""
    cfg = _hostile_job(tmp_path, make_config, rounds=C.ABSTAIN_LIMIT + 1)
    w1 = _cluster(procs, cfg, "commitment")
    w1.wait(timeout=240)
    del procs.procs["w1"]
    codes = procs.wait_all(timeout=240)
    assert set(codes.values()) == {0}, procs.logs_tail()
    out = tmp_path / "out"
    applied = events(out, "secagg")
    assert [(e["round"], e["survivors"]) for e in applied] == [
        (r, ["w2", "w3"]) for r in range(1, C.ABSTAIN_LIMIT + 2)]
    restarts = events(out, "secagg_restart")
    assert [e["round"] for e in restarts] == list(range(1, C.ABSTAIN_LIMIT + 1))
    assert all("w1's seed do not open" in e["reason"] for e in restarts)
    excluded = json.loads((out / "summary.json").read_text()).get("excluded", {})
    assert list(excluded) == ["w1"] and "did not open its secret" in excluded["w1"], excluded
    assert "w1 is left out of the next attempt" in procs.log("master")


@pytest.mark.slow
def test_a_ring_value_past_the_clip_is_refused_not_averaged(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """w1's quantized input is past the top level in a few coordinates: the ring sum wraps,
    and each such coordinate of the average moved by about 9 where the clip (8) and the
    weights (2.6) allowed 3, its sign w1's to choose. No honest sum passes clip times its
    weights: refused, the model stays as it was, and after SECAGG_MAX_REFUSED_SUMS such
    rounds the job ends saying how to find whose updates they are."""
    cfg = _hostile_job(tmp_path, make_config, rounds=C.SECAGG_MAX_REFUSED_SUMS + 1)
    _cluster(procs, cfg, "ring")
    codes = procs.wait_all(timeout=240)
    assert codes["master"] != 0, procs.logs_tail()
    out = tmp_path / "out"
    assert not events(out, "secagg")  # nothing applied
    said = procs.log("master")
    assert "a coordinate of the secure sum is" in said and "was forged" in said, said
    assert f"the last {C.SECAGG_MAX_REFUSED_SUMS} secure sums could not be applied" in said


def _sync_job(tmp_path: Path, make_config: MakeConfig, steps: int) -> Path:
    return make_config(tmp_path, workers=3, rounds=5 * steps, min_workers=2,
                       privacy={"secure_aggregation": {"threshold": 2}},
                       **{**FAST, "model": {"family": "prodlda", "mode": "sync", "n_topics": 5,
                                            "vocab_size": 300, "batch_size": 32}})


@pytest.mark.slow
@pytest.mark.parametrize("forge", ["step-wrap", "step-clip"])
def test_one_forged_synchronous_step_is_refused(forge: str, tmp_path: Path,
                                                make_config: MakeConfig, procs: Procs) -> None:
    """w1 forges the gradients' phase of step 4 of a synchronous ProdLDA job: every value past
    the ring's top level (the sum wraps: 2.5e7 a coordinate where the clip is 4,096), or at
    the clip (in range). Either was applied, and Adam's second moment held it for the rest of
    the job: every weight moved the way that one step pushed (attack review). Wrapped, the sum
    is past what its members can send; in range, it is past 20 times the last steps' sums.
    Refused, the step is redone (its workers had spent its state: asked for the phase again,
    each abstained, and all three were excluded, and the master ended by ValueError)."""
    cfg = _sync_job(tmp_path, make_config, steps=6)
    _cluster(procs, cfg, f"{forge}:4")
    codes = procs.wait_all(timeout=300)
    assert set(codes.values()) == {0}, procs.logs_tail()
    said = procs.log("master")
    why = ("a value of the secure sum is" if forge == "step-wrap" else
           "the smallest of the last rounds' secure sums")
    assert "the secure sum cannot be applied" in said and why in said, said
    assert "its secure sum in phase 4 was refused; redoing the step" in said
    assert "forged step 4's gradient" in procs.log("w1")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert not summary.get("excluded") and summary["trained"]["steps"] == 6, summary


@pytest.mark.slow
def test_a_step_forged_at_every_redo_ends_the_job_not_the_budget(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """w1 forges the gradients of step 2 at the clip each time it is redone. Its first
    phases' sums were applied between the refusals, which reset their count: the step was
    refused and redone until the round budget (twice the rounds) ran out, and the job
    ended "done", one step trained of six. The count is now of sums of the same length."""
    cfg = _sync_job(tmp_path, make_config, steps=6)
    _cluster(procs, cfg, "step-clip:2+")
    codes = procs.wait_all(timeout=300)
    assert codes["master"] != 0, procs.logs_tail()
    said = procs.log("master")
    assert f"the last {C.SECAGG_MAX_REFUSED_SUMS} secure sums could not be applied" in said, said
    assert said.count("its secure sum in phase 4 was refused; redoing the step") == \
        C.SECAGG_MAX_REFUSED_SUMS, said
