"""CURVE security, Ironhouse style: every peer authenticated, every byte encrypted.

The master holds a key pair; its PUB and REP sockets are CURVE servers. Each worker holds its
own key pair and knows the master's public key. A ZAP handler on the master admits only the
worker public keys found in ``<keys_dir>/admitted/``: a worker whose key is not there can neither
register, upload nor read the model, and a plaintext peer is refused at the handshake.

Each admitted key is named by its file (``admitted/w1.key`` is ``w1``): the handler gives that
name to ZeroMQ as the connection's User-Id, every message from it carries it, and the master
answers a request only for the worker its key names (:func:`sender_identity`).

Key folder written by ``fedctl keygen`` (certificate files of :mod:`zmq.auth`)::

    keys/master.key, keys/master.key_secret     the master's pair   -> master node only
    keys/admitted/<worker>.key                  admitted public keys -> master node
    keys/workers/<worker>.key, .key_secret      each worker's pair   -> that worker's node
                                                 (plus keys/master.key, the public half)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from common import constants as C

log = logging.getLogger("fedctl.security")

SocketSetup = Callable[[zmq.Socket], None]


class SecurityError(ValueError):
    """Keys missing or unreadable; the message says which file and what to run."""


@dataclass
class ServerKeys:
    public: bytes
    secret: bytes

    def setup(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True


@dataclass
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    def setup(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the master (before it connects)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise SecurityError(f"{path}: no such key file (run `fedctl keygen`)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{path}: not a key file ({exc})") from None
    if secret and secret_key is None:
        raise SecurityError(f"{path}: holds no secret key")
    return public, secret_key


def server_keys(keys_dir: str | Path) -> ServerKeys:
    """The master's key pair from ``keys_dir/master.key_secret``."""
    public, secret = _load(Path(keys_dir) / "master.key_secret", secret=True)
    assert secret is not None
    return ServerKeys(public, secret)


def client_keys(keys_dir: str | Path, worker_id: str) -> ClientKeys:
    """A worker's key pair and the master's public key."""
    keys = Path(keys_dir)
    public, secret = _load(keys / "workers" / f"{worker_id}.key_secret", secret=True)
    server_public, _ = _load(keys / "master.key", secret=False)
    assert secret is not None
    return ClientKeys(public, secret, server_public)


def missing_keys(keys_dir: str | Path, workers: Iterable[str], master: bool = True
                 ) -> list[Path]:
    """The key files a node of a CURVE cluster needs that are not under ``keys_dir``: the
    master's (its secret key and each listed worker's admitted key), or with ``master=False``
    a worker's (the master's public key and the worker's own pair)."""
    keys = Path(keys_dir)
    if master:
        wanted = [keys / "master.key_secret",
                  *(keys / "admitted" / f"{name}.key" for name in workers)]
    else:
        wanted = [keys / "master.key",
                  *(keys / "workers" / f"{name}.key_secret" for name in workers)]
    return [p for p in wanted if not p.is_file()]


def admitted_dir(keys_dir: str | Path) -> Path:
    """Where the master finds the public keys it admits."""
    folder = Path(keys_dir) / "admitted"
    if not folder.is_dir() or not any(folder.glob("*.key")):
        raise SecurityError(f"{folder}: no admitted worker keys (run `fedctl keygen`)")
    return folder


def admitted_names(keys_dir: str | Path) -> dict[bytes, str]:
    """Admitted public key (raw 32 bytes) -> the worker it belongs to, its key file's name."""
    names: dict[bytes, str] = {}
    for path in sorted(admitted_dir(keys_dir).glob("*.key")):
        public, _ = _load(path, secret=False)
        names[z85.decode(public)] = path.name[: -len(".key")]
    return names


