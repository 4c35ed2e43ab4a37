"""The message catalogue: kinds, PUB topics and the fields each request body must carry.

Framing lives in :mod:`common.net.wire`; this module says what the messages mean. The table is
written out for people in docs/PROTOCOL.md.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from common import constants as C
from common.net import errors
from common.net.errors import ProtocolError

# The job's phases, announced by the master and followed by the workers.
JOINING = "joining"      #: waiting for workers to register
TRAINING = "training"    #: rounds are running
REPORTING = "reporting"  #: training is over; collecting the workers' final reports
DONE = "done"            #: results written; nothing more to do
PHASES = (JOINING, TRAINING, REPORTING, DONE)

# PUB -> SUB
ANNOUNCE = "announce"  #: master beacon: who, protocol, phase, round, version
ROUND = "round"  #: a round's global payload, to every worker (or, per-worker, its opening)
SHUTDOWN = "shutdown"  #: the job is over; workers fetch the final model, report and exit
#: A secure round's stage changed (on the announce topic): its workers ask again at once.
SECAGG_STAGE = "secagg_stage"

# REQ -> REP
REGISTER = "register"
FETCH = "fetch"
UPDATE = "update"
REPORT = "report"
PING = "ping"
SECAGG = "secagg"  #: a stage of a secure round (master/secagg.py); the reply has this kind too

# REP -> REQ
WELCOME = "welcome"
MODEL = "model"
ACK = "ack"
PONG = "pong"
ERROR = "error"

#: Topic prefixes a worker subscribes to (ZeroMQ filters by prefix).
TOPIC_ANNOUNCE = b"announce"
TOPIC_ROUND = b"round"
TOPIC_SHUTDOWN = b"shutdown"


#: Error codes of ``error`` replies: :mod:`common.net.errors`.
ERROR_CODES = errors.ERROR_CODES

_NUM = (int, float)

#: Required body fields of each request kind, and their types.
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    REGISTER: {"worker_id": str, "n_samples": int, "device": str, "info": dict},
    FETCH: {"worker_id": str},
    UPDATE: {"worker_id": str, "round": int, "version": int, "n_samples": int, "metrics": dict},
    REPORT: {"worker_id": str, "report": dict},
    PING: {"worker_id": str},
    SECAGG: {"worker_id": str, "round": int, "stage": str},
}


#: Names the master's metrics log uses itself: a worker's metric may not take them.
RESERVED_METRICS = frozenset({"event", "round", "worker", "n_samples", "bytes_out", "upload_s",
                              "time"})
MAX_METRICS = 64
#: A metric's characters: MLflow's rule (word characters, '.', '-', ' ', '/', ':'), which a tag
#: under ``<worker>/`` must follow too: one refused tag stopped its tracking for the whole run.
METRIC_NAME = re.compile(r"[\w.\- /:]{1,64}")


def metric_name_ok(name: Any) -> bool:
    """A metric name MLflow and TensorBoard take under ``<worker>/``: :data:`METRIC_NAME`'s
    characters, and a path that normalization leaves as it is (MLflow refuses ``..``, ``a//b``,
    a leading or trailing ``/``)."""
    if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
        return False
    norm = posixpath.normpath(name)
    return norm == name and norm != "." and not norm.startswith(("..", "/"))


def check_metrics(metrics: Any, where: str) -> dict[str, float]:
    """Check a map of metric name -> finite number (an update's or a report's scores), each
    within range (:func:`out_of_range`).

    Raises
    ------
    ProtocolError
        ``bad_field`` naming the first offending entry.
    """
    check_metric_form(metrics, where)
    for k, v in metrics.items():
        if out_of_range(k, v):
            raise ProtocolError(f"{where}: metric {k!r} = {v!r} is out of range",
                                code=errors.BAD_FIELD)
    return metrics


def out_of_range(name: str, value: float) -> bool:
    """A metric past ``MAX_METRIC`` in magnitude, or a duration outside [0, ``MAX_TIMING_S``]."""
    return abs(value) > C.MAX_METRIC or (is_timing(name) and not 0 <= value <= C.MAX_TIMING_S)


def in_range_metrics(metrics: Any, where: str) -> tuple[dict[str, float], list[str]]:
    """An update's metrics (names and numbers checked as :func:`check_metrics`) without those
    that are not finite or out of range, and the names left out. An honest worker's loss
    passes ``MAX_METRIC``, then float32's range, on a model another member blew up: its update
    is still taken (its arrays are checked apart), only the number is not kept."""
    check_metric_form(metrics, where, finite=False)
    # (Scores held to their ranges as a report's are: an F1 of 1e11 was the round's logged
    # "global macro-F1" and every learning curve's scale.)
    dropped = [k for k, v in metrics.items() if not reportable(k, v)]
    return {k: v for k, v in metrics.items() if k not in dropped}, dropped


def check_metric_form(metrics: Any, where: str, finite: bool = True) -> None:
    """Refuse what is not a map of at most ``MAX_METRICS`` names to numbers, finite ones
    where ``finite``."""
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise ProtocolError(f"{where}: expected a map of at most {MAX_METRICS} numbers",
                            code=errors.BAD_FIELD)
    for k, v in metrics.items():
        if not metric_name_ok(k):
            raise ProtocolError(f"{where}: metric names are 1-64 letters, digits, '_', '.', "
                                "'-', ' ', '/' or ':', a path with no '..' or '//' (MLflow's "
                                "rule)", code=errors.BAD_FIELD)
        if k in RESERVED_METRICS:
            raise ProtocolError(f"{where}: metric name {k!r} is reserved", code=errors.BAD_FIELD)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                finite and not math.isfinite(v)):
            raise ProtocolError(f"{where}: metric {k!r} must be a finite number",
                                code=errors.BAD_FIELD)


def is_timing(name: str) -> bool:
    """A metric that is a duration in seconds (``train_time``, ``broadcast_s``; not a rate
    such as ``tokens_per_s``)."""
    return name.endswith(("_time", "_s")) and not name.endswith("_per_s")


def check_numeric(arrays: Mapping[str, Any], where: str) -> None:
    """Refuse arrays that are not numbers (an update's: the wire also carries text arrays,
    for the master's vocabulary, which no update has a use for)."""
    for name, a in arrays.items():
        if a.dtype.kind not in "biuf":
            raise ProtocolError(f"{where}: array {str(name)[:64]!r} holds {a.dtype}, not numbers",
                                code=errors.DTYPE)


#: The fields of a final report; any other is refused (not stored).
REPORT_FIELDS = frozenset({"federated", "local_only", "n_train", "n_test", "version", "labelled"})


#: Scores a report may carry only within a range (fractions; NPMI's and C_V's bounds): a
#: macro-F1 of 1e12 once made the results table's mean row 3.3e11. (A report's version is not
#: held to the master's: a master resumed from an earlier checkpoint is behind its workers.)
SCORE_RANGES = {**dict.fromkeys(("accuracy", "macro_f1", "acc", "nmi", "diversity"),
                                (0.0, 1.0)),
                **dict.fromkeys(("npmi_doc", "c_npmi", "c_v"), (-1.0, 1.0))}


def reportable(name: str, value: float) -> bool:
    """Whether a report may carry this score: finite, within ``MAX_METRIC`` and, for those of
    :data:`SCORE_RANGES`, within its range (what :func:`check_report` holds each to)."""
    low, high = SCORE_RANGES.get(name, (-math.inf, math.inf))
    return math.isfinite(value) and not out_of_range(name, value) and low <= value <= high


def check_report(report: dict[str, Any]) -> None:
    """Check a final report: known fields only, scores maps (or null), each score of
    :data:`SCORE_RANGES` within its range, and sizes."""
    unknown = sorted(str(k)[:40] for k in report if k not in REPORT_FIELDS)
    if unknown:
        raise ProtocolError(f"report: unknown field(s) {unknown}", code=errors.BAD_FIELD)
    if not isinstance(report.get("labelled", False), bool):
        raise ProtocolError("report.labelled: expected true or false", code=errors.BAD_FIELD)
    for key in ("federated", "local_only"):
        if report.get(key) is not None:
            check_metrics(report[key], f"report.{key}")
            for name, value in report[key].items():
                if not reportable(name, value):  # (finite and within MAX_METRIC already)
                    low, high = SCORE_RANGES[name]
                    raise ProtocolError(f"report.{key}: {name} {value:.6g} is outside "
                                        f"[{low:g}, {high:g}]", code=errors.BAD_FIELD)
    for key in ("n_train", "n_test", "version"):
        v = report.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ProtocolError(f"report.{key}: expected a count", code=errors.BAD_FIELD)


def check_request(kind: str, body: dict[str, Any]) -> None:
    """Check a request's kind and required fields.

    Raises
    ------
    ProtocolError
        ``unknown_kind`` for a kind the master does not serve, ``bad_field`` for a missing or
        mistyped field.
    """
    fields = REQUEST_FIELDS.get(kind)
    if fields is None:
        raise ProtocolError(f"unknown message kind {kind!r}", code=errors.UNKNOWN_KIND)
    for name, typ in fields.items():
        value = body.get(name)
        if value is None:
            raise ProtocolError(f"{kind}: missing field {name!r}", code=errors.BAD_FIELD)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ProtocolError(
                f"{kind}: field {name!r} should be {typ.__name__}, got {type(value).__name__}",
                code=errors.BAD_FIELD,
            )
    worker_id = body["worker_id"]
    if not 0 < len(worker_id) <= 128 or not worker_id.isprintable():
        raise ProtocolError(f"{kind}: worker_id must be 1-128 printable characters",
                            code=errors.BAD_FIELD)
    process = body.get("process")
    if process is not None and not (isinstance(process, str) and 0 < len(process) <= 64
                                    and process.isprintable()):
        raise ProtocolError(f"{kind}: process must be 1-64 printable characters",
                            code=errors.BAD_FIELD)
    if kind in (REGISTER, UPDATE) and not 0 <= body["n_samples"] <= C.MAX_SAMPLES:
        raise ProtocolError(f"{kind}: n_samples must be 0-{C.MAX_SAMPLES}", code=errors.BAD_FIELD)
    if kind == REGISTER and not (0 < len(body["device"]) <= 64 and body["device"].isprintable()):
        raise ProtocolError(f"{kind}: device must be 1-64 printable characters",
                            code=errors.BAD_FIELD)
    compression = body.get("compression")
    if kind == UPDATE and compression is not None and not (
            isinstance(compression, str) and 0 < len(compression) <= 32):
        raise ProtocolError(f"{kind}: compression must be the name of one",
                            code=errors.BAD_FIELD)
    sent_at = body.get("sent_at")
    if sent_at is not None and (not isinstance(sent_at, float) or not 0 <= sent_at < 1e11):
        raise ProtocolError(f"{kind}: sent_at must be a time in seconds", code=errors.BAD_FIELD)
