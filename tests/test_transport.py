"""Tests of common/transport.py and common/messages.py over real ZeroMQ sockets.

Every socket binds tcp://127.0.0.1 on a port the OS picks (port 0); nothing is mocked. Waits are
bounded by deadlines, and the one server that must not answer is synchronised on a socket
monitor event rather than a sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.net import messages as M
from common.net.transport import (
    LazyPirateClient,
    PeerUnreachable,
    RemoteError,
    bind_pub,
    bind_rep,
    connect_sub,
    free_ports,
    recv,
    send,
    send_error,
    wait_readable,
)
from common.net.wire import Message, ProtocolError, encode, frames_nbytes

ANY_PORT = "tcp://127.0.0.1:0"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def endpoint_of(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def unused_endpoint(ctx: zmq.Context) -> str:
    """An endpoint nobody listens on: a port the OS just handed out and that was released."""
    s = ctx.socket(zmq.REP)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(linger=0)
    return f"tcp://127.0.0.1:{port}"


class Server:
    """A REP server on its own thread: ``handler(sock, msg)`` answers each request.

    The socket is created here and handed to the thread before it starts; the test thread never
    touches it again.
    """

    def __init__(self, ctx: zmq.Context, handler: Callable[[zmq.Socket, Message, int], None],
                 max_message_bytes: int | None = None) -> None:
        kw = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        self.sock = bind_rep(ctx, ANY_PORT, **kw)
        self.endpoint = endpoint_of(self.sock)
        self.handler = handler
        self.received: list[Message] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.sock.poll(20, zmq.POLLIN):
                    try:
                        msg, nbytes = recv(self.sock)
                    except ProtocolError as exc:
                        send_error(self.sock, exc.code, str(exc))
                        continue
                    self.received.append(msg)
                    self.handler(self.sock, msg, nbytes)
        except BaseException as exc:  # noqa: BLE001 - surfaced by __exit__
            self.errors.append(exc)
        finally:
            self.sock.close(linger=0)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        assert self.errors == []


def checking_handler(sock: zmq.Socket, msg: Message, nbytes: int) -> None:
    """Validate like the master does, then acknowledge with the request's size."""
    try:
        M.check_request(msg.kind, msg.body)
    except ProtocolError as exc:
        send_error(sock, exc.code, str(exc))
        return
    send(sock, M.ACK, {"kind": msg.kind, "nbytes": nbytes,
                       "arrays": {k: list(a.shape) for k, a in msg.arrays.items()}})


