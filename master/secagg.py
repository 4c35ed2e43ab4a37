"""The master's side of a secure round (SecAgg+, Bell et al. 2020): it relays keys and shares
it cannot read, collects masked inputs it cannot read either, and learns only their sum.

Stages, each closed when every worker still expected and alive has answered (a dead worker,
no heartbeat for ``heartbeat_timeout``, is not waited for), or at the stage's deadline, and in
either case only with at least ``threshold`` answers; else the round fails and nothing of it
is applied:

1. ``keys``: each participant's two public keys and a commitment to its self-mask seed. The
   master pairs the ones that came (``neighbours``) and gives each its neighbours' keys.
2. ``shares``: each worker's shares of its seed and of its mask key, one encrypted message per
   neighbour; the master hands each worker those addressed to it.
3. the masked inputs, as ``update`` requests.
4. ``unmask`` / ``reveal``: the master names the workers whose inputs it has; each survivor
   reveals, for each neighbour, the share of its seed (if its input came) or of its mask key
   (if it dropped after sharing), never both. The master rebuilds those secrets, checks them
   against what their owners committed to, and takes the masks off the sum.

Nothing here touches a socket: :mod:`master.server` calls :meth:`SecureRound.on_request`,
:meth:`SecureRound.take_input` and :meth:`SecureRound.advance`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from common import constants as C
from common.net import errors
from common.net.errors import ProtocolError
from common.secagg import crypto, graph, shamir
from common.secagg import protocol as P
from common.secagg.params import SecAggParams
from common.secagg.ring import RING_DTYPES, dequantize_sum, error_bound, levels

log = logging.getLogger("fedctl.master")

COLLECTING_KEYS, COLLECTING_SHARES, COLLECTING_INPUTS, COLLECTING_REVEALS, DONE, FAILED = (
    "keys", "shares", "inputs", "reveals", "done", "failed")


def _bytes(value: Any, size: int, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError(f"secagg: {what} must be {size} bytes", code=errors.BAD_FIELD)
    return value


class SecureRound:
    """One round's secure aggregation, from the keys to the unmasked sum.

    Parameters
    ----------
    params : SecAggParams
    number : int
        The round.
    participants : list of str
    context : bytes
        :func:`common.secagg.protocol.round_context` of the round.
    vector_size : int
        Length of each worker's input (the model's coordinates and the weight).
    n_max : int
        The largest weight a participant may claim: each scales its change by
        ``n_samples / n_max``, so that the inputs stay within the clipping range.
    deadline : float
        When the ``keys`` stage stops waiting (the round's deadline, monotonic).
    seed : int
        Seeds the neighbour graph (it need not be secret: SecAgg+'s security holds for any
        graph the master picks, given the threshold).
    attempt : int, default 1
        Which attempt at the round this is (the context names it too).
    bits : {32, 16, 64}, default 32
        The ring's width (:func:`common.secagg.ring.ring_bits` of the job's compression, or
        the family's own: :meth:`master.families.base.ServerFamily.secure_ring`).
    clip : float or None, default None
        The inputs' clipping range (None: ``params.clip``).
    """

    def __init__(self, params: SecAggParams, number: int, participants: list[str],
                 context: bytes, vector_size: int, n_max: int, deadline: float, seed: int,
                 attempt: int = 1, bits: int = 32, clip: float | None = None) -> None:
        self.params = params
        self.clip = params.clip if clip is None else clip
        self.number = number
        self.attempt = attempt
        self.participants = sorted(participants)
        self.context = context
        self.vector_size = vector_size
        self.n_max = n_max
        self.threshold = params.threshold_for(len(participants))
        self.bits = bits
        self.dtype = RING_DTYPES[bits]
        self.levels = levels(len(participants), bits)
        self.points = {w: i + 1 for i, w in enumerate(self.participants)}
        self.stage = COLLECTING_KEYS
        self.stage_deadline = deadline
        self._rng = random.Random((seed * 1_000_003 + number) * 101 + attempt)
        self.keys: dict[str, tuple[bytes, bytes, bytes]] = {}
        self.graph: dict[str, list[str]] = {}
        self.shares: dict[str, dict[str, bytes]] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.reveals: dict[str, tuple[dict[str, bytes], dict[str, bytes]]] = {}
        #: Members whose input is in the sum and who sent no reveal by the stage's end.
        self.withheld: list[str] = []
        self.sum_: np.ndarray | None = None  # the float sum, once unmasked
        self.failure: str | None = None
        # (revealer, owner): a share revealed that is not on the owner's polynomial
        self.forged: set[tuple[str, str]] = set()
        #: The member whose secret its shares did not open (the round failed for it), and how
        #: many members revealed shares of it.
        self.unopened: tuple[str, int] | None = None

    # ------------------------------------------------------------------ who is where
    @property
    def u1(self) -> list[str]:
        return sorted(self.keys)

    @property
    def u2(self) -> list[str]:
        return sorted(self.shares)

    @property
    def u3(self) -> list[str]:
        return sorted(self.inputs)

    def settings(self) -> dict[str, Any]:
        """What the round's body tells every worker."""
        return {"threshold": self.threshold, "clip": self.clip, "levels": self.levels,
                "bits": self.bits,
                "points": self.points, "n_max": self.n_max, "context": self.context,
                "attempt": self.attempt}

    # ------------------------------------------------------------------ requests
    def on_request(self, worker: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A worker's ``secagg`` request: its reply body (``ready`` false while the stage it
        waits for is still collecting)."""
        if worker not in self.points:
            raise ProtocolError(f"{worker} was not sampled for round {self.number}",
                                code=errors.NOT_SELECTED)
        if self.stage == FAILED:
            raise ProtocolError(f"round {self.number}'s secure aggregation failed: "
                                f"{self.failure}", code=errors.STALE_ROUND)
        stage = body.get("stage")
        if stage == P.KEYS:
            return self._on_keys(worker, body)
        if stage == P.SHARES:
            return self._on_shares(worker, body)
        if stage == P.UNMASK:
            if worker not in self.inputs:
                raise ProtocolError(f"{worker} sent no masked input in round {self.number}",
                                    code=errors.REJECTED)
            if self.stage in (COLLECTING_KEYS, COLLECTING_SHARES, COLLECTING_INPUTS):
                return {"ready": False}
            return {"ready": True, "survivors": self.u3}
        if stage == P.REVEAL:
            return self._on_reveal(worker, body)
        raise ProtocolError(f"secagg: unknown stage {str(stage)[:20]!r} (known: "
                            f"{', '.join(P.STAGES)})", code=errors.BAD_FIELD)

    def _on_keys(self, worker: str, body: Mapping[str, Any]) -> dict[str, Any]:
        keys = (_bytes(body.get("c_pk"), crypto.KEY_BYTES, "c_pk"),
                _bytes(body.get("s_pk"), crypto.KEY_BYTES, "s_pk"),
                _bytes(body.get("b_commit"), 32, "b_commit"))
        for what, key in (("c_pk", keys[0]), ("s_pk", keys[1])):
            # Relayed as it came, a low-order key (32 zero bytes) made every neighbour's
            # agreement with it fail: the honest workers left the job with "Error computing
            # shared key", and the round with them.
            if not crypto.usable_public(key):
                raise ProtocolError(f"secagg: {what} is not a usable X25519 public key",
                                    code=errors.BAD_FIELD)
        self._keep(self.keys, worker, keys, COLLECTING_KEYS, "keys")
        self._close_if_all_in()
        if self.stage == COLLECTING_KEYS:
            return {"ready": False}
        return {"ready": True, "peers": {v: [self.keys[v][0], self.keys[v][1]]
                                         for v in self.graph[worker]}}

    def _on_shares(self, worker: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if worker not in self.graph:
            raise ProtocolError(f"secagg: {worker} gave no keys in round {self.number}",
                                code=errors.REJECTED)
        shares = body.get("shares")
        if not isinstance(shares, dict):
            raise ProtocolError("secagg: shares must be a map of neighbour -> bytes",
                                code=errors.BAD_FIELD)
        wanted = set(self.graph[worker])
        if set(shares) != wanted:
            wrong = sorted(str(k)[:40] for k in set(shares) ^ wanted)
            raise ProtocolError(f"secagg: {worker}'s shares are not addressed to its "
                                f"neighbours in round {self.number} (misaddressed or missing: "
                                f"{', '.join(wrong[:5])})", code=errors.BAD_FIELD)
        for v, ct in shares.items():
            if not isinstance(ct, bytes) or not 0 < len(ct) <= 1024:
                raise ProtocolError(f"secagg: the share for {v} must be 1-1024 bytes",
                                    code=errors.BAD_FIELD)
        self._keep(self.shares, worker, dict(shares), COLLECTING_SHARES, "shares")
        self._close_if_all_in()
        if self.stage == COLLECTING_SHARES:
            return {"ready": False}
        return {"ready": True, "inbox": {u: self.shares[u][worker]
                                         for u in self.graph[worker] if u in self.shares}}

    def _keep(self, store: dict[str, Any], worker: str, value: Any, stage: str, what: str
              ) -> None:
        """Keep what ``worker`` gave in ``stage``: the same again is a resend (kept once),
        something else a replay or a change of mind (refused), and nothing is taken once the
        stage has closed."""
        if worker in store:
            if store[worker] != value:
                raise ProtocolError(f"secagg: {worker} already gave other {what} in round "
                                    f"{self.number}", code=errors.REJECTED)
        elif self.stage != stage:
            raise ProtocolError(f"secagg: round {self.number} no longer takes {what}",
                                code=errors.STALE_ROUND)
        else:
            store[worker] = value

    def take_input(self, worker: str, arrays: Mapping[str, np.ndarray]) -> None:
        """A masked input (an ``update``'s one array, ``secagg.masked``)."""
        if self.stage != COLLECTING_INPUTS:
            raise ProtocolError(f"secagg: round {self.number} takes no masked input now "
                                f"(stage: {self.stage})", code=errors.STALE_ROUND)
        if worker not in self.shares:
            raise ProtocolError(f"secagg: {worker} gave no shares in round {self.number}",
                                code=errors.REJECTED)
        if set(arrays) != {"secagg.masked"}:
            raise ProtocolError("secagg: an update carries one array, secagg.masked",
                                code=errors.SHAPE)
        y = arrays["secagg.masked"]
        if y.dtype != self.dtype:
            raise ProtocolError(f"secagg.masked: dtype {y.dtype}, not {self.dtype}",
                                code=errors.DTYPE)
        if y.shape != (self.vector_size,):
            raise ProtocolError(f"secagg.masked: shape {list(y.shape)}, not "
                                f"[{self.vector_size}]", code=errors.SHAPE)
        self.inputs[worker] = y
        self._close_if_all_in()

    def _close_if_all_in(self) -> None:
        """Close a collecting stage as soon as every worker it waits for has answered, so that
        the last one's reply already carries the next stage (rather than ``ready: false`` and
        a poll later: one ``SECAGG_POLL_INTERVAL`` a stage on every round's critical path)."""
        if self.stage in (COLLECTING_KEYS, COLLECTING_SHARES, COLLECTING_INPUTS):
            expected, got = self._collecting()
            if all(w in got for w in expected):
                self.advance(time.monotonic(), alive=lambda w: True)

    def _collecting(self) -> tuple[list[str], Mapping[str, Any]]:
        """Who the open stage waits for, and what it has."""
        return {
            COLLECTING_KEYS: (self.participants, self.keys),
            COLLECTING_SHARES: (self.u1, self.shares),
            COLLECTING_INPUTS: (self.u2, self.inputs),
            COLLECTING_REVEALS: (self.u3, self.reveals),
        }[self.stage]

    def _on_reveal(self, worker: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if self.stage != COLLECTING_REVEALS:
            raise ProtocolError(f"secagg: round {self.number} takes no reveals now (stage: "
                                f"{self.stage})", code=errors.STALE_ROUND)
        if worker not in self.inputs:
            raise ProtocolError(f"secagg: {worker} sent no masked input in round "
                                f"{self.number}", code=errors.REJECTED)
        seeds, keys = body.get("b"), body.get("s")
        if not isinstance(seeds, dict) or not isinstance(keys, dict):
            raise ProtocolError("secagg: a reveal carries maps b and s", code=errors.BAD_FIELD)
        group = set(self.graph[worker]) | {worker}
        want_b = {v for v in group if v in self.inputs}
        want_s = {v for v in group if v in self.shares and v not in self.inputs}
        # Never both shares of one member (its seed's and its mask key's would unmask its
        # input). One may be missing: a share that did not decrypt was never held.
        if not set(seeds) <= want_b or not set(keys) <= want_s:
            raise ProtocolError(f"secagg: {worker}'s reveal may hold seed shares of "
                                f"{sorted(want_b)} and key shares of {sorted(want_s)} only",
                                code=errors.BAD_FIELD)
        for v in (*seeds.values(), *keys.values()):
            _bytes(v, shamir.SHARE_BYTES, "a share")
        self.reveals.setdefault(worker, (dict(seeds), dict(keys)))
        return {"ready": True}

    # ------------------------------------------------------------------ stages
    def advance(self, now: float, alive: Callable[[str], bool]) -> None:
        """Close the stage that can close; unmask once the reveals are in."""
        if self.stage in (DONE, FAILED):
            return
        expected, got = self._collecting()
        pending = [w for w in expected if w not in got and alive(w)]
        if pending and now < self.stage_deadline:
            return
        if self.stage == COLLECTING_REVEALS:
            return self._unmask()
        if len(got) < self.threshold:
            return self._fail(f"{len(got)} of {len(expected)} workers reached the {self.stage} "
                              f"stage, the threshold is {self.threshold}")
        self.stage_deadline = now + C.SECAGG_STAGE_TIMEOUT
        if self.stage == COLLECTING_KEYS:
            k = self.params.neighbours
            self.graph = graph.neighbours(self.u1, k, self._rng)
            small = [w for w, ns in self.graph.items() if len(ns) + 1 < self.threshold]
            if small:
                return self._fail(f"{', '.join(small)} would have fewer neighbours than the "
                                  f"threshold {self.threshold} needs")
            self.stage = COLLECTING_SHARES
        elif self.stage == COLLECTING_SHARES:
            self.stage = COLLECTING_INPUTS
        elif self.stage == COLLECTING_INPUTS:
            self.stage = COLLECTING_REVEALS
        log.debug("round %d: secure aggregation: %s stage", self.number, self.stage)

    def _fail(self, why: str) -> None:
        self.stage, self.failure = FAILED, why
        self.inputs.clear()

    def _unmask(self) -> None:
        dropped = [v for v in self.u2 if v not in self.inputs]
        self.withheld = [v for v in self.u3 if v not in self.reveals]
        seeds: dict[str, bytes] = {}
        pair_keys: dict[tuple[str, str], bytes] = {}
        for owner in self.u3 + dropped:
            kind = 0 if owner in self.inputs else 1
            held = {self.points[w]: self.reveals[w][kind][owner] for w in self.reveals
                    if owner in self.reveals[w][kind]}
            if len(held) < self.threshold:
                return self._fail(f"{len(held)} share(s) of {owner}'s "
                                  f"{'seed' if kind == 0 else 'mask key'} came back, the "
                                  f"threshold is {self.threshold}")
            c_pk, s_pk, b_commit = self.keys[owner]
            secret = self._open(owner, held,
                                _opens_seed(b_commit) if kind == 0 else _opens_key(s_pk))
            if secret is None:
                what = "seed do not open what it committed to" if kind == 0 else \
                    "mask key do not open its public key"
                self.unopened = (owner, len(held))
                return self._fail(f"the shares of {owner}'s {what}: fewer than the threshold "
                                  f"({self.threshold}) are genuine")
            if kind == 0:
                seeds[owner] = secret
                continue
            private = crypto.private_from_bytes(secret)
            for u in self.graph[owner]:
                if u in self.inputs:
                    pair_keys[(u, owner)] = P.mask_key(private, self.keys[u][1], self.context,
                                                       u, owner)
        ring_sum = P.unmask(self.inputs, seeds, pair_keys)
        self.sum_ = dequantize_sum(ring_sum, len(self.inputs), self.clip, self.levels)
        self.stage = DONE
        if dropped:
            log.info("round %d: secure sum of %d workers (%s dropped after sharing: their "
                     "masks removed)", self.number, len(self.inputs), ", ".join(dropped))

    def _open(self, owner: str, held: Mapping[int, bytes], opens: Callable[[bytes], bool]
              ) -> bytes | None:
        """The secret of ``owner`` that ``held`` (point -> share) opens, or None where fewer
        than the threshold are genuine. Should a share not be (one member could send a wrong
        one and so fail every round, an honest owner named), a threshold of them that opens
        the secret is looked for among the first SECAGG_MAX_SUBSETS; it fixes the polynomial,
        and a share it does not pass through goes in :attr:`forged` with its revealer. Who
        forged it is not known: its revealer, or the owner that dealt it (shares travel
        encrypted between the two), so no one is excluded for it."""
        secret = _combine(held)
        if opens(secret):  # (every share together opens it only if every one is genuine)
            return secret
        points = sorted(held)
        by_point = {p: w for w, p in self.points.items()}
        # One share left out at a time first (a single forger, wherever its point, in m
        # tries), then the lexicographic sets up to the cap.
        leave_one_out = ([q for q in points if q != p][:self.threshold] for p in points)
        for subset in itertools.islice(itertools.chain(
                leave_one_out, itertools.combinations(points, self.threshold)),
                len(points) + C.SECAGG_MAX_SUBSETS):
            secret = _combine({p: held[p] for p in subset})
            if not opens(secret):
                continue
            base = {p: held[p] for p in subset[:-1]}
            self.forged |= {(by_point[p], owner) for p in points if p not in subset
                            and not opens(_combine({**base, p: held[p]}))}
            return secret
        return None

    def error_bound(self) -> float:
        """The largest quantization error of the unmasked sum, per coordinate."""
        return error_bound(len(self.inputs), self.clip, self.levels)


def _combine(shares: Mapping[int, bytes]) -> bytes:
    """:func:`shamir.combine`, with b"" for shares that open no 32-byte secret."""
    try:
        return shamir.combine(shares)
    except ValueError:
        return b""


def _opens_seed(commitment: bytes) -> Callable[[bytes], bool]:
    """Whether a secret is the seed a member committed to (its hash)."""
    return lambda secret: bool(secret) and hashlib.sha256(secret).digest() == commitment


def _opens_key(public: bytes) -> Callable[[bytes], bool]:
    """Whether a secret is the private mask key of a member's public key."""
    def opens(secret: bytes) -> bool:
        try:
            return bool(secret) and crypto.public_bytes(crypto.private_from_bytes(secret)) \
                == public
        except ValueError:
            return False
    return opens
