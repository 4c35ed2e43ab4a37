"""Who is in the job and the open round: registrations, liveness, sampling and the close rule.

The master's event loop (:mod:`master.server`) asks these questions; nothing here touches a
socket or the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import constants as C
from master.strategies import ClientResult

log = logging.getLogger("fedctl.master")

WAIT_LOG_INTERVAL_S = 10.0  # how often a round held past its deadline says so


@dataclass
class WorkerState:
    """What the master knows of one registered worker."""

    worker_id: str
    n_samples: int
    device: str
    info: dict[str, Any]
    registered_at: float
    last_seen: float
    report: dict[str, Any] | None = None
    #: The largest weight an update may claim (the family's max_weight), once computed.
    max_weight: int | None = None
    #: The registered process's own token (``process``): requests of another process under
    #: this name are refused (two started with one id). None: not said, or not since a resume.
    process: str | None = None

    def registration(self) -> dict[str, Any]:
        """What a checkpoint keeps of it."""
        return {"n_samples": self.n_samples, "device": self.device, "info": self.info}


@dataclass
class RoundState:
    """The open round: who it was sent to, what came back, and when."""

    number: int
    started: float
    deadline: float
    participants: list[str] = field(default_factory=list)
    results: dict[str, ClientResult] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)  # participants whose update was refused
    refused_at: float = 0.0  # when the last of them was refused (time.monotonic)
    left_out: set[str] = field(default_factory=set)  # updates taken, then screened out
    #: Each update's distance to the model it was built on (``master.screening.distance``),
    #: taken as it arrived, with that model: worked out while the others are still awaited
    #: rather than after the last one (at 1.6 M parameters, a millisecond an update).
    distances: dict[str, tuple[Any, float]] = field(default_factory=dict)
    #: Participants fixed by the family (a later round of a step that spans several): one of
    #: them missing, or left out, makes the step start again.
    mid_step: bool = False
    #: A member of that step was excluded since it began: the step is redone, and nobody's
    #: abstention in this round is counted.
    step_broken: bool = False
    #: Live participants already counted silent in this round while it could not close
    #: (``Master._count_overdue``), and how many deadlines past its own that was.
    overdue: set[str] = field(default_factory=set)
    overdue_periods: int = 0
    bytes_in: int = 0
    broadcast_bytes: int = 0
    publish_time: float = 0.0
    last_wait_log: float = 0.0

    def waiting(self) -> list[str]:
        """Participants whose update has not come."""
        return sorted(w for w in self.participants if w not in self.results)

    def ordered_results(self) -> list[ClientResult]:
        """In worker order, not arrival order: the same updates always give the same sum."""
        return [self.results[w] for w in sorted(self.results)]


class Roster:
    """The registered workers: liveness from their pings, and each round's sample.

    Parameters
    ----------
    heartbeat_timeout : float
        Seconds without a request after which a worker counts as down.
    client_fraction : float
        Fraction C of the registered workers sampled per round (at least one).
    seed : int
        Seed of the sampling generator (kept in checkpoints).
    among_live : bool, default True
        Draw the sample among the live workers only. False under DP-FedAvg, whose accountant
        needs every worker's chance of being drawn to be k / N, whoever is down.
    """

    def __init__(self, heartbeat_timeout: float, client_fraction: float, seed: int,
                 among_live: bool = True) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.client_fraction = client_fraction
        self.among_live = among_live
        self.rng = np.random.default_rng(seed)
        self.workers: dict[str, WorkerState] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def add(self, worker_id: str, n_samples: int, device: str, info: dict[str, Any]) -> bool:
        """Register (or re-register) a worker; True if it was known already. A final report
        already received is kept: registering again cannot take it back."""
        now = time.monotonic()
        known = self.workers.get(worker_id)
        self.workers[worker_id] = WorkerState(worker_id, n_samples, device, info, now, now,
                                              report=known.report if known else None)
        return known is not None

    def alive(self, worker_id: str, now: float | None = None) -> bool:
        """Heard from within ``heartbeat_timeout`` (workers ping every second)."""
        now = time.monotonic() if now is None else now
        return now - self.workers[worker_id].last_seen <= self.heartbeat_timeout

    def sample(self) -> list[str]:
        """This round's participants: a fraction C of the registered workers, at least one.

        With C = 1 every registered worker takes part (one that is down may come back within
        the round); with C < 1 the sample is drawn among the live ones (among all of them
        when ``among_live`` is False).
        """
        everyone = sorted(self.workers)
        k = max(1, round(self.client_fraction * len(everyone)))
        if k >= len(everyone):
            return everyone
        live = ([w for w in everyone if self.alive(w)] or everyone) if self.among_live \
            else everyone
        return sorted(self.rng.choice(live, size=min(k, len(live)), replace=False).tolist())

    def registrations(self) -> dict[str, dict[str, Any]]:
        return {w.worker_id: w.registration() for w in self.workers.values()}

    def restore(self, registrations: dict[str, dict[str, Any]], rng_state: dict[str, Any]
                ) -> None:
        for wid, r in registrations.items():
            self.add(wid, r["n_samples"], r["device"], r["info"])
        self.rng.bit_generator.state = rng_state


class RateLimiter:
    """Fair service: a token bucket per sender. Each sender may send ``burst`` requests at once
    and ``rate`` a second after that; what goes beyond is refused, not queued.

    Parameters
    ----------
    rate : float
        Requests per second each sender is granted.
    burst : int
        Requests a sender may send at once.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # sender -> (tokens, when)

    def allow(self, sender: str, now: float | None = None) -> bool:
        """Take a token for ``sender``; False when it has none left."""
        now = time.monotonic() if now is None else now
        tokens, then = self._buckets.get(sender, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if len(self._buckets) > 100_000:  # senders the master has never admitted
            self._buckets.clear()
        if tokens < 1:
            self._buckets[sender] = (tokens, now)
            return False
        self._buckets[sender] = (tokens - 1, now)
        return True


def may_close(rnd: RoundState, roster: Roster, min_workers: int, now: float) -> bool:
    """The close rule: every live participant has reported, or the deadline has passed, and in
    either case at least ``min(min_workers, participants)`` updates are in; or every
    participant had its update refused (none will send another: the round closes with
    nothing); or enough are in and those still out alive were refused, the last
    ``REFUSED_GRACE_S`` ago; or the deadline has passed and every one still out alive was
    refused, or, where the sample ignores liveness (DP-FedAvg), is down. Dead participants
    are dropped at once rather than at the deadline."""
    live = [w for w in rnd.waiting() if w in roster and roster.alive(w, now)]
    enough = len(rnd.results) >= min(min_workers, len(rnd.participants))
    if (not live and enough) or (now >= rnd.deadline and enough):
        return True
    if rnd.participants and not rnd.results and set(rnd.participants) <= rnd.refused:
        # Every participant's update was refused, and none will send another this round (a
        # diverged model's non-finite loss made every round wait its whole deadline).
        return True
    if (enough and live and set(live) <= rnd.refused
            and now - rnd.refused_at >= C.REFUSED_GRACE_S):
        # The others are in, and those still out had their updates refused: an honest worker
        # sends no other (one diverged among healthy ones cost every round its deadline, 2
        # minutes by default, until it was excluded); one still sending is waited for.
        return True
    if now >= rnd.deadline and live and set(live) <= rnd.refused:
        return True  # past the deadline, and those still out alive had their updates refused
    if now >= rnd.deadline and not live and not roster.among_live:
        # DP-FedAvg draws down workers too (its accountant needs k / N): one drawn down must
        # not hold the job for ever; the round closes with what came, perhaps nothing.
        return True
    if now - rnd.last_wait_log < WAIT_LOG_INTERVAL_S:
        return False
    if now >= rnd.deadline:
        rnd.last_wait_log = now
        log.warning("round %d: deadline passed with %d update(s), min_workers=%d; waiting for "
                    "more", rnd.number, len(rnd.results), min_workers)
    elif not live and rnd.waiting():
        # Every participant still out is down: say so now, not only at the deadline (a
        # worker killed mid-round was named two minutes later).
        rnd.last_wait_log = now
        log.warning("round %d: %s down (no heartbeat) with %d update(s) in, min_workers=%d; "
                    "waiting for it to come back (the round's deadline is in %.0fs)",
                    rnd.number, ", ".join(rnd.waiting()), len(rnd.results), min_workers,
                    rnd.deadline - now)
    return False


def round_events(rnd: RoundState, version: int, aggregate_time: float, missing: list[str]
                 ) -> list[dict[str, Any]]:
    """The round's metrics events: one ``worker_round`` per update, then the ``round``."""
    duration = time.monotonic() - rnd.started
    slowest = max((m.get("train_time", 0.0) for m in rnd.metrics.values()), default=0.0)
    slowest_compute = max((m.get("train_time", 0.0) + m.get("eval_time", 0.0)
                           for m in rnd.metrics.values()), default=0.0)
    events = [dict(event="worker_round", round=rnd.number, worker=wid,
                   n_samples=rnd.results[wid].n_samples, **m)
              for wid, m in sorted(rnd.metrics.items())]
    scores = [m["macro_f1"] for m in rnd.metrics.values() if "macro_f1" in m]
    events.append(dict(
        event="round", round=rnd.number, version=version, n_updates=len(rnd.results),
        missing=missing, duration_s=duration, slowest_train_s=slowest,
        overhead_s=duration - slowest, slowest_compute_s=slowest_compute,
        comm_overhead_s=duration - slowest_compute, aggregate_s=aggregate_time,
        publish_s=rnd.publish_time, broadcast_bytes=rnd.broadcast_bytes,
        bytes_in=rnd.bytes_in, mean_macro_f1=float(np.mean(scores)) if scores else None,
        participants=rnd.participants, time=time.time()))
    return events