class NamingAuthenticator(ThreadAuthenticator):
    """The ZAP handler: admits the keys in ``admitted/`` and names each connection after the
    worker its key belongs to (ZeroMQ's User-Id), so the master can tell who sent a message.

    A refused key is logged at warning (``DENIAL_LOG_LIMIT`` a minute, the rest at debug): a
    worker whose key was never copied to ``admitted/`` otherwise looked like a network fault.
    """

    def __init__(self, ctx: zmq.Context, names: dict[bytes, str]) -> None:
        super().__init__(ctx, log=logging.getLogger("fedctl.zap"))
        self.names = names
        self.denied = 0  # handshakes refused so far
        self._logged: list[float] = []  # when the last warnings were written

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Admit ``client_key`` (z85) when it is an admitted worker's (pyzmq's credentials
        provider interface)."""
        if z85.decode(client_key) in self.names:
            return True
        self.denied += 1
        now = time.monotonic()
        self._logged = [t for t in self._logged if now - t < C.REGISTER_LOG_WINDOW_S]
        quiet = len(self._logged) >= C.DENIAL_LOG_LIMIT
        if not quiet:
            self._logged.append(now)
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "refused a connection whose public key %s is not among the admitted keys "
                "(a worker's keys/workers/<id>.key must be copied to the master's "
                "keys/admitted/<id>.key, and the master restarted)", client_key.decode())
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(client_public_key, "")  # admitted keys are all named


def start_authenticator(ctx: zmq.Context, keys_dir: str | Path) -> NamingAuthenticator:
    """Start the ZAP handler that admits only the keys in ``keys_dir/admitted`` and names each
    connection by its worker."""
    auth = NamingAuthenticator(ctx, admitted_names(keys_dir))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=auth)
    return auth


#: The handshake events :class:`HandshakeWatch` reads.
_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class HandshakeWatch:
    """What became of a worker socket's handshakes with the master, from ZeroMQ's socket
    monitor: so that a worker refused for its keys, or whose security section differs from the
    master's, says so at once, rather than waiting out its join timeout and blaming the
    network.

    Attach it before the socket connects (it is a ``SocketSetup``); :meth:`refusal` then says
    why the master refused it, or None.
    """

    def __init__(self, keys_dir: str | Path | None, worker_id: str) -> None:
        self.keys = None if keys_dir is None else Path(keys_dir)  # None: a plaintext worker
        self.worker_id = worker_id
        self.monitor: zmq.Socket | None = None
        self._sock: zmq.Socket | None = None
        self.failures = 0  # handshakes failed without a reason since the last success

    def __call__(self, sock: zmq.Socket) -> None:
        self.close()
        self._sock = sock
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)

    def refusal(self) -> str | None:
        """Why the master refused this worker's handshakes (reads the events so far), or None
        while none was refused for certain."""
        while self.monitor is not None and self.monitor.poll(0):
            message = recv_monitor_message(self.monitor)
            event = message["event"]
            if (event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    and message.get("value") == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
                # One side has CURVE and the other none: ZeroMQ does not reconnect after it,
                # and the worker waited out its join timeout, then blamed the port.
                return ("the master runs with CURVE security and this worker's config has "
                        "none (set security.keys_dir to a copy of the keys `fedctl keygen` "
                        "made)" if self.keys is None else
                        "the master runs without security and this worker's config has CURVE "
                        "(security.keys_dir): both sides need the same security section")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failures = 0
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self.keys is not None:
                return (f"the master refused this worker's key: "
                        f"{self.keys / 'workers' / f'{self.worker_id}.key'} is not among its "
                        f"admitted keys (copy it to the master's keys/admitted/"
                        f"{self.worker_id}.key and restart the master)")
            else:
                self.failures += 1
        if self.failures >= C.HANDSHAKE_FAILURES_TO_GIVE_UP and self.keys is not None:
            # (a master without security usually shows as the mismatch above; on a loaded
            # machine it once came as three failures without it)
            return (f"the CURVE handshake with the master failed {self.failures} times: "
                    f"{self.keys / 'master.key'} is not the master's public key (were the "
                    f"master's keys made again? copy its keys/master.key here), or the master "
                    f"runs without security")
        return None

    def close(self) -> None:
        """Stop watching (before the socket closes)."""
        if self.monitor is not None:
            try:
                assert self._sock is not None
                if not self._sock.closed:
                    self._sock.disable_monitor()
            finally:
                self.monitor.close(linger=0)
                self.monitor = None


def sender_identity(frame: zmq.Frame) -> str | None:
    """The worker whose admitted key sent ``frame`` (received with ``copy=False``), or None on a
    socket without CURVE (where nothing proves who a peer is)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: a plaintext connection
        return None
    return user or None


def keygen(keys_dir: str | Path, workers: Iterable[str], overwrite: bool = False) -> list[Path]:
    """Write the master's key pair, each worker's pair, and the admitted public keys.

    Existing keys are kept unless ``overwrite``; returns the files written.
    """
    keys = Path(keys_dir)
    (keys / "workers").mkdir(parents=True, exist_ok=True)
    (keys / "admitted").mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if overwrite or not (keys / "master.key_secret").exists():
        written += [Path(p) for p in zmq.auth.create_certificates(keys, "master")]
    for name in workers:
        if overwrite or not (keys / "workers" / f"{name}.key_secret").exists():
            written += [Path(p) for p in zmq.auth.create_certificates(keys / "workers", name)]
        shutil.copyfile(keys / "workers" / f"{name}.key", keys / "admitted" / f"{name}.key")
    for path in written:
        if path.name.endswith("_secret"):
            os.chmod(path, 0o600)
    return written
