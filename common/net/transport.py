"""The thin socket layer: open the four kinds of socket, send and receive messages, Lazy Pirate.

Meaning lives elsewhere (:mod:`common.net.messages`); framing in :mod:`common.net.wire`.
Everything here is small enough to read in one sitting, as the ZeroMQ guide's patterns are.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import zmq

from common import constants as C
from common.net.errors import TOO_LARGE
from common.net.messages import ERROR, REGISTER
from common.net.security import sender_identity
from common.net.wire import Message, ProtocolError, decode, encode, frames_nbytes

log = logging.getLogger("fedctl.transport")


class PeerUnreachable(ConnectionError):
    """A request got no reply after every retry."""


class RemoteError(RuntimeError):
    """The peer answered a request with an ``error`` reply.

    Attributes
    ----------
    code : str
        The reply's error code (see :data:`common.net.messages.ERROR_CODES`).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


SocketSetup = Callable[[zmq.Socket], None]


def _tune(sock: zmq.Socket, setup: SocketSetup | None = None) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, C.LINGER_MS)
    # No ZMTP heartbeats: the workers' own pings already tell liveness, and libzmq 4.3's
    # heartbeat timer can trip an assertion on a connection stalled by a slow consumer
    # (zeromq/libzmq#3937), which killed a worker receiving a 100 MB model.
    sock.copy_threshold = C.ZERO_COPY_THRESHOLD
    if setup is not None:  # security options must be set before bind/connect
        setup(sock)
    return sock


def bind_pub(ctx: zmq.Context, endpoint: str, setup: SocketSetup | None = None) -> zmq.Socket:
    """A PUB socket bound to ``endpoint`` with a bounded send queue."""
    sock = _tune(ctx.socket(zmq.PUB), setup)
    sock.setsockopt(zmq.SNDHWM, C.PUB_SNDHWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, C.HANDSHAKE_IVL_MS)
    sock.bind(endpoint)
    return sock


def bind_rep(ctx: zmq.Context, endpoint: str, max_message_bytes: int = C.MAX_MESSAGE_BYTES,
             setup: SocketSetup | None = None) -> zmq.Socket:
    """A REP socket bound to ``endpoint`` that drops any frame over ``max_message_bytes``
    and queues at most ``REP_RCVHWM`` messages per peer."""
    sock = _tune(ctx.socket(zmq.REP), setup)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, C.REP_RCVHWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, C.HANDSHAKE_IVL_MS)
    sock.bind(endpoint)
    return sock


def connect_sub(ctx: zmq.Context, endpoint: str, topics: Iterable[bytes],
                setup: SocketSetup | None = None) -> zmq.Socket:
    """A SUB socket connected to ``endpoint`` and subscribed to each topic prefix."""
    sock = _tune(ctx.socket(zmq.SUB), setup)
    sock.setsockopt(zmq.RCVHWM, C.SUB_RCVHWM)
    for topic in topics:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, kind: str, body: Mapping[str, Any] | None = None,
         arrays: Mapping[str, np.ndarray] | None = None, topic: bytes | None = None) -> int:
    """Encode and send one message; returns the bytes put on the wire."""
    frames = encode(kind, body, arrays, topic)
    sock.send_multipart(frames, copy=False)
    return frames_nbytes(frames)


def recv(sock: zmq.Socket) -> tuple[Message, int]:
    """Receive and decode one message; returns it and its size in bytes.

    Raises
    ------
    ProtocolError
        If the frames do not decode; the message has been consumed either way.
    """
    frames = sock.recv_multipart(copy=False)
    return decode(frames), frames_nbytes(frames)


def recv_request(sock: zmq.Socket) -> tuple[list[zmq.Frame], int, str | None]:
    """Receive one request's frames, unread; returns them, their total size and the sender's
    identity (the worker its CURVE key names; None without CURVE).

    The caller decodes with :func:`decode_request` once it has decided to serve the sender, so
    a refused or flooding peer costs no decoding.
    """
    frames = sock.recv_multipart(copy=False)
    return frames, frames_nbytes(frames), sender_identity(frames[0])


def decode_request(frames: list[Any], nbytes: int, max_bytes: int = C.MAX_MESSAGE_BYTES
                   ) -> Message:
    """Decode a request under the master's limits: the whole message at most ``max_bytes``,
    a ``register`` header at most ``MAX_HEADER_BYTES`` (it may carry a vocabulary), any other
    at most ``MAX_REQUEST_HEADER_BYTES``.

    Raises
    ------
    ProtocolError
        ``too_large`` for a message over a limit, or whatever :func:`decode` raises.
    """
    if nbytes > max_bytes:
        raise ProtocolError(f"message of {nbytes} bytes exceeds the limit of {max_bytes} "
                            f"(max_message_mb)", code=TOO_LARGE)
    kind = bytes(getattr(frames[0], "buffer", frames[0]))
    limit = C.MAX_HEADER_BYTES if kind == REGISTER.encode() else C.MAX_REQUEST_HEADER_BYTES
    return decode(frames, max_header=limit)


