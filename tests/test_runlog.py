"""The metrics log as its readers see it: whole events only, and a follower that reads each
byte once."""

from __future__ import annotations

import json

import pytest

from common.runlog import MetricsLog, MetricsTail, read_metrics


def test_tail_reads_only_new_complete_events(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.new_events() == []  # not written yet
    log = MetricsLog(path)
    log.write("start", rounds=2)
    log.write("round", round=1)
    assert [e["event"] for e in tail.new_events()] == ["start", "round"]
    assert tail.new_events() == []  # nothing read twice
    with open(path, "a", encoding="utf-8") as fh:  # a line still being written...
        fh.write(json.dumps({"event": "round", "round": 2})[:10])
    assert tail.new_events() == []
    with open(path, "a", encoding="utf-8") as fh:  # ...is read once it is whole
        fh.write(json.dumps({"event": "round", "round": 2})[10:] + "\n")
    assert tail.new_events() == [{"event": "round", "round": 2}]
    log.close()
    assert [e.get("round") for e in read_metrics(path)] == [None, 1, 2]


def test_tail_starts_again_on_a_truncated_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsLog(path).write("round", round=1)
    tail = MetricsTail(path)
    assert len(tail.new_events()) == 1
    path.write_text('{"event": "end"}\n')
    assert tail.new_events() == [{"event": "end"}]


def test_tail_skips_a_garbled_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "round", "round": 1}\nnot json\n{"event": "end"}\n')
    assert [e["event"] for e in MetricsTail(path).new_events()] == ["round", "end"]


def test_round_lines_are_paced_after_a_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    """Millisecond rounds (a synchronized step's) wrote a line each to every process's log,
    180 a second; now the first rounds each, then one every interval, and always what
    matters."""
    import logging

    from common import runlog
    from common.runlog import RoundLines

    clock = [0.0]
    monkeypatch.setattr(runlog.time, "monotonic", lambda: clock[0])
    lines = RoundLines(burst=3, interval=0.2)
    levels = []
    for _ in range(10):  # 10 rounds of 5 ms
        levels.append(lines.level())
        clock[0] += 0.005
    assert levels[:3] == [logging.INFO] * 3 and set(levels[3:]) == {logging.DEBUG}
    assert lines.level(matters=True) == logging.INFO  # the last round, a missing worker
    clock[0] += 0.2
    assert lines.level() == logging.INFO and lines.level() == logging.DEBUG


def test_drop_removes_the_events_asked_and_keeps_appending(tmp_path) -> None:
    """What a resumed master does with the rounds past its checkpoint, which it runs again."""
    import json

    from common.runlog import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for r in (1, 2, 3):
        log.write("round", round=r)
        log.write("worker_round", round=r, worker="w1")
    assert log.drop(lambda e: e.get("round", 0) > 2) == 2
    log.write("resume", completed_round=2)
    log.close()
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("round")) for e in events] == [
        ("round", 1), ("worker_round", 1), ("round", 2), ("worker_round", 2), ("resume", None)]
