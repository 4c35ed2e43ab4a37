"""CURVE security over real processes: admitted workers train, everyone else is refused, and the
bytes on the wire are not readable (captured by a TCP relay between a worker and the master).
"""

from __future__ import annotations

import select
import shutil
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
import zmq.auth

from common.net.security import client_keys, keygen
from common.net.wire import encode
from tests.conftest import MakeConfig, Procs, events, free_port, run_fedctl

pytestmark = pytest.mark.slow


class Relay(threading.Thread):
    """A TCP relay on loopback that records every byte the client sends to the server."""

    def __init__(self, target_port: int) -> None:
        super().__init__(daemon=True)
        self.target = target_port
        self.port = free_port()
        self.captured = bytearray()
        self.stopped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.listener.settimeout(0.2)

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # stop() closed the listener while accept() waited
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the server has gone (a client reconnecting at the end of a run)
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peers = {client: server, server: client}
        try:
            while not self.stopped.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.2)
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        self.captured += data
                    peers[s].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=1.0)  # accept() returns within its 0.2 s timeout
        self.listener.close()


def _secure_config(make_config: MakeConfig, tmp_path: Path, mode: str = "curve") -> Path:
    keys = tmp_path / "keys"
    security = {"mode": mode, "keys_dir": str(keys)} if mode == "curve" else {"mode": "none"}
    return make_config(tmp_path, workers=2, rounds=3, security=security)


def _relayed(cfg: Path, relay: Relay, name: str) -> Path:
    raw = yaml.safe_load(cfg.read_text())
    raw["master"]["rep_port"] = relay.port
    path = cfg.with_name(name)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _run_with_capture(make_config: MakeConfig, tmp_path: Path, procs: Procs, mode: str,
                      before_w2: Callable[[Path], None] | None = None) -> tuple[bytes, Path]:
    """A run of master, w1 (through the relay) and w2; ``before_w2(cfg)``, if given, runs once
    the master and w1 are started, and w2 starts after it (so the master is still waiting)."""
    cfg = _secure_config(make_config, tmp_path, mode)
    if mode == "curve":
        result = run_fedctl("keygen", "--config", str(cfg))
        assert result.returncode == 0, result.stderr
    relay = Relay(yaml.safe_load(cfg.read_text())["master"]["rep_port"])
    relay.start()
    try:
        procs.master(cfg)
        procs.worker(_relayed(cfg, relay, "w1.yaml"), "w1")
        if before_w2 is not None:
            before_w2(cfg)
        procs.worker(cfg, "w2")
        codes = procs.wait_all(timeout=240)
    finally:
        relay.stop()
    cluster = {n: c for n, c in codes.items() if n not in ("rogue", "stale", "plain", "curvy")}
    assert cluster == {"master": 0, "w1": 0, "w2": 0}, procs.logs_tail()
    return bytes(relay.captured), tmp_path / "out"


