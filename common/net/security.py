"""CURVE security, Ironhouse style: every peer authenticated, every byte encrypted.

The master holds a key pair; its PUB and REP sockets are CURVE servers. Each worker holds its
own key pair and knows the master's public key. A ZAP handler on the master admits only the
worker public keys found in ``<keys_dir>/admitted/``: a worker whose key is not there can neither
register, upload nor read the model, and a plaintext peer is refused at the handshake.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

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


def admitted_dir(keys_dir: str | Path) -> Path:
    """Where the master finds the public keys it admits."""
    folder = Path(keys_dir) / "admitted"
    if not folder.is_dir() or not any(folder.glob("*.key")):
        raise SecurityError(f"{folder}: no admitted worker keys (run `fedctl keygen`)")
    return folder


def start_authenticator(ctx: zmq.Context, keys_dir: str | Path) -> ThreadAuthenticator:
    """Start the ZAP handler that admits only the keys in ``keys_dir/admitted``."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("fedctl.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=str(admitted_dir(keys_dir)))
    return auth


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
