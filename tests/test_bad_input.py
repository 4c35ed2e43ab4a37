"""A real `fedctl master` process against bad requests sent with raw ZeroMQ REQ sockets.

Each bad request must get an `error` reply with the right code, and the master must go on
serving (a valid `ping` right after is answered) and stay alive: "no input from a worker can
stop it" (docs/PROTOCOL.md). Two masters serve the whole module: one kept in the `joining`
phase (it expects w1 and w2; only w1 registers), and one driven into `training` by two
hand-made registrations, so that round 1 is open.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import yaml
import zmq

from common.constants import PROTOCOL_VERSION
from common.net.wire import Message, decode, encode
from tests.conftest import (
    CLASSES,
    ROOT,
    child_env,
    config_dict,
    events,
    fedctl_command,
    kill_tree,
    wait_for,
)

pytestmark = pytest.mark.slow

INFO = {"input_dim": 384, "classes": CLASSES}  # what an MLP worker sends in `register`
REPLY_TIMEOUT_MS = 10_000


@dataclass
class RawMaster:
    """A running `fedctl master` and the endpoints to reach it with raw sockets."""

    proc: subprocess.Popen
    rep: str
    pub: str
    out: Path
    log: Path

    def request(self, frames: list[Any], timeout_ms: int = REPLY_TIMEOUT_MS) -> Message:
        """Send ``frames`` on a fresh REQ socket and decode the reply (fails without one)."""
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)  # (a failed handshake leaves no pipe)
        try:
            sock.connect(self.rep)
            try:
                sock.send_multipart(frames)
                reply = sock.recv_multipart()
            except zmq.Again:
                pytest.fail(f"no reply within {timeout_ms} ms (master rc {self.proc.poll()})\n"
                            f"{self.tail()}")
            return decode(reply)
        finally:
            sock.close()

    def send(self, kind: str, body: dict[str, Any], arrays: dict | None = None,
             timeout_ms: int = REPLY_TIMEOUT_MS) -> Message:
        return self.request(encode(kind, body, arrays), timeout_ms)

    def register(self, worker_id: str, info: dict | None = None) -> Message:
        return self.send("register", {"worker_id": worker_id, "n_samples": 100,
                                      "device": "cpu", "info": INFO if info is None else info})

    def ping(self, worker_id: str = "w1", timeout_ms: int = REPLY_TIMEOUT_MS) -> Message:
        return self.send("ping", {"worker_id": worker_id}, timeout_ms=timeout_ms)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_master(tmp: Path, rounds: int = 3, **overrides: Any) -> RawMaster:
    """A `fedctl master` expecting w1 and w2 with long time-outs, answering on REP."""
    overrides = {"round_deadline": 600, "join_timeout": 600, **overrides}
    raw = config_dict(tmp / "out", tmp / "cache", ["w1", "w2"], rounds, **overrides)
    cfg = tmp / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    log = tmp / "master.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(fedctl_command("master", "--config", str(cfg)), cwd=ROOT,
                                env=child_env(tmp / "cache"), stdout=fh,
                                stderr=subprocess.STDOUT)
    m = raw["master"]
    master = RawMaster(proc, f"tcp://127.0.0.1:{m['rep_port']}",
                       f"tcp://127.0.0.1:{m['pub_port']}", tmp / "out", log)

    def answers() -> bool:
        if not master.alive():
            pytest.fail(f"the master exited with {proc.returncode}:\n{master.tail()}")
        # Any reply proves the REP socket is up: an unregistered ping is unknown_worker.
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 500)
        sock.setsockopt(zmq.SNDTIMEO, 500)
        try:
            sock.connect(master.rep)
            sock.send_multipart(encode("ping", {"worker_id": "nobody"}))
            return decode(sock.recv_multipart()).kind == "error"
        except zmq.Again:
            return False
        finally:
            sock.close()

    try:
        wait_for(answers, 60, "the master to answer on REP")
    except BaseException:
        kill_tree(proc)
        raise
    return master


@pytest.fixture
def fresh_master(tmp_path: Path) -> Iterator[Callable[..., RawMaster]]:
    """Factory of masters private to one test (for inputs that may take a master down)."""
    started: list[RawMaster] = []

    def start(**kw: Any) -> RawMaster:
        m = start_master(tmp_path, **kw)
        started.append(m)
        return m

    try:
        yield start
    finally:
        for m in started:
            kill_tree(m.proc)


def assert_error(reply: Message, code: str) -> None:
    assert reply.kind == "error", reply
    assert reply.body.get("code") == code, reply.body
    message = reply.body.get("message")
    assert isinstance(message, str) and message and "\n" not in message


# --------------------------------------------------------------------------------------------
# A master in the joining phase
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def joining(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawMaster]:
    """Expects w1 and w2 (min_workers 2, join_timeout 600 s); only w1 registers, so it stays
    in `joining` for the whole module."""
    master = start_master(tmp_path_factory.mktemp("joining"))
    try:
        welcome = master.register("w1")
        assert welcome.kind == "welcome" and welcome.body["phase"] == "joining", welcome
        yield master
    finally:
        kill_tree(master.proc)


def _header(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": "ping", "body": {"worker_id": "w1"},
                          "arrays": [], **fields}, use_bin_type=True)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


JOINING_CASES = {
    "truncated-one-frame": ([b"ping"], "malformed"),
    "garbage-header": ([b"ping", b"\xc1\xc1 this is not msgpack"], "malformed"),
    "header-not-a-map": ([b"ping", msgpack.packb([1, 2, 3])], "malformed"),
    "header-without-kind": ([b"ping", _header(kind="")], "malformed"),
    "missing-array-frame": ([b"ping", _header(arrays=[["a", "<f4", [2]]])], "malformed"),
    # Empty, so its bytes matched, but numpy cannot hold its other sizes: reshape raised
    # ValueError in the decoder, which ended the master.
    "empty-array-of-impossible-sizes": (
        [b"ping", _header(arrays=[["a", "<f4", [2**39, 2**39, 0]]]), b""], "shape"),
    "wrong-version": ([b"ping", _header(v=99)], "version"),
    "unknown-kind": (encode("dance", {"worker_id": "w1"}), "unknown_kind"),
    "missing-field": (encode("register", {"worker_id": "w2", "n_samples": 1, "device": "cpu"}),
                      "bad_field"),
    "missing-worker-id": (encode("ping", {}), "bad_field"),
    # Its repr raised RecursionError before the master's guard: one ping ended the master.
    "worker-id-nested-deep": ([b"ping", _header(body={"worker_id": _nested(1000)})],
                              "bad_field"),
    "wrong-field-type": (encode("register", {"worker_id": "w2", "n_samples": "many",
                                             "device": "cpu", "info": INFO}), "bad_field"),
    "negative-n-samples": (encode("register", {"worker_id": "w2", "n_samples": -1,
                                               "device": "cpu", "info": INFO}), "bad_field"),
    "register-not-in-list": (encode("register", {"worker_id": "w99", "n_samples": 1,
                                                 "device": "cpu", "info": INFO}),
                             "unknown_worker"),
    "ping-unregistered": (encode("ping", {"worker_id": "w2"}), "unknown_worker"),
    "fetch-before-model": (encode("fetch", {"worker_id": "w1"}), "not_ready"),
    "update-while-joining": (encode("update", {"worker_id": "w1", "round": 1, "version": 0,
                                               "n_samples": 1, "metrics": {}},
                                    {"a": np.zeros(2, np.float32)}), "stale_round"),
}


@pytest.mark.parametrize("case", list(JOINING_CASES))
def test_joining_master_refuses(joining: RawMaster, case: str) -> None:
    frames, code = JOINING_CASES[case]
    assert_error(joining.request(frames), code)
    pong = joining.ping("w1")
    assert pong.kind == "pong" and pong.body["phase"] == "joining", pong
    assert joining.alive()


def test_joining_master_registered_only_w1(joining: RawMaster) -> None:
    # None of the refused registrations (w2 with bad fields, w99) was recorded.
    assert [e["worker"] for e in events(joining.out, "register")] == ["w1"]
    assert joining.ping("w1").body == {"phase": "joining", "round": 0, "version": 0}
    assert joining.alive()


# --------------------------------------------------------------------------------------------
# A master in the training phase, round 1 open
# --------------------------------------------------------------------------------------------


@dataclass
class Training:
    master: RawMaster
    model: dict[str, np.ndarray]  # round 1's global arrays, as fetched
    version: int

    def update(self, worker_id: str = "w2", arrays: dict[str, np.ndarray] | None = None,
               **body: Any) -> Message:
        fields = {"worker_id": worker_id, "round": 1, "version": self.version,
                  "n_samples": 10, "metrics": {"macro_f1": 0.5, "train_time": 0.01}, **body}
        return self.master.send("update", fields, self.model if arrays is None else arrays)


def _drive_into_training(master: RawMaster) -> Training:
    """Register w1 and w2 by hand; check round 1 is published on PUB and fetch it."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(master.pub)
    try:
        # Slow joiner: register only once an announcement proves the subscription is live.
        def receive(kind: str) -> Message | None:
            if sub.poll(200, zmq.POLLIN):
                msg = decode(sub.recv_multipart())
                return msg if msg.kind == kind else None
            return None

        announce = wait_for(lambda: receive("announce"), 30, "an announcement")
        assert announce.body["phase"] == "joining"
        for w in ("w1", "w2"):
            welcome = master.register(w)
            assert welcome.kind == "welcome", welcome
        broadcast = wait_for(lambda: receive("round"), 60, "round 1 on PUB")
    finally:
        sub.close()
    assert broadcast.topic == b"round"
    assert broadcast.body["round"] == 1 and broadcast.body["version"] == 0
    assert broadcast.body["setup"] == {"classes": CLASSES, "input_dim": 384}
    fetched = master.send("fetch", {"worker_id": "w1"})
    assert fetched.kind == "model" and fetched.body["round"] == 1, fetched
    assert fetched.arrays.keys() == broadcast.arrays.keys()
    for name, a in fetched.arrays.items():
        np.testing.assert_array_equal(a, broadcast.arrays[name])
    model = {name: np.array(a) for name, a in fetched.arrays.items()}  # writable copies
    return Training(master, model, int(fetched.body["version"]))


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Training]:
    master = start_master(tmp_path_factory.mktemp("training"), rounds=3)
    try:
        yield _drive_into_training(master)
    finally:
        kill_tree(master.proc)