# ---------------------------------------------------------------------------- PUB/SUB, REQ/REP
def publish_until_received(pub: zmq.Socket, sub: zmq.Socket, kind: str, body: dict,
                           arrays: dict | None = None, topic: bytes | None = None,
                           deadline_s: float = 5.0) -> tuple[Message, int, int]:
    """Publish repeatedly until the SUB gets one (PUB drops messages before the subscription
    has reached it). Returns the message, its received size, and the size sent."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        sent = send(pub, kind, body, arrays, topic=topic)
        if sub.poll(50, zmq.POLLIN):
            msg, nbytes = recv(sub)
            return msg, nbytes, sent
    raise AssertionError(f"no {kind!r} message reached the subscriber in {deadline_s}s")


def test_pub_sub_roundtrip(ctx):
    pub = bind_pub(ctx, ANY_PORT)
    sub = connect_sub(ctx, endpoint_of(pub), [M.TOPIC_ROUND])
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    msg, nbytes, sent = publish_until_received(
        pub, sub, M.ROUND, {"round": 4, "version": 7}, {"w": w, "b": np.ones(4)},
        topic=M.TOPIC_ROUND)
    assert msg.kind == M.ROUND and msg.topic == M.TOPIC_ROUND
    assert msg.body == {"round": 4, "version": 7}
    assert list(msg.arrays) == ["w", "b"]
    np.testing.assert_array_equal(msg.arrays["w"], w)
    assert nbytes == sent == frames_nbytes(encode(M.ROUND, {"round": 4, "version": 7},
                                                  {"w": w, "b": np.ones(4)}, M.TOPIC_ROUND))


def test_req_rep_roundtrip(ctx):
    rep = bind_rep(ctx, ANY_PORT)
    req = ctx.socket(zmq.REQ)
    req.connect(endpoint_of(rep))
    arr = np.arange(100_000, dtype=np.float64)  # above the zero-copy threshold
    sent = send(req, M.UPDATE, {"worker_id": "w1", "round": 1}, {"theta": arr})
    assert wait_readable([rep], 5000) == {rep}
    msg, nbytes = recv(rep)
    assert nbytes == sent
    assert msg.kind == M.UPDATE and msg.topic == M.UPDATE.encode()
    assert msg.body == {"worker_id": "w1", "round": 1}
    np.testing.assert_array_equal(msg.arrays["theta"], arr)
    reply_sent = send(rep, M.ACK, {"ok": True})
    assert req.poll(5000, zmq.POLLIN)
    reply, reply_n = recv(req)
    assert reply.kind == M.ACK and reply.body == {"ok": True} and reply_n == reply_sent


def test_wait_readable_times_out_empty(ctx):
    rep = bind_rep(ctx, ANY_PORT)
    t0 = time.monotonic()
    assert wait_readable([rep], 100) == set()
    assert time.monotonic() - t0 >= 0.05


# ---------------------------------------------------------------------------- Lazy Pirate
def test_lazy_pirate_retries_after_an_ignored_request(ctx):
    rep = bind_rep(ctx, ANY_PORT)
    endpoint = endpoint_of(rep)
    monitor = rep.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    seen: list[Message] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            assert rep.poll(10_000, zmq.POLLIN)
            seen.append(recv(rep)[0])  # read the first request ... and never answer it.
            # The client gives up on that socket and closes it; only then may this REP socket
            # move on (it must send before it can receive): the reply goes to the closed
            # connection and is dropped.
            assert monitor.poll(10_000, zmq.POLLIN)
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            send(rep, M.ACK, {"answer": "to the first, lost"})
            assert rep.poll(10_000, zmq.POLLIN)
            msg, _ = recv(rep)
            seen.append(msg)
            send(rep, M.PONG, {"answer": "second"})
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    # (1 s, not 0.3: the lost reply and the second answer must both fit in the second
    # attempt's wait, on a loaded machine too)
    client = LazyPirateClient(ctx, endpoint, timeout=1.0, retries=3)
    t0 = time.monotonic()
    reply = client.request(M.PING, {"worker_id": "w1"})
    elapsed = time.monotonic() - t0
    thread.join(10)
    client.close()
    assert errors == []
    assert reply.kind == M.PONG and reply.body == {"answer": "second"}
    assert [m.kind for m in seen] == [M.PING, M.PING]
    assert seen[0].body == seen[1].body == {"worker_id": "w1"}
    assert elapsed >= 1.0  # one full time-out was waited out
    size = frames_nbytes(encode(M.PING, {"worker_id": "w1"}))
    assert client.bytes_sent == 2 * size
    assert client.bytes_received == frames_nbytes(encode(M.PONG, {"answer": "second"}))
    monitor.close(linger=0)


def test_lazy_pirate_without_a_server_raises_peer_unreachable(ctx):
    endpoint = unused_endpoint(ctx)
    client = LazyPirateClient(ctx, endpoint, timeout=0.2, retries=3)
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable) as info:
        client.request(M.PING, {"worker_id": "w1"})
    elapsed = time.monotonic() - t0
    assert 0.6 * 0.9 <= elapsed < 0.6 + 5  # (three waits, not one left unbounded)
    assert "3 attempts" in str(info.value) and endpoint in str(info.value)
    assert isinstance(info.value, ConnectionError)
    assert client.bytes_sent == 3 * frames_nbytes(encode(M.PING, {"worker_id": "w1"}))
    assert client.bytes_received == 0
    client.close()
    client.close()  # idempotent


def test_lazy_pirate_gives_up_on_a_server_whose_handshake_it_fails(ctx):
    """A plaintext client and a CURVE server: ZeroMQ drops the connection on the mechanism
    mismatch and does not reconnect, leaving the REQ socket no pipe, and a send made after
    that blocked forever (a test hung minutes in CI on such a ping, its process slowed by the
    others). Each attempt's send is bounded."""

    class Busy(LazyPirateClient):  # a process slowed between connecting and sending
        def _open(self) -> zmq.Socket:
            sock = super()._open()
            time.sleep(0.3)
            return sock

    public, secret = zmq.curve_keypair()
    server = ctx.socket(zmq.REP)
    server.curve_server, server.curve_secretkey, server.curve_publickey = True, secret, public
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = Busy(ctx, f"tcp://127.0.0.1:{port}", timeout=0.3, retries=3)
    raised: list[BaseException] = []

    def request() -> None:
        try:
            client.request(M.PING, {"worker_id": "w1"})
        except BaseException as exc:  # noqa: BLE001 (read below)
            raised.append(exc)

    asker = threading.Thread(target=request, daemon=True)
    asker.start()
    asker.join(timeout=20)
    server.close(linger=0)
    assert not asker.is_alive(), "the request's send blocked"
    assert len(raised) == 1 and isinstance(raised[0], PeerUnreachable), raised
    assert "3 attempts" in str(raised[0])