def send_error(sock: zmq.Socket, code: str, message: str) -> int:
    """Answer a request with an ``error`` reply."""
    return send(sock, ERROR, {"code": code, "message": message})


class LazyPirateClient:
    """A REQ client that survives a dead or restarted server (ZeroMQ guide, ch. 4).

    A REQ socket that got no reply is stuck, so on time-out the socket is closed (dropping the
    request), a new one opened, and the request sent again, up to ``retries`` times.

    Parameters
    ----------
    ctx : zmq.Context
    endpoint : str
        e.g. ``"tcp://127.0.0.1:5556"``.
    timeout : float, default constants.REQUEST_TIMEOUT
        Seconds to wait for each reply.
    retries : int, default constants.REQUEST_RETRIES
        Attempts before :class:`PeerUnreachable` is raised.
    setup : callable, optional
        Applied to every new socket before it connects (CURVE keys).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout: float = C.REQUEST_TIMEOUT,
                 retries: int = C.REQUEST_RETRIES, setup: SocketSetup | None = None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout = timeout
        self.retries = retries
        self.setup = setup
        self.bytes_sent = 0
        self.bytes_received = 0
        self._sock: zmq.Socket | None = None

    def _open(self) -> zmq.Socket:
        sock = _tune(self.ctx.socket(zmq.REQ), self.setup)
        sock.setsockopt(zmq.LINGER, 0)  # a dropped request must not linger on close
        # A handshake that fails on a protocol error (a plaintext worker, a CURVE master)
        # takes the socket's only pipe away for good, and a REQ send with no pipe blocked
        # forever: the worker hung without a word. The send is bounded like the reply.
        sock.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
        sock.connect(self.endpoint)
        return sock

    def request(self, kind: str, body: Mapping[str, Any] | None = None,
                arrays: Mapping[str, np.ndarray] | None = None) -> Message:
        """Send a request and return the reply.

        Raises
        ------
        PeerUnreachable
            No reply after every retry.
        RemoteError
            The server answered with an ``error`` reply.
        ProtocolError
            The reply did not decode.
        """
        frames = encode(kind, body, arrays)
        size = frames_nbytes(frames)
        # A big upload takes a while to cross and to check: resending it early only doubles
        # the load, so the wait grows with the size.
        timeout = self.timeout + size / C.MIN_THROUGHPUT
        for attempt in range(1, self.retries + 1):
            if self._sock is None:
                self._sock = self._open()
            try:
                self._sock.send_multipart(frames, copy=False)
                sent = True
            except zmq.Again:  # no connection to send on (SNDTIMEO above)
                sent = False
            else:
                self.bytes_sent += size
            if sent and self._sock.poll(int(timeout * 1000), zmq.POLLIN):
                reply, nbytes = recv(self._sock)
                self.bytes_received += nbytes
                if reply.kind == ERROR:
                    raise RemoteError(str(reply.body.get("code", "?")),
                                      str(reply.body.get("message", "")))
                return reply
            if sent:
                log.warning("no reply to %s from %s in %.1fs (attempt %d/%d)", kind,
                            self.endpoint, timeout, attempt, self.retries)
            else:
                log.warning("no connection to %s to send %s on in %.1fs (attempt %d/%d)",
                            self.endpoint, kind, self.timeout, attempt, self.retries)
            self._sock.close()
            self._sock = None
        raise PeerUnreachable(
            f"no reply to {kind!r} from {self.endpoint} after {self.retries} attempts "
            f"of {self.timeout:.1f}s"
        )

    def close(self) -> None:
        """Close the socket (unsent requests are dropped)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports nobody listens on right now on ``host`` (all bound at once,
    read back, released), for local clusters, tests and benchmarks."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_readable(sockets: Iterable[zmq.Socket], timeout_ms: int) -> set[zmq.Socket]:
    """Poll sockets for input; returns those with a message waiting."""
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    return {s for s, _ in poller.poll(timeout_ms)}


__all__ = [
    "free_ports",
    "LazyPirateClient", "PeerUnreachable", "ProtocolError", "RemoteError", "bind_pub",
    "bind_rep", "connect_sub", "decode_request", "recv", "recv_request", "send", "send_error",
    "wait_readable",
]