def test_training_master_sends_the_mlp(training: Training) -> None:
    shapes = {name: a.shape for name, a in training.model.items()}
    assert shapes == {"0.weight": (256, 384), "0.bias": (256,), "2.weight": (2, 256),
                      "2.bias": (2,)}
    assert all(a.dtype == np.float32 for a in training.model.values())
    assert training.version == 0


def _reshaped(m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**m, "0.weight": m["0.weight"].reshape(384, 256)}  # same bytes, wrong shape


def _float64(m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**m, "0.bias": m["0.bias"].astype(np.float64)}


def _missing(m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in m.items() if k != "2.bias"}


def _extra(m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**m, "3.weight": np.zeros((2, 2), np.float32)}


def _with(value: float) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    def change(m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        w = m["2.weight"].copy()
        w[1, 7] = value
        return {**m, "2.weight": w}

    return change


UPDATE_CASES: dict[str, tuple[Callable | None, dict[str, Any], str]] = {
    "wrong-shape": (_reshaped, {}, "shape"),
    "wrong-dtype-float64": (_float64, {}, "dtype"),
    "missing-array": (_missing, {}, "shape"),
    "extra-array": (_extra, {}, "shape"),
    "nan": (_with(float("nan")), {}, "not_finite"),
    "inf": (_with(float("inf")), {}, "not_finite"),
    "unknown-worker": (None, {"worker_id": "w9"}, "unknown_worker"),
    "past-round": (None, {"round": 0}, "stale_round"),
    "future-round": (None, {"round": 2}, "stale_round"),
    "wrong-version": (None, {"version": 5}, "stale_round"),
    "zero-samples": (None, {"n_samples": 0}, "bad_field"),
    "metrics-not-a-map": (None, {"metrics": [1, 2]}, "bad_field"),
    # (a list nested 1,000 deep raised RecursionError in the handler, a traceback logged a
    # request: 1 GB of log an hour at the rate one sender is allowed)
    "compression-not-a-name": (None, {"compression": [[[["topk"]]]]}, "bad_field"),
}


@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_training_master_refuses_update(training: Training, case: str) -> None:
    change, body, code = UPDATE_CASES[case]
    arrays = change(training.model) if change else None
    assert_error(training.update(arrays=arrays, **body), code)
    pong = training.master.ping("w1")
    assert pong.kind == "pong" and pong.body == {"phase": "training", "round": 1, "version": 0}
    assert training.master.alive()


def test_training_master_refuses_frame_shorter_than_its_shape(training: Training) -> None:
    frames = encode("update", {"worker_id": "w2", "round": 1, "version": 0, "n_samples": 10,
                               "metrics": {}}, training.model)
    frames[-1] = bytes(frames[-1])[:-4]  # the last array's buffer, one float short
    assert_error(training.master.request(frames), "shape")
    assert training.master.ping("w1").kind == "pong"


def test_training_master_refuses_register_not_in_list(training: Training) -> None:
    assert_error(training.master.register("w99"), "unknown_worker")
    assert training.master.ping("w1").body["phase"] == "training"
    assert "w99" not in {e["worker"] for e in events(training.master.out, "register")}


def test_duplicate_update_is_acked_and_counted_once(training: Training) -> None:
    """Updates are keyed by (worker, round): a resend is ACKed with duplicate: true and does not
    count again, neither in n_updates nor in the FedAvg weights."""
    base = training.model
    up1 = {k: v + np.float32(1.0) for k, v in base.items()}
    up2 = {k: v + np.float32(3.0) for k, v in base.items()}
    first = training.update("w1", up1, n_samples=10)
    assert first.kind == "ack" and first.body == {"round": 1, "duplicate": False}, first
    for _ in range(2):
        again = training.update("w1", up1, n_samples=10)
        assert again.kind == "ack" and again.body == {"round": 1, "duplicate": True}, again
    assert training.master.ping("w1").body["round"] == 1  # w2 has not reported: still open
    last = training.update("w2", up2, n_samples=30)
    assert last.kind == "ack" and last.body == {"round": 1, "duplicate": False}, last

    out = training.master.out
    (closed,) = wait_for(lambda: events(out, "round"), 30, "round 1 to close")
    assert closed["round"] == 1 and closed["n_updates"] == 2 and closed["missing"] == []
    assert sorted(e["worker"] for e in events(out, "worker_round")) == ["w1", "w2"]
    pong = training.master.ping("w1")
    assert pong.body == {"phase": "training", "round": 2, "version": 1}

    # FedAvg weighs w1 by 10 and w2 by 30: base + (10*1 + 30*3) / 40 = base + 2.5. Had the
    # resends counted, w1 would weigh 30 and the shift would be (30*1 + 30*3) / 60 = 2.
    model = training.master.send("fetch", {"worker_id": "w1"})
    assert model.body["version"] == 1
    for name, a in model.arrays.items():
        np.testing.assert_allclose(a, base[name] + 2.5, rtol=0, atol=1e-5)

    # An update for the closed round is now stale, and the master still serves.
    assert_error(training.update("w1", up1), "stale_round")
    assert training.master.alive()


def test_training_master_still_alive(training: Training) -> None:
    assert training.master.alive()
    assert training.master.ping("w2").kind == "pong"


# --------------------------------------------------------------------------------------------
# Inputs that once took the master down: a master of their own each
# --------------------------------------------------------------------------------------------


def _close_round_with_metrics(t: Training, metrics: dict[str, Any]) -> None:
    """Both workers send the open round an update with ``metrics`` (refused), then a good one;
    the round closes and the master lives on into the next."""
    master = t.master
    rnd = master.ping("w1").body["round"]
    for w in ("w1", "w2"):
        reply = t.update(w, round=rnd, metrics=metrics)
        # Refused with a clear error, the worker can send a good update after it.
        assert reply.kind == "error" and reply.body["code"] == "bad_field", reply
        ack = t.update(w, round=rnd)
        assert ack.kind == "ack" and not ack.body["duplicate"], ack

    def round_closed_or_master_gone() -> bool:
        return not master.alive() or master.ping("w1").body["round"] > rnd

    wait_for(round_closed_or_master_gone, 30, f"round {rnd} to close")
    time.sleep(0.5)  # let the master act on what follows the round's close
    assert master.alive(), f"the master died at round {rnd}'s close:\n{master.tail(4)}"
    assert master.ping("w1").body["round"] == rnd + 1


def _fetch_open_round(master: RawMaster, rnd: int) -> Training:
    fetched = master.send("fetch", {"worker_id": "w1"})
    assert fetched.kind == "model" and fetched.body["round"] == rnd, fetched
    return Training(master, {n: np.array(a) for n, a in fetched.arrays.items()},
                    int(fetched.body["version"]))


def test_bad_metrics_and_report_do_not_kill_master(fresh_master: Callable[..., RawMaster]
                                                   ) -> None:
    """Three inputs that once took the master down, one master through its whole job: a
    metric named `round` (round 1's close), a metric that is not a number (round 2's), a
    report whose score is not a number (after round 3)."""
    # (heartbeat_timeout: w2, last heard in round 3, must still count as alive when the
    # reports come, however slowly this machine gets there)
    master = fresh_master(rounds=3, heartbeat_timeout=600)
    t = _drive_into_training(master)
    _close_round_with_metrics(t, {"macro_f1": 0.5, "round": 7})
    assert [e["round"] for e in wait_for(lambda: events(master.out, "round"), 30,
                                         "round 1's event")] == [1]
    _close_round_with_metrics(_fetch_open_round(master, 2),
                              {"macro_f1": 0.5, "train_time": "slow"})

    t = _fetch_open_round(master, 3)
    for w in ("w1", "w2"):
        assert t.update(w, round=3).kind == "ack"
    wait_for(lambda: not master.alive() or master.ping("w1").body["phase"] != "training", 30,
             "round 3 to close")
    good = {"federated": {"macro_f1": 0.5, "accuracy": 0.9}, "local_only": None,
            "n_train": 10, "n_test": 5}
    bad = master.send("report", {"worker_id": "w1", "report": {**good,
                                                               "federated": {"macro_f1": "hi"}}})
    if bad.kind == "error":  # refusing it is fine too; then w1 sends a good one
        assert bad.body["code"] == "bad_field"
        assert master.send("report", {"worker_id": "w1", "report": good}).kind == "ack"
    assert master.send("report", {"worker_id": "w2", "report": good}).kind == "ack"
    try:
        master.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the master did not finish:\n{master.tail()}")
    assert master.proc.returncode == 0, master.tail(6)
    assert (master.out / "summary.json").exists()
    assert [e["round"] for e in events(master.out, "round")] == [1, 2, 3]


def test_bad_register_info_does_not_kill_master(fresh_master: Callable[..., RawMaster]) -> None:
    master = fresh_master()
    reply = master.register("w1", {"input_dim": "three hundred", "classes": CLASSES})
    if reply.kind == "error":  # refusing it is fine; then w1 registers properly
        assert reply.body["code"] in ("bad_field", "rejected")
        assert master.register("w1").kind == "welcome"
    assert master.register("w2").kind == "welcome"

    def started() -> str | None:
        if not master.alive():
            return "dead"
        # The master builds its first torch model in between: on a loaded 2-core machine
        # that alone has taken over 2 s.
        phase = master.ping("w2", timeout_ms=30_000).body["phase"]
        return None if phase == "joining" else phase

    assert wait_for(started, 60, "the job to start") == "training", master.tail(4)
    assert master.alive()


def test_made_up_names_do_not_grow_the_masters_tables(fresh_master: Callable[..., RawMaster]
                                                       ) -> None:
    """Without CURVE a name costs nothing: each refused sender was kept, and logged, by name
    (200,000 pings under new names: 85 MB of log, 100 MB of memory)."""
    from common.constants import MAX_REFUSED_SENDERS

    master = fresh_master()
    for i in range(MAX_REFUSED_SENDERS + 200):
        assert_error(master.ping(f"made-up-{i}"), "unknown_worker")
    assert master.alive()
    logged = [line for line in master.log.read_text().splitlines()
              if "refused a request from" in line]
    assert MAX_REFUSED_SENDERS <= len(logged) <= MAX_REFUSED_SENDERS + 1
    assert "'(other senders)'" in logged[-1]
