"""A worker's side of a secure round (SecAgg+): its keys, its shares, its masked input, and
what it reveals so that the master can take the masks off the sum and nothing more.

The stages are in ``master/secagg.py``'s docstring; here each is one request, asked again while
the master answers ``ready: false``: as soon as the master says on PUB that the stage changed,
or after ``SECAGG_POLL_INTERVAL`` should that word be lost. Fresh keys every round; a
worker reveals, for each neighbour, the share of its seed or of its mask key, never both.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from common import constants as C
from common.net import messages as M
from common.net.wire import Message
from common.secagg import crypto, shamir
from common.secagg import protocol as P
from common.secagg.ring import RING_DTYPES, quantize

log = logging.getLogger("fedctl.worker")

Request = Callable[[str, dict[str, Any], dict | None], Message]


class SecAggError(RuntimeError):
    """The round's secure aggregation cannot go on from this worker's side."""


class SecureUpload:
    """One round's secure upload, driven by :meth:`run`.

    Parameters
    ----------
    worker_id : str
    settings : dict
        The round body's ``secagg`` (threshold, clip, levels, points, n_max and the round's
        context, :func:`common.secagg.protocol.round_context`).
    request : callable
        ``request(kind, body, arrays)``: one request to the master, its reply.
    wait : callable, default time.sleep
        ``wait(seconds)``: between two asks for a stage that is not ready; the worker's
        returns early when the master says on PUB that the stage changed.
    """

    def __init__(self, worker_id: str, settings: Mapping[str, Any], request: Request,
                 wait: Callable[[float], None] = time.sleep) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.context = bytes(settings["context"])
        self.request = request
        self.wait = wait
        self.c_key = crypto.new_private_key()
        self.s_key = crypto.new_private_key()
        self.seed = crypto.new_seed()
        self.peers: dict[str, tuple[bytes, bytes]] = {}
        self.held: dict[str, tuple[bytes, bytes]] = {}  # owner -> (seed share, key share)

    def _poll(self, body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "context": self.context}
        while True:
            reply = self.request(M.SECAGG, body, None).body
            if reply.get("ready"):
                return reply
            self.wait(C.SECAGG_POLL_INTERVAL)

    def run(self, rnd: int, update_body: dict[str, Any], vector: np.ndarray) -> Message:
        """Every stage of the round for ``vector`` (:func:`common.secagg.ring.to_vector`);
        returns the master's reply to the masked input."""
        points = {str(k): int(v) for k, v in self.settings["points"].items()}
        threshold = int(self.settings["threshold"])
        clip, n_levels = float(self.settings["clip"]), int(self.settings["levels"])
        # 1. keys
        reply = self._poll({"round": rnd, "stage": P.KEYS,
                            "c_pk": crypto.public_bytes(self.c_key),
                            "s_pk": crypto.public_bytes(self.s_key),
                            "b_commit": hashlib.sha256(self.seed).digest()})
        self.peers = {str(v): (bytes(k[0]), bytes(k[1])) for v, k in reply["peers"].items()}
        unusable = sorted(v for v, k in self.peers.items()
                          if not all(crypto.usable_public(x) for x in k))
        if unusable:  # (the master refuses them; one that did not would not end this worker)
            raise SecAggError(f"round {rnd}: unusable public keys from {', '.join(unusable)}")
        if len(self.peers) + 1 < threshold:
            raise SecAggError(f"round {rnd}: {len(self.peers)} neighbour(s), the threshold "
                              f"is {threshold}")
        # 2. shares: of the seed and of the mask key, one per member of the group (this
        # worker keeps its own), each encrypted for its holder.
        group = sorted([*self.peers, self.worker_id])
        xs = [points[w] for w in group]
        seed_shares = shamir.split(self.seed, xs, threshold)
        key_shares = shamir.split(crypto.private_bytes(self.s_key), xs, threshold)
        me = points[self.worker_id]
        self.held[self.worker_id] = (seed_shares[me], key_shares[me])
        out = {}
        for v, (c_pk, _) in self.peers.items():
            key = P.share_key(self.c_key, c_pk, self.context, self.worker_id, v)
            out[v] = crypto.encrypt(key, P.pack_share(seed_shares[points[v]],
                                                      key_shares[points[v]]),
                                    P.share_associated(self.context, self.worker_id, v))
        reply = self._poll({"round": rnd, "stage": P.SHARES, "shares": out})
        inbox = {str(u): bytes(ct) for u, ct in reply["inbox"].items()}
        for u, ct in inbox.items():
            if u not in self.peers:
                raise SecAggError(f"round {rnd}: a share from {u}, not a neighbour")
            key = P.share_key(self.c_key, self.peers[u][0], self.context, self.worker_id, u)
            try:
                self.held[u] = P.unpack_share(crypto.decrypt(
                    key, ct, P.share_associated(self.context, u, self.worker_id)))
            except crypto.ShareDecryptionError as exc:
                # Sitting the round out here let one member get any other counted silent
                # until excluded, by corrupting one share. The pair's mask needs no share, so
                # this worker goes on; it only has nothing of u's to reveal, and the others'
                # shares (u's own among them) open u's secrets where there are enough.
                log.warning("round %d: secure aggregation: from %s, %s; going on without it "
                            "(%s may not be honest)", rnd, u, exc, u)
        # 3. the masked input, with the neighbours that shared (those the master can unmask)
        pair_keys = {v: P.mask_key(self.s_key, self.peers[v][1], self.context,
                                   self.worker_id, v) for v in inbox}
        bits = int(self.settings.get("bits", 32))
        if bits not in RING_DTYPES:
            raise SecAggError(f"round {rnd}: a ring of {bits} bits (known: 64, 32, 16)")
        y = P.masked_input(quantize(vector, clip, n_levels, bits), self.seed, self.worker_id,
                           pair_keys)
        ack = self.request(M.UPDATE, {**update_body, "context": self.context},
                           {"secagg.masked": y})
        # 4. unmasking: the seed share of each neighbour whose input came, the key share of
        # each that dropped after sharing; never both of one.
        reply = self._poll({"round": rnd, "stage": P.UNMASK})
        survivors = set(reply["survivors"])
        if len(survivors) < threshold:
            raise SecAggError(f"round {rnd}: {len(survivors)} survivor(s), the threshold is "
                              f"{threshold}: nothing is revealed")
        seeds = {u: s for u, (s, _) in self.held.items() if u in survivors}
        keys = {u: k for u, (_, k) in self.held.items() if u not in survivors}
        self.request(M.SECAGG, {"round": rnd, "stage": P.REVEAL, "b": seeds, "s": keys,
                                "context": self.context}, None)
        return ack
