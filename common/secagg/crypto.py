"""The cryptographic primitives of secure aggregation, all from the ``cryptography`` package.

* each worker makes two X25519 key pairs a round: one to agree the keys its shares are
  encrypted with (``c``), one to agree the pairwise masks (``s``);
* an agreed secret goes through HKDF-SHA256 with a context naming the job, the round, the
  master's incarnation and the pair, so no key serves two rounds or two purposes;
* masks are ChaCha20's keystream read as uint32 (a cryptographic generator: numpy's are
  predictable from their output);
* shares travel through the master encrypted with AES-GCM, the sender and recipient bound in
  the associated data, so the master can neither read nor redirect them.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from common.secagg.ring import RING_DTYPE

KEY_BYTES = 32
NONCE_BYTES = 12
_ZERO_NONCE = bytes(16)  # ChaCha20's 16-byte counter + nonce: each key makes one stream


class ShareDecryptionError(ValueError):
    """A share that does not decrypt: forged, altered, replayed or meant for someone else."""


def new_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)


def agree(private: X25519PrivateKey, peer_public: bytes, context: bytes) -> bytes:
    """A 32-byte key both ends of a pair derive alone: X25519, then HKDF over ``context``.

    Raises
    ------
    ValueError
        ``peer_public`` is not a valid X25519 public key.
    """
    if not isinstance(peer_public, bytes) or len(peer_public) != KEY_BYTES:
        raise ValueError("a public key is 32 bytes")
    secret = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=context).derive(secret)


def usable_public(raw: Any) -> bool:
    """Whether ``raw`` is an X25519 public key a pair can agree with: 32 bytes, and not one of
    the low-order points (32 zero bytes among them), with which every agreement fails."""
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        return False
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        return False
    return True


def new_seed() -> bytes:
    """A self-mask seed: 32 bytes from the operating system."""
    return os.urandom(KEY_BYTES)


def mask(key: bytes, size: int, dtype: np.dtype = RING_DTYPE) -> np.ndarray:
    """``size`` uniform elements of the ring of ``dtype`` (uint64, uint32 or uint16) from ChaCha20's
    keystream under ``key``."""
    dtype = np.dtype(dtype)
    stream = Cipher(algorithms.ChaCha20(key, _ZERO_NONCE), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(dtype.itemsize * size)), dtype=dtype)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-GCM under ``key``: a fresh nonce, then the ciphertext and its tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, message: bytes, associated: bytes) -> bytes:
    """The plaintext of :func:`encrypt`'s output.

    Raises
    ------
    ShareDecryptionError
        The message was not made with this key and associated data, or was altered.
    """
    if not isinstance(message, bytes) or len(message) < NONCE_BYTES + 16:
        raise ShareDecryptionError("the share is too short to be one")
    try:
        return AESGCM(key).decrypt(message[:NONCE_BYTES], message[NONCE_BYTES:], associated)
    except InvalidTag:
        raise ShareDecryptionError("the share does not decrypt: forged, altered, replayed or "
                                   "meant for another worker") from None