def test_lazy_pirate_error_reply_raises_remote_error(ctx):
    with Server(ctx, checking_handler) as server:
        client = LazyPirateClient(ctx, server.endpoint, timeout=5.0, retries=1)
        with pytest.raises(RemoteError) as info:
            client.request("bogus", {"worker_id": "w1"})
        assert info.value.code == "unknown_kind"
        assert "bogus" in str(info.value)
        with pytest.raises(RemoteError) as info:
            client.request(M.REGISTER, {"worker_id": "w1", "n_samples": "ten", "device": "cpu",
                                        "info": {}})
        assert info.value.code == "bad_field" and "n_samples" in str(info.value)
        # The client is still usable after an error reply.
        reply = client.request(M.PING, {"worker_id": "w1"})
        assert reply.kind == M.ACK and reply.body["kind"] == M.PING
        client.close()
    assert [m.kind for m in server.received] == ["bogus", M.REGISTER, M.PING]


def test_lazy_pirate_byte_counters_grow(ctx):
    with Server(ctx, checking_handler) as server:
        client = LazyPirateClient(ctx, server.endpoint, timeout=5.0, retries=2)
        assert (client.bytes_sent, client.bytes_received) == (0, 0)
        totals = []
        expected_sent = 0
        for n in (10, 1000, 200_000):
            body = {"worker_id": "w1", "round": 1, "version": 0, "n_samples": n, "metrics": {}}
            arrays = {"theta": np.ones(n, dtype=np.float32)}
            reply = client.request(M.UPDATE, body, arrays)
            size = frames_nbytes(encode(M.UPDATE, body, arrays))
            expected_sent += size
            assert reply.body["nbytes"] == size  # what the server counted on arrival
            assert reply.body["arrays"] == {"theta": [n]}
            assert client.bytes_sent == expected_sent
            totals.append((client.bytes_sent, client.bytes_received))
        client.close()
    sent, received = zip(*totals, strict=True)
    assert sent[0] < sent[1] < sent[2] and received[0] < received[1] < received[2]
    assert sent[2] >= 200_000 * 4


# ---------------------------------------------------------------------------- MAXMSGSIZE
def test_rep_drops_frames_over_max_message_bytes(ctx):
    with Server(ctx, checking_handler, max_message_bytes=1000) as server:
        big = LazyPirateClient(ctx, server.endpoint, timeout=0.5, retries=1)
        with pytest.raises(PeerUnreachable):
            big.request(M.PING, {"worker_id": "w1"},
                        {"blob": np.zeros(10_000, dtype=np.uint8)})
        big.close()
        small = LazyPirateClient(ctx, server.endpoint, timeout=5.0, retries=1)
        reply = small.request(M.PING, {"worker_id": "w2"})
        assert reply.kind == M.ACK and reply.body["kind"] == M.PING
        small.close()
    # The oversized message never reached the application.
    assert [m.body["worker_id"] for m in server.received] == ["w2"]


def test_rep_accepts_frames_up_to_max_message_bytes(ctx):
    with Server(ctx, checking_handler, max_message_bytes=1000) as server:
        client = LazyPirateClient(ctx, server.endpoint, timeout=5.0, retries=1)
        reply = client.request(M.PING, {"worker_id": "w1"},
                               {"blob": np.zeros(1000, dtype=np.uint8)})
        assert reply.body["arrays"] == {"blob": [1000]}
        client.close()


