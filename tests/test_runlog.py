"""The metrics log as its readers see it: whole events only, and a follower that reads each
byte once."""

from __future__ import annotations

import json

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