def _request(endpoint: str, setup: Any = None, timeout_ms: int = 2000) -> bool:
    """Whether a `ping` sent with these socket options gets any reply."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if setup is not None:
        setup(sock)
    # (a handshake failed on a protocol error, plaintext against CURVE, leaves the REQ socket
    # no pipe: unbounded, the send blocked for good, one run in a few)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode("ping", {"worker_id": "w1"}))
        return bool(sock.poll(timeout_ms))
    except zmq.Again:
        return False
    finally:
        sock.close()


def test_curve_run_is_unreadable_on_the_wire_and_refuses_other_keys(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """One CURVE cluster for both sides: while its master waits for w2, unknown keys and
    plaintext get no reply and a whole worker process holding a key the master never admitted
    (w2's name, a rogue pair) cannot even read the announcements; then the real w2 comes and
    the job runs with nothing readable on the wire."""

    def refuse_rogues(cfg: Path) -> None:
        keygen(tmp_path / "rogue", ["w2"])  # a key pair the master never admitted
        raw = yaml.safe_load(cfg.read_text())
        rep = f"tcp://127.0.0.1:{raw['master']['rep_port']}"
        admitted = client_keys(tmp_path / "keys", "w1")
        # The control: the admitted key is answered (the master may still be starting).
        assert _request(rep, admitted.setup, timeout_ms=60_000)

        # A whole worker process with an unadmitted key (started now that the master serves,
        # so that it has the master to listen to; it imports torch while the pings go on).
        raw["security"]["keys_dir"] = str(tmp_path / "rogue")
        # How long it would listen for an announcement: a refused key ends it well before.
        raw["join_timeout"] = 600
        rogue_cfg = tmp_path / "rogue.yaml"
        rogue_cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        (tmp_path / "rogue" / "master.key").write_bytes((tmp_path / "keys" / "master.key")
                                                        .read_bytes())
        w2 = procs.start("rogue", "worker", "--config", str(rogue_cfg), "--id", "w2",
                         "--threads", "1")
        # w2's own keys beside a master key made again since (a master whose keys were
        # regenerated): the handshake fails, and the worker says which key is wrong.
        stale = tmp_path / "stale"
        shutil.copytree(tmp_path / "keys", stale)
        zmq.auth.create_certificates(stale, "master")
        raw["security"]["keys_dir"] = str(stale)
        stale_cfg = tmp_path / "stale.yaml"
        stale_cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        stale_w2 = procs.start("stale", "worker", "--config", str(stale_cfg), "--id", "w2",
                               "--threads", "1")
        # A worker whose config has no security section: it waited out its join timeout,
        # then asked whether the port was reachable.
        raw["security"] = {"mode": "none"}
        plain_cfg = tmp_path / "plain.yaml"
        plain_cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        plain_w2 = procs.start("plain", "worker", "--config", str(plain_cfg), "--id", "w2",
                               "--threads", "1")

        rogue = client_keys(tmp_path / "rogue", "w2")
        rogue.server_public = admitted.server_public  # it knows the master's public key, even so
        assert not _request(rep, rogue.setup)
        assert not _request(rep)  # plaintext
        assert w2.wait(timeout=90) != 0
        assert "the master refused this worker's key" in procs.log("rogue"), procs.log("rogue")
        assert "admitted" in procs.log("rogue")
        assert stale_w2.wait(timeout=90) != 0
        assert "is not the master's public key" in procs.log("stale"), procs.log("stale")
        assert plain_w2.wait(timeout=90) != 0
        assert ("the master runs with CURVE security and this worker's config has none"
                in procs.log("plain")), procs.log("plain")
        assert "no announcement" not in procs.log("rogue") + procs.log("stale") + procs.log(
            "plain")
        # The master names the refusal (it was at debug level, unseen).
        assert "is not among the admitted keys" in procs.log("master")
        assert procs.procs["master"].poll() is None  # still serving, still waiting for w2
        # nobody but the pings and the admitted w1 got through
        assert {e["worker"] for e in events(tmp_path / "out", "register")} <= {"w1"}

    captured, out = _run_with_capture(make_config, tmp_path, procs, "curve", refuse_rogues)
    assert len(events(out, "round")) == 3
    assert "security: CURVE" in procs.log("master")
    regs = events(out, "register")
    assert sorted(e["worker"] for e in regs) == ["w1", "w2"] and not any(e["rejoin"] for e in regs)
    assert len(captured) > 100_000  # the relay did carry w1's registration and updates
    for plain in (b"register", b"update", b"worker_id", b"0.weight", b"macro_f1"):
        assert plain not in captured, plain


def test_plaintext_run_is_readable_on_the_wire(tmp_path: Path, make_config: MakeConfig,
                                               procs: Procs) -> None:
    """The control for the test above: the same capture without CURVE shows the protocol.
    And a worker whose config has CURVE where the master has none says so, not waiting out
    its join timeout to ask whether the port was reachable."""

    def curve_worker(cfg: Path) -> None:
        keys = tmp_path / "keys"
        raw = yaml.safe_load(cfg.read_text())
        raw["security"] = {"mode": "curve", "keys_dir": str(keys)}
        raw["join_timeout"] = 600
        curve_cfg = tmp_path / "curve.yaml"
        curve_cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        assert run_fedctl("keygen", "--config", str(curve_cfg)).returncode == 0
        curvy = procs.start("curvy", "worker", "--config", str(curve_cfg), "--id", "w2",
                            "--threads", "1")
        assert curvy.wait(timeout=90) != 0
        # (the mismatch's own line; once, under load, the three-failures line naming both)
        assert "the master runs without security" in procs.log("curvy"), procs.log("curvy")

    captured, _ = _run_with_capture(make_config, tmp_path, procs, "none", curve_worker)
    assert b"register" in captured and b"0.weight" in captured
    assert "security: none" in procs.log("master")
