"""Tests of master/checkpoint.py's writer: its time budget and when round events reach the log."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.runlog import MetricsLog, read_metrics
from master.checkpoint import Checkpoint, CheckpointWriter


def _ckpt(round_: int, mb: int = 4) -> Checkpoint:
    return Checkpoint({"round": round_}, {"w": np.full(mb << 18, round_, dtype=np.float32)})


def _logged_rounds(path: Path) -> list[int]:
    return [e["round"] for e in read_metrics(path / "metrics.jsonl")]


def _writer(tmp_path: Path, budget: float) -> tuple[CheckpointWriter, MetricsLog]:
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    return CheckpointWriter(tmp_path, metrics, budget), metrics


def test_budget_spaces_checkpoints_by_their_write_time(tmp_path: Path) -> None:
    writer, metrics = _writer(tmp_path, budget=0.1)
    assert writer.ready()  # nothing written yet
    writer.submit(_ckpt(1), [{"event": "round", "round": 1}])
    writer.flush()
    took = writer.last_write_s
    assert took > 0
    assert Checkpoint.load(tmp_path).meta["round"] == 1
    end = time.monotonic()
    # 10 % of the wall time: the next one waits 9 write times after the last ended.
    assert not writer.ready(now=end)
    assert writer.ready(now=end + 9 * took + 1e-3)
    writer.close()
    metrics.close()


def test_budget_one_is_always_ready(tmp_path: Path) -> None:
    writer, metrics = _writer(tmp_path, budget=1.0)
    writer.submit(_ckpt(1), [])
    writer.flush()
    assert writer.ready(now=time.monotonic())
    writer.close()
    metrics.close()


@pytest.mark.parametrize("budget", [0, -0.5, 1.5])
def test_budget_outside_zero_one_is_refused(tmp_path: Path, budget: float) -> None:
    with pytest.raises(ValueError, match="budget"):
        CheckpointWriter(tmp_path, MetricsLog(tmp_path / "m.jsonl"), budget)


def test_held_events_wait_for_the_checkpoint_that_covers_them(tmp_path: Path) -> None:
    writer, metrics = _writer(tmp_path, budget=0.1)
    writer.submit(None, [{"event": "round", "round": 1}], hold=True)
    writer.submit(None, [{"event": "round", "round": 2}], hold=True)
    writer.flush()
    # A resumed master would run rounds 1 and 2 again: the log must not show them yet.
    assert _logged_rounds(tmp_path) == []
    writer.submit(_ckpt(3), [{"event": "round", "round": 3}])
    writer.flush()
    assert _logged_rounds(tmp_path) == [1, 2, 3]
    assert Checkpoint.load(tmp_path).meta["round"] == 3
    writer.close()
    metrics.close()


class _SlowCheckpoint(Checkpoint):
    """A checkpoint whose write waits for ``go``: the writer stays busy meanwhile."""

    def __init__(self, round_: int, go: threading.Event) -> None:
        super().__init__({"round": round_}, {"w": np.zeros(4, np.float32)})
        self.go = go

    def write_to(self, fh: Any) -> None:
        self.go.wait(30)
        super().write_to(fh)


def test_a_pending_checkpoint_does_not_carry_later_rounds_events(tmp_path: Path) -> None:
    # Round 1's checkpoint is being written, round 2's waits behind it, and round 3 (a round
    # whose checkpoint was skipped for the budget) finishes: round 3's events must wait for a
    # checkpoint that covers round 3, not go out with round 2's (seen: a master killed then
    # was resumed from round 2 and ran round 3 again, logged twice).
    writer, metrics = _writer(tmp_path, budget=1.0)
    go = threading.Event()
    writer.submit(_SlowCheckpoint(1, go), [{"event": "round", "round": 1}])
    while writer.ready():  # the thread has taken round 1's checkpoint
        time.sleep(0.001)
    writer.submit(_ckpt(2), [{"event": "round", "round": 2}])
    writer.submit(None, [{"event": "round", "round": 3}], hold=True)
    go.set()
    writer.flush()
    assert _logged_rounds(tmp_path) == [1, 2]
    assert Checkpoint.load(tmp_path).meta["round"] == 2
    writer.submit(_ckpt(4), [{"event": "round", "round": 4}])
    writer.flush()
    assert _logged_rounds(tmp_path) == [1, 2, 3, 4]
    writer.close()
    metrics.close()


def test_events_without_checkpoints_are_logged_at_once(tmp_path: Path) -> None:
    writer, metrics = _writer(tmp_path, budget=0.1)
    writer.submit(None, [{"event": "round", "round": 1}], hold=False)  # checkpoint_every 0
    writer.flush()
    assert _logged_rounds(tmp_path) == [1]
    assert not (tmp_path / "checkpoint.npz").exists()
    writer.close()
    metrics.close()


def test_close_logs_held_events_rather_than_lose_them(tmp_path: Path) -> None:
    writer, metrics = _writer(tmp_path, budget=0.1)
    writer.submit(None, [{"event": "round", "round": 1}], hold=True)
    writer.close()
    metrics.close()
    assert _logged_rounds(tmp_path) == [1]


def test_a_newer_checkpoint_supersedes_a_pending_one_and_keeps_its_events(tmp_path: Path
                                                                           ) -> None:
    writer, metrics = _writer(tmp_path, budget=1.0)
    for r in range(1, 6):
        writer.submit(_ckpt(r, mb=16), [{"event": "round", "round": r}])
    writer.flush()
    assert _logged_rounds(tmp_path) == [1, 2, 3, 4, 5]
    assert Checkpoint.load(tmp_path).meta["round"] == 5
    writer.close()
    metrics.close()


def test_a_checkpoint_carries_every_event_it_covers(tmp_path: Path) -> None:
    """Held rounds' events are in the checkpoint that covers them: a master killed between the
    write and the log lines logs them all when it resumes (rounds 14-16 were lost so)."""
    writer, metrics = _writer(tmp_path, budget=1.0)
    for r in (1, 2, 3):  # checkpoints skipped (over budget): their events wait
        writer.submit(None, [{"event": "round", "round": r}], hold=True)
    writer.submit(_ckpt(4), [{"event": "round", "round": 4}])
    writer.flush()
    writer.close()
    metrics.close()
    assert [e["round"] for e in Checkpoint.load(tmp_path).meta["events"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("family", ["fstc", "mlp"])
def test_family_snapshot_restores_everything_the_master_half_holds(tmp_path: Path,
                                                                   family: str) -> None:
    """Through ServerFamily.snapshot / restore and a file on disk: a resumed master's family
    admits the same workers as before (FSTC's K and feature size included)."""
    from common.config import parse_config
    from master.checkpoint import capture, restore
    from master.families import make_server_family

    cfg = parse_config({"model": {"family": family}, "workers": ["w1", "w2"],
                        "data": {"path": str(tmp_path / "unused.jsonl")}}, source="<test>")
    rng = np.random.default_rng(0)
    if family == "fstc":
        info = {"n_clusters": 3, "dim": 4, "centers": rng.random((3, 4)).tolist(),
                "counts": [5, 6, 7]}
    else:
        info = {"input_dim": 4, "classes": ["a", "b"]}
    before = make_server_family(cfg)
    before.setup({"w1": info, "w2": info})
    ckpt = capture(before, {"family": family, "strategy": before.strategy.name})
    with open(tmp_path / "ckpt.npz", "wb") as fh:
        ckpt.write_to(fh)
    (tmp_path / "ckpt.npz").rename(tmp_path / "checkpoint.npz")
    after = make_server_family(cfg)
    restore(Checkpoint.load(tmp_path), after)
    assert after.setup_info_ == before.setup_info_
    assert after.global_.arrays.keys() == before.global_.arrays.keys()
    for name, array in before.global_.arrays.items():
        assert np.array_equal(after.global_.arrays[name], array)
    after.admit("w3", info)  # the resumed master takes a worker of the same model
    if family == "fstc":
        assert (after.n_clusters, after.dim) == (3, 4)
