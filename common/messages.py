"""The message catalogue: kinds, PUB topics and the fields each request body must carry.

Framing lives in :mod:`common.wire`; this module says what the messages mean. The table is
written out for people in docs/PROTOCOL.md.
"""

from __future__ import annotations

from typing import Any

from common.wire import ProtocolError

# PUB -> SUB
ANNOUNCE = "announce"  #: master beacon: who, protocol, phase, round, version
ROUND = "round"  #: a round's global payload, to every worker
DIRECT = "direct"  #: a round's payload for one worker only (topic b"to/<worker id>")
SHUTDOWN = "shutdown"  #: the job is over; workers fetch the final model, report and exit

# REQ -> REP
REGISTER = "register"
FETCH = "fetch"
UPDATE = "update"
REPORT = "report"
PING = "ping"

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


def direct_topic(worker_id: str) -> bytes:
    """PUB topic of the payloads meant for one worker alone.

    The trailing NUL keeps worker ``w1`` from also receiving ``w10``'s payloads, since ZeroMQ
    subscriptions match by prefix.
    """
    return b"to/" + worker_id.encode() + b"\0"


#: Error codes of ``error`` replies.
ERROR_CODES = (
    "malformed",  # frames or header do not follow the format
    "version",  # another protocol version
    "unknown_kind",  # a kind the master does not serve
    "bad_field",  # a body field missing or of the wrong type
    "dtype",  # an array of the wrong dtype
    "shape",  # an array of the wrong shape, or missing / extra arrays
    "not_finite",  # NaN or Inf in an update
    "unknown_worker",  # not registered, or not in the cluster's worker list
    "stale_round",  # an update for a round that is not open
    "not_selected",  # an update from a worker not sampled for this round
    "not_ready",  # asked for the model before there is one
    "rejected",  # refused by the model family (its own reason follows)
)

_NUM = (int, float)

#: Required body fields of each request kind, and their types.
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    REGISTER: {"worker_id": str, "n_samples": int, "device": str, "info": dict},
    FETCH: {"worker_id": str},
    UPDATE: {"worker_id": str, "round": int, "version": int, "n_samples": int, "metrics": dict},
    REPORT: {"worker_id": str, "report": dict},
    PING: {"worker_id": str},
}


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
        raise ProtocolError(f"unknown message kind {kind!r}", code="unknown_kind")
    for name, typ in fields.items():
        value = body.get(name)
        if value is None:
            raise ProtocolError(f"{kind}: missing field {name!r}", code="bad_field")
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ProtocolError(
                f"{kind}: field {name!r} should be {typ.__name__}, got {type(value).__name__}",
                code="bad_field",
            )
    worker_id = body["worker_id"]
    if not worker_id or len(worker_id) > 128 or "\0" in worker_id:
        raise ProtocolError(f"{kind}: worker_id must be 1-128 characters", code="bad_field")