# ---------------------------------------------------------------------------- check_request
VALID = {
    M.REGISTER: {"worker_id": "w1", "n_samples": 10, "device": "cpu", "info": {}},
    M.FETCH: {"worker_id": "w1"},
    M.UPDATE: {"worker_id": "w1", "round": 1, "version": 0, "n_samples": 5, "metrics": {}},
    M.REPORT: {"worker_id": "w1", "report": {"acc": 0.9}},
    M.PING: {"worker_id": "w1"},
    M.SECAGG: {"worker_id": "w1", "round": 1, "stage": "keys"},
}


def check_code(kind: str, body: dict, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        M.check_request(kind, body)
    assert info.value.code == code
    assert "\n" not in str(info.value)


def test_check_request_accepts_valid_bodies():
    assert set(VALID) == set(M.REQUEST_FIELDS)
    for kind, body in VALID.items():
        M.check_request(kind, body)
        M.check_request(kind, {**body, "extra": [1, 2]})  # extra fields are allowed


@pytest.mark.parametrize("kind", ["bogus", "", "welcome", M.ANNOUNCE, M.ERROR, "PING"])
def test_check_request_unknown_kind(kind):
    check_code(kind, {"worker_id": "w1"}, "unknown_kind")


@pytest.mark.parametrize("kind", sorted(VALID))
def test_check_request_missing_fields(kind):
    for field in VALID[kind]:
        body = {k: v for k, v in VALID[kind].items() if k != field}
        check_code(kind, body, "bad_field")
        check_code(kind, {**VALID[kind], field: None}, "bad_field")


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        (M.REGISTER, "n_samples", "10"),
        (M.REGISTER, "n_samples", 10.0),
        (M.REGISTER, "n_samples", True),
        (M.REGISTER, "device", 0),
        (M.REGISTER, "info", []),
        (M.UPDATE, "round", False),
        (M.UPDATE, "version", 1.5),
        (M.UPDATE, "metrics", "loss=1"),
        (M.UPDATE, "compression", ["topk"]),
        (M.UPDATE, "compression", "x" * 33),
        (M.REPORT, "report", [1]),
        (M.PING, "worker_id", 5),
        (M.FETCH, "worker_id", b"w1"),
    ],
)
def test_check_request_wrong_types(kind, field, value):
    check_code(kind, {**VALID[kind], field: value}, "bad_field")


@pytest.mark.parametrize("worker_id", ["", "w\0", "\0", "a" * 129])
def test_check_request_bad_worker_id(worker_id):
    for kind in VALID:
        check_code(kind, {**VALID[kind], "worker_id": worker_id}, "bad_field")


def test_check_request_long_worker_id_limit():
    M.check_request(M.PING, {"worker_id": "a" * 128})




def test_a_workers_requests_wait_out_its_join_timeout() -> None:
    """A master that died while a worker uploaded may be resumed within join_timeout: the
    upload is retried that long (it gave up after REQUEST_RETRIES attempts, 50 s)."""
    from common import constants as C
    from worker.client import request_attempts

    assert request_attempts(10) == C.REQUEST_RETRIES
    for join_timeout in (120, 300, 1000):
        assert request_attempts(join_timeout) * C.REQUEST_TIMEOUT >= join_timeout


@pytest.mark.parametrize("bind", [bind_rep, bind_pub])
def test_a_connection_that_never_handshakes_is_closed(ctx: zmq.Context, bind: Callable) -> None:
    """Idle TCP connections, no key needed, held the master's file descriptors for libzmq's
    30 s default: 30,000 of them locked the workers out. Closed after HANDSHAKE_IVL_MS now."""
    import socket

    from common import constants as C

    port = free_ports(1)[0]
    sock = bind(ctx, f"tcp://127.0.0.1:{port}")
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=C.HANDSHAKE_IVL_MS / 1000 + 5)
        started = time.monotonic()
        try:
            while idle.recv(4096):  # the greeting libzmq sends, then nothing: until closed
                pass
        except ConnectionResetError:
            pass
        waited = time.monotonic() - started
        idle.close()
        assert C.HANDSHAKE_IVL_MS / 1000 - 1 < waited < C.HANDSHAKE_IVL_MS / 1000 + 3, waited
    finally:
        sock.close(linger=0)
