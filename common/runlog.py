"""The run's metrics log: one JSON event per line, written by the master, read by the launcher,
the benchmarks and the tests; and the pace of the per-round lines of the text log."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common import constants as C

log = logging.getLogger("fedctl.runlog")


class MetricsLog:
    """Append-only JSON-lines log: one event per line, flushed as it is written.

    Each line is a complete JSON object, so a reader tailing the file (``fedctl run``'s progress
    display) never sees half an event, and a crash loses at most the line being written.
    """

    def __init__(self, path: str | Path, sinks: Sequence[Any] = ()) -> None:
        self.path = Path(path)
        # Trackers (common.tracking) that get every event written here; one that fails is
        # dropped with a warning: tracking must not stop a run.
        self.sinks = list(sinks)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def write(self, event: str, /, **fields: Any) -> None:
        """Append one event. A number that is not finite is written as ``null``: ``NaN`` and
        ``Infinity`` are not JSON, and readers (jq, browsers, MLflow) refuse them. ``event`` is
        positional only, so that a field may have any name (a worker's metric ``self`` too)."""
        record = _finite({"event": event, **fields})
        line = json.dumps(record, default=_jsonable, allow_nan=False)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()
            for sink in list(self.sinks):
                try:
                    sink.on_event(json.loads(line))
                except Exception as exc:  # a tracker's own failure: the log goes on
                    log.warning("tracking: %s stopped: %s", type(sink).__name__, exc)
                    self.sinks.remove(sink)

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Append an event held as one mapping (its ``event`` field and the rest)."""
        self.write(record["event"], **{k: v for k, v in record.items() if k != "event"})

    def drop(self, unwanted: Callable[[Mapping[str, Any]], bool]) -> int:
        """Remove the events for which ``unwanted`` is true (a resumed master's rounds past
        its checkpoint, which it runs again); the file is replaced atomically. How many."""
        from common.atomic import atomic_write_bytes

        with self._lock:
            self._fh.flush()
            kept, dropped = [], 0
            for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a kill: not an event, kept as it is
                    record = None
                if isinstance(record, dict) and unwanted(record):
                    dropped += 1
                else:
                    kept.append(line)
            if dropped:
                self._fh.close()
                atomic_write_bytes(self.path, "".join(kept).encode("utf-8"))
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            return dropped

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # closing a tracker must not lose the log
                log.warning("tracking: closing %s: %s", type(sink).__name__, exc)
        self.sinks = []
        self._fh.close()


def _finite(x: Any) -> Any:
    if isinstance(x, float | np.floating):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return _finite(x.item())
    if isinstance(x, np.ndarray):
        return _finite(x.tolist())
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics log's events, skipping a last line still being written and any line
    that is not an event (an object), as a hand edit or a copy's damage may leave: one such
    line must not stop `fedctl runs`, `show` or `plot`."""
    events = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # (lists nested past the stack)
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def round_cpu(events: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Round -> the CPU time it cost the master and its workers together: the ``cpu_s`` of its
    ``round`` event and of its ``worker_round`` events. Rounds where one of them lacks it (a
    log from before ``cpu_s``) are left out."""
    workers: dict[int, list[Any]] = {}
    for e in events:
        if e["event"] == "worker_round":
            workers.setdefault(e["round"], []).append(e.get("cpu_s"))
    return {e["round"]: e["cpu_s"] + sum(workers[e["round"]]) for e in events
            if e["event"] == "round" and e.get("cpu_s") is not None
            and workers.get(e["round"]) and None not in workers[e["round"]]}


class MetricsTail:
    """Follow a metrics log as it grows: each :meth:`new_events` reads only the bytes written
    since the last call, so that following a long run costs the same at its end as at its start
    (``fedctl run`` looks ten times a second; reading the whole file each time took a core's
    growing share from the workers, issue 30).

    A missing file is a file with nothing in it yet; a last line still being written waits for
    the next call.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def new_events(self) -> list[dict[str, Any]]:
        """The events completed since the last call, in order."""
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self._offset:  # truncated: start again
                    self._offset = 0
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # up to the last complete line
        self._offset += end
        events = []
        for line in chunk[:end].splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # not an event (the writer crashed mid-line)
                continue
        return events


class RoundLines:
    """The level of a round's line in the text log: INFO for the first ``burst`` rounds, then
    for one every ``interval`` seconds and wherever the caller says it matters (the last
    round, a missing worker); DEBUG otherwise. metrics.jsonl keeps every round."""

    def __init__(self, burst: int = C.ROUND_LINES_BURST,
                 interval: float = C.ROUND_LINE_INTERVAL_S) -> None:
        self.burst = burst
        self.interval = interval
        self._shown = 0
        self._last = -float("inf")

    def level(self, matters: bool = False) -> int:
        """``logging.INFO`` or ``logging.DEBUG`` for the next round's line."""
        now = time.monotonic()
        if matters or self._shown < self.burst or now - self._last >= self.interval:
            self._shown += 1
            self._last = now
            return logging.INFO
        return logging.DEBUG
