"""A hostile member of the cluster, for the trust tests: it holds one admitted key and sends
whatever a peer can put on the wire, following docs/PROTOCOL.md where it suits it.

Plain pyzmq, msgpack and numpy, none of fedctl's transport: what an attacker who read the
protocol would write. Every request has a time-out, and a request the master cuts off (a frame
over its limit) comes back as ``None``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.auth

PROTOCOL_VERSION = 1


def frames(kind: str, body: dict[str, Any], arrays: dict[str, np.ndarray] | None = None
           ) -> list[bytes | memoryview]:
    """``[kind][msgpack header][array bytes]...`` as docs/PROTOCOL.md describes."""
    arrays = arrays or {}
    specs = [[n, a.dtype.str, list(a.shape)] for n, a in arrays.items()]
    header = msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, "body": body, "arrays": specs})
    return [kind.encode(), header, *(np.ascontiguousarray(a).data for a in arrays.values())]


def nested_lists_header(size: int) -> bytes:
    """A msgpack header of about ``size`` bytes that is one list of empty lists: cheap to send,
    56 bytes of Python per byte to decode."""
    n = size - 5
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


class Hostile:
    """Requests and subscriptions with the key of ``key_of``.

    Parameters
    ----------
    ctx : zmq.Context
    rep, pub : str
        The master's REP and PUB endpoints.
    keys_dir : Path
        A ``fedctl keygen`` folder.
    key_of : str, default "w1"
        Whose key this client holds.
    timeout : float, default 10
        Seconds to wait for each reply.
    """

    def __init__(self, ctx: zmq.Context, rep: str, pub: str, keys_dir: Path,
                 key_of: str = "w1", timeout: float = 10.0) -> None:
        self.ctx, self.rep, self.pub, self.timeout = ctx, rep, pub, timeout
        keys = Path(keys_dir)
        self.public, self.secret = zmq.auth.load_certificate(
            keys / "workers" / f"{key_of}.key_secret")
        self.server_public, _ = zmq.auth.load_certificate(keys / "master.key")
        self._sock: zmq.Socket | None = None

    def _secure(self, sock: zmq.Socket) -> zmq.Socket:
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        sock.curve_serverkey = self.server_public
        sock.linger = 0
        sock.sndtimeo = int(1000 * self.timeout)  # (a failed handshake leaves no pipe)
        return sock

    def send_frames(self, parts: list[Any], timeout: float | None = None
                    ) -> dict[str, Any] | None:
        """Send raw frames as a request; the reply's header (``kind``, ``body``) and its arrays
        (under ``"arrays"``), or None if no reply came in time (the socket is then reopened)."""
        if self._sock is None:
            self._sock = self._secure(self.ctx.socket(zmq.REQ))
            self._sock.connect(self.rep)
        try:
            self._sock.send_multipart(parts, copy=True)  # libzmq owns what it may drop
            sent = True
        except zmq.Again:
            sent = False
        if not sent or not self._sock.poll(int(1000 * (timeout or self.timeout)), zmq.POLLIN):
            self._sock.close()
            self._sock = None
            return None
        reply = self._sock.recv_multipart()
        header = msgpack.unpackb(reply[1])
        header["arrays"] = {name: np.frombuffer(buf, dtype=dt).reshape(shape)
                            for (name, dt, shape), buf in zip(header["arrays"], reply[2:],
                                                               strict=True)}
        return header

    def request(self, kind: str, body: dict[str, Any],
                arrays: dict[str, np.ndarray] | None = None) -> dict[str, Any] | None:
        return self.send_frames(frames(kind, body, arrays))

    def code(self, kind: str, body: dict[str, Any],
             arrays: dict[str, np.ndarray] | None = None) -> str:
        """The reply's kind, or its error code for an ``error`` reply ("no reply" if none)."""
        reply = self.request(kind, body, arrays)
        if reply is None:
            return "no reply"
        return reply["body"]["code"] if reply["kind"] == "error" else reply["kind"]

    def subscribe(self, *topics: bytes) -> zmq.Socket:
        """A SUB socket with this key, subscribed to ``topics`` (everything by default)."""
        sub = self._secure(self.ctx.socket(zmq.SUB))
        for t in topics or (b"",):
            sub.setsockopt(zmq.SUBSCRIBE, t)
        sub.connect(self.pub)
        return sub

    def flood(self, sockets: int, each: int, worker_id: str = "w1") -> dict[str, int]:
        """Pipelined pings from ``sockets`` DEALER sockets, ``each`` apiece, all sent before any
        reply is read; returns the reply codes counted."""
        body = frames("ping", {"worker_id": worker_id})
        socks = [self._secure(self.ctx.socket(zmq.DEALER)) for _ in range(sockets)]
        for s in socks:
            s.sndhwm = s.rcvhwm = 0
            s.connect(self.rep)
        for s in socks:
            for _ in range(each):
                s.send_multipart([b"", *body])
        counts: dict[str, int] = {}
        deadline = time.monotonic() + 60
        left = sockets * each
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        while left and time.monotonic() < deadline:
            for s, _ in poller.poll(500):
                while left:
                    try:
                        parts = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    header = msgpack.unpackb(parts[2])
                    key = header["body"]["code"] if header["kind"] == "error" else header["kind"]
                    counts[key] = counts.get(key, 0) + 1
                    left -= 1
        for s in socks:
            s.close()
        return counts

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class RssWatch(threading.Thread):
    """Samples a process's resident memory (``/proc/<pid>/status``) every 50 ms; ``peak`` in
    bytes."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak = pid, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmRSS:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)

    def stop(self) -> int:
        self.stopped.set()
        self.join(timeout=1)
        return self.peak
