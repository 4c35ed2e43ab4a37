"""The arithmetic of a SecAgg+ round, apart from any socket: what a worker sends (its masked
input) and how the master takes the masks off the sum.

A worker ``u`` sends ``y_u = q(x_u) + PRG(b_u) + sum_v s(u, v) PRG(k_uv)`` over the ring, for
its neighbours ``v`` that sent their shares, with ``s(u, v)`` = +1 when ``u < v`` and -1
otherwise, ``b_u`` its self-mask seed and ``k_uv`` the key ``u`` and ``v`` agree. The pairwise
masks cancel in the sum of the workers who sent inputs; the master removes the self masks of
those (their seeds rebuilt from shares) and the pairwise masks between them and the workers
who dropped after sharing (those workers' mask keys rebuilt from shares).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
import numpy as np

from common.secagg import crypto
from common.secagg.ring import RING_DTYPES

#: The stages a worker's ``secagg`` requests name, in order (the masked input itself is an
#: ``update``).
KEYS = "keys"
SHARES = "shares"
UNMASK = "unmask"
REVEAL = "reveal"
STAGES = (KEYS, SHARES, UNMASK, REVEAL)


def round_context(run_id: str, incarnation: str, round_: int, attempt: int = 1) -> bytes:
    """What every key of a round is bound to: the job, the master process, the round and the
    attempt at it. A resumed master has another incarnation, a round begun again another
    attempt, so nothing agreed before can be replayed."""
    return f"fedctl-secagg|{run_id}|{incarnation}|{round_}|{attempt}".encode()


def _pair(context: bytes, purpose: str, u: str, v: str) -> bytes:
    a, b = sorted((u, v))
    return context + f"|{purpose}|{len(a)}:{a}|{len(b)}:{b}".encode()


def mask_key(private: crypto.X25519PrivateKey, peer_public: bytes, context: bytes, u: str,
             v: str) -> bytes:
    """The pairwise mask key of ``u`` and ``v`` (either side computes it)."""
    return crypto.agree(private, peer_public, _pair(context, "mask", u, v))


def share_key(private: crypto.X25519PrivateKey, peer_public: bytes, context: bytes, u: str,
              v: str) -> bytes:
    """The key ``u``'s shares for ``v`` (and back) are encrypted under."""
    return crypto.agree(private, peer_public, _pair(context, "share", u, v))


def share_associated(context: bytes, sender: str, recipient: str) -> bytes:
    """AES-GCM's associated data for a share: a share moved to another recipient, sender or
    round does not decrypt."""
    return context + f"|from:{len(sender)}:{sender}|to:{len(recipient)}:{recipient}".encode()


def pack_share(self_seed_share: bytes, mask_secret_share: bytes) -> bytes:
    return msgpack.packb({"b": self_seed_share, "s": mask_secret_share})


def unpack_share(plaintext: bytes) -> tuple[bytes, bytes]:
    try:
        d = msgpack.unpackb(plaintext)
        return bytes(d["b"]), bytes(d["s"])
    except Exception:
        raise crypto.ShareDecryptionError("the share's contents are not a share") from None


def sign(u: str, v: str) -> int:
    return 1 if u < v else -1


def masked_input(quantized: np.ndarray, self_seed: bytes, worker: str,
                 pair_keys: Mapping[str, bytes]) -> np.ndarray:
    """``y_u``: the quantized vector plus the self mask and the pairwise masks, in the ring
    of its dtype (uint64, uint32, uint16: mod 2^64, 2^32, 2^16)."""
    y = np.array(quantized, copy=True)
    if y.dtype not in RING_DTYPES.values():
        raise ValueError(f"a quantized vector is uint64, uint32 or uint16, not {y.dtype}")
    y += crypto.mask(self_seed, y.size, y.dtype)
    for v, key in pair_keys.items():
        m = crypto.mask(key, y.size, y.dtype)
        if sign(worker, v) > 0:
            y += m
        else:
            y -= m
    return y


def unmask(inputs: Mapping[str, np.ndarray], self_seeds: Mapping[str, bytes],
           dropped_pair_keys: Mapping[tuple[str, str], bytes]) -> np.ndarray:
    """The ring sum of the quantized vectors of the workers in ``inputs``.

    ``self_seeds`` has every one of those workers' seeds; ``dropped_pair_keys`` maps
    ``(u, v)`` (``u`` in ``inputs``, ``v`` dropped after sharing) to their mask key.
    """
    first = next(iter(inputs.values()))
    size, dtype = first.size, first.dtype
    total = np.zeros(size, dtype=dtype)
    for y in inputs.values():
        total += y
    for seed in self_seeds.values():
        total -= crypto.mask(seed, size, dtype)
    for (u, v), key in dropped_pair_keys.items():
        m = crypto.mask(key, size, dtype)
        if sign(u, v) > 0:
            total -= m
        else:
            total += m
    return total
