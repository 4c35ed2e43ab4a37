"""Per-worker payloads (iFTM-style) over real sockets: each worker gets a model of its own.

A toy family is registered on both sides for the duration of the test; the master and three
workers run as threads of this process, talking ZeroMQ over TCP loopback exactly as separate
processes would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from common.config import parse_config
from common.net.security import keygen
from master.families import SERVER_FAMILIES, Payload, ServerFamily
from master.server import Master
from master.strategies import ClientResult
from tests.conftest import DATA, free_ports, start_worker_threads
from tests.hostile import Hostile
from worker.families import CLIENT_FAMILIES, ClientFamily, FitResult

WORKERS = ["w1", "w2", "w3"]


class EchoServer(ServerFamily):
    """Keeps one vector per worker; worker i's starts at i and grows by 1 per round."""

    name = "echo"
    per_worker = True

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        self.models = {wid: np.full(4, float(WORKERS.index(wid)), dtype=np.float32)
                       for wid in registrations}
        self.seen: list[tuple[int, str, float]] = []
        self.global_ = Payload({"kind": "echo"}, {"x": np.zeros(4, dtype=np.float32)})
        return self.global_

    def payload_for(self, worker_id: str) -> Payload:
        if worker_id in getattr(self, "models", {}):
            return Payload({"for": worker_id}, {"x": self.models[worker_id]})
        return self.global_

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        for r in results:
            self.seen.append((round_, r.worker_id, float(r.arrays["x"][0])))
            self.models[r.worker_id] = np.array(r.arrays["x"], dtype=np.float32)
        return self.global_


class EchoClient(ClientFamily):
    name = "echo"

    def registration_info(self) -> dict[str, Any]:
        return {}

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        assert meta.get("for") in WORKERS  # a direct payload, not the global one
        return FitResult({"x": np.asarray(arrays["x"]) + 1}, 1, {"train_time": 0.0})

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        return {"x0": float(arrays["x"][0])}


@pytest.fixture
def echo_family():
    SERVER_FAMILIES["echo"], CLIENT_FAMILIES["echo"] = EchoServer, EchoClient
    yield
    del SERVER_FAMILIES["echo"], CLIENT_FAMILIES["echo"]


def test_each_worker_gets_its_own_payload_and_no_other(echo_family, tmp_path) -> None:
    """Over CURVE: each worker trains on its own payload, and a subscriber holding w1's key
    (every admitted key may subscribe to every PUB topic) sees nothing meant for w2 or w3."""
    pub, rep = free_ports(2)
    keys = tmp_path / "keys"
    keygen(keys, WORKERS)
    cfg = parse_config({
        "master": {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub, "rep_port": rep},
        "workers": WORKERS, "model": {"family": "echo"}, "rounds": 3, "min_workers": 3,
        "round_deadline": 30, "join_timeout": 30, "baselines": False,
        "data": {"path": str(DATA), "limit": 60, "partition": "iid"},
        "output_dir": str(tmp_path / "out"),
        "security": {"mode": "curve", "keys_dir": str(keys)},
    })
    master = Master(cfg)
    master.bind()
    ctx = zmq.Context()
    snoop = Hostile(ctx, f"tcp://127.0.0.1:{rep}", f"tcp://127.0.0.1:{pub}", keys, "w1")
    sub = snoop.subscribe()  # every topic
    heard: list[list[bytes]] = []
    fetched: list[str] = []
    warmed: list[str] = []
    stop = threading.Event()

    def listen() -> None:
        # (its REQ socket's CURVE handshake done first, not when round 1 comes: the three
        # echo rounds take milliseconds, and a fetch made then could come after the job's end)
        warmed.append(snoop.code("ping", {"worker_id": "w1"}))
        while not stop.is_set():
            if sub.poll(100):
                heard.append(sub.recv_multipart())
                if heard[-1][0] == b"round" and not fetched:  # w1's key asks for w2's
                    fetched.append(snoop.code("fetch", {"worker_id": "w2"}))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(0.5)  # the subscription reaches the master before round 1
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []
    threads = start_worker_threads(cfg, WORKERS, reports, errors)
    try:
        master.serve()
    finally:
        stop.set()
        listener.join(timeout=30)  # before its sockets close (not thread-safe); a fetch waits 10 s
        sub.close()
        snoop.close()
        ctx.destroy(linger=0)
        master.close()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert warmed and warmed != ["no reply"] and fetched == ["identity"], (warmed, fetched)
    rounds = [msgpack.unpackb(parts[1]) for parts in heard if parts[0] == b"round"]
    assert len(rounds) == 3 and all(r["body"]["per_worker"] for r in rounds)
    assert all(len(parts) == 2 for parts in heard)  # no message on PUB carries an array
    assert not any(b"w2" in b"".join(parts) and b"for" in parts[1] for parts in heard)
    family = master.family
    # Round r: worker i received i + (r - 1) on its own topic and sent back one more.
    for rnd, wid, value in family.seen:
        assert value == WORKERS.index(wid) + rnd
    assert sorted((r, w) for r, w, _ in family.seen) == [(r, w) for r in (1, 2, 3)
                                                         for w in WORKERS]
    # The final fetch also gives each worker its own model.
    for wid in WORKERS:
        assert reports[wid]["federated"]["x0"] == WORKERS.index(wid) + 3
