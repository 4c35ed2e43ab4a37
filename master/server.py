"""The master: announce on PUB, serve REQ/REP, run rounds, aggregate, report.

One thread, one event loop. Each turn it announces itself when due, answers the requests
waiting on REP (each answer is quick: validation and bookkeeping), and advances the job's
phase: joining -> training -> reporting -> done. Aggregation runs between requests, never
inside one, so a slow aggregation never holds a REQ waiting beyond its own cost.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from common import constants as C
from common.atomic import atomic_write_bytes
from common.config import ClusterConfig
from common.net import messages as M
from common.net.compression import decompress
from common.net.security import server_keys, start_authenticator
from common.net.transport import bind_pub, bind_rep, recv, send, send_error
from common.net.wire import Message, ProtocolError
from common.runlog import MetricsLog, read_metrics
from master.checkpoint import Checkpoint, CheckpointWriter
from master.families import Payload, ServerFamily, make_server_family
from master.report import comparison_rows, format_table
from master.strategies import ClientResult

log = logging.getLogger("fedctl.master")

JOINING, TRAINING, REPORTING, DONE = "joining", "training", "reporting", "done"


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


@dataclass
class RoundState:
    """The open round: who it was sent to, what came back, and when."""

    number: int
    started: float
    deadline: float
    participants: list[str] = field(default_factory=list)
    results: dict[str, ClientResult] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    bytes_in: int = 0
    broadcast_bytes: int = 0
    publish_time: float = 0.0
    last_wait_log: float = 0.0


class Master:
    """Serve one federated job described by ``cfg``.

    Parameters
    ----------
    cfg : ClusterConfig
    ctx : zmq.Context, optional
        Shared context (a new one by default).
    resume : bool, default False
        Continue from ``<output_dir>/checkpoint.npz`` (``fedctl master --resume``).

    Attributes
    ----------
    phase : str
        ``joining``, ``training``, ``reporting`` or ``done``.
    round : int
        The open (or last) round, from 1.
    version : int
        Model version: 0 for the initial model, +1 per aggregation.
    """

    def __init__(self, cfg: ClusterConfig, ctx: zmq.Context | None = None,
                 resume: bool = False) -> None:
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance(io_threads=C.MASTER_IO_THREADS)
        self.family: ServerFamily = make_server_family(cfg)
        self.run_id = secrets.token_hex(4)
        # A new one at every start of the process: workers that see it change re-register.
        self.incarnation = secrets.token_hex(4)
        self.rng = np.random.default_rng(cfg.seed)  # client sampling
        self.phase = JOINING
        self.round = 0
        self.version = 0
        self.workers: dict[str, WorkerState] = {}
        self.open: RoundState | None = None
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.errors_served = 0
        self.summary: dict[str, Any] = {}
        self._first_join: float | None = None
        self._join_started = time.monotonic()
        self._report_deadline = 0.0
        self._next_announce = 0.0
        self._expected = {w.name for w in cfg.workers}
        self._resume_at = 0.0
        self._budget_logged = False
        self._absent: set[str] = set()  # warned of once, until they report again
        self.pub: zmq.Socket | None = None
        self.rep: zmq.Socket | None = None
        self._auth = None
        self._checkpoints = CheckpointWriter(self.out, self.metrics, cfg.checkpoint_budget)
        if resume:
            self._restore(Checkpoint.load(self.out))

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Bind PUB and REP; a port in use is a one-line error naming it."""
        m = self.cfg.master
        setup = None
        if self.cfg.security.curve:
            setup = server_keys(self.cfg.security.keys_dir).setup
            self._auth = start_authenticator(self.ctx, self.cfg.security.keys_dir)
            log.info("security: CURVE, admitting the keys in %s/admitted",
                     self.cfg.security.keys_dir)
        else:
            log.warning("security: none%s: traffic is plaintext and any peer that reaches the "
                        "ports can talk to the master (run `fedctl keygen` and set "
                        "security.keys_dir)", "" if self.cfg.security.explicit else
                        " (no security section)")
        for attr, endpoint, key in (("pub", m.pub_bind, "pub_port"), ("rep", m.rep_bind,
                                                                       "rep_port")):
            try:
                sock = (bind_pub(self.ctx, endpoint, setup=setup) if attr == "pub"
                        else bind_rep(self.ctx, endpoint, setup=setup))
            except zmq.ZMQError as exc:
                self.close()
                raise OSError(f"cannot bind {endpoint} (master.{key}): {exc.strerror}") from None
            setattr(self, attr, sock)
        log.info("master %s: PUB %s, REP %s, %s with %s, %d round(s), waiting for %s",
                 self.run_id, m.pub_bind, m.rep_bind, self.cfg.family, self.family.strategy.name,
                 self.cfg.rounds, ", ".join(sorted(self._expected)) or
                 f"{self.cfg.min_workers} worker(s)")

    def serve(self) -> dict[str, Any]:
        """Run the job to the end; returns the summary written to ``summary.json``."""
        if self.rep is None:
            self.bind()
        self.metrics.write("start", run_id=self.run_id, family=self.cfg.family,
                           strategy=self.family.strategy.name, rounds=self.cfg.rounds,
                           time=time.time())
        try:
            while self.phase != DONE:
                self._tick()
        finally:
            self._checkpoints.close()  # its last events go to the log before the log closes
            self.metrics.close()
        return self.summary

    def close(self) -> None:
        self._checkpoints.close()
        for sock in (self.pub, self.rep):
            if sock is not None:
                sock.close(linger=C.LINGER_MS)
        self.pub = self.rep = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_announce:
            self._announce()
            self._next_announce = now + C.ANNOUNCE_INTERVAL
        timeout = max(0, min(C.POLL_INTERVAL_MS, int((self._next_announce - now) * 1000)))
        if self.rep.poll(timeout, zmq.POLLIN):
            # Drain what is waiting, then advance the job once.
            while self.rep.poll(0, zmq.POLLIN):
                self._serve_one()
        self._advance(time.monotonic())

    def _announce(self) -> None:
        send(self.pub, M.ANNOUNCE, {"run_id": self.run_id, "incarnation": self.incarnation,
                                    "phase": self.phase, "round": self.round,
                                    "version": self.version, "rounds": self.cfg.rounds,
                                    "open": self.open is not None},
             topic=M.TOPIC_ANNOUNCE)

    # ------------------------------------------------------------------ requests
    def _serve_one(self) -> None:
        try:
            msg, nbytes = recv(self.rep)
        except ProtocolError as exc:
            return self._refuse(exc.code, str(exc), "?")
        worker_id = str(msg.body.get("worker_id", "?"))[:128]
        try:
            M.check_request(msg.kind, msg.body)
            handler = {M.REGISTER: self._on_register, M.FETCH: self._on_fetch,
                       M.UPDATE: self._on_update, M.REPORT: self._on_report,
                       M.PING: self._on_ping}[msg.kind]
            handler(msg, nbytes)
        except ProtocolError as exc:
            self._refuse(exc.code, str(exc), worker_id)
        except Exception as exc:  # a bug must not take the master down with it
            log.exception("error serving %s from %s", msg.kind, worker_id)
            self._refuse("rejected", f"{type(exc).__name__}: {exc}", worker_id)

    def _refuse(self, code: str, message: str, worker_id: str) -> None:
        self.errors_served += 1
        log.warning("refused request from %s: %s (%s)", worker_id, message, code)
        send_error(self.rep, code, message)

    def _worker(self, msg: Message) -> WorkerState:
        ws = self.workers.get(msg.body["worker_id"])
        if ws is None:
            raise ProtocolError(f"worker {msg.body['worker_id']!r} is not registered",
                                code="unknown_worker")
        ws.last_seen = time.monotonic()
        return ws

    def _on_register(self, msg: Message, nbytes: int) -> None:
        b = msg.body
        wid = b["worker_id"]
        if self._expected and wid not in self._expected:
            raise ProtocolError(f"worker {wid!r} is not in this cluster's worker list",
                                code="unknown_worker")
        if b["n_samples"] < 0:
            raise ProtocolError("register: n_samples must be >= 0", code="bad_field")
        self.family.check_info(b["info"])
        if self.phase != JOINING:
            self.family.admit(wid, b["info"])
        now = time.monotonic()
        rejoin = wid in self.workers
        self.workers[wid] = WorkerState(wid, b["n_samples"], b["device"], b["info"], now, now)
        if self._first_join is None:
            self._first_join = now
        log.info("%s %s: %d samples on %s (%d/%d registered)",
                 "re-registered" if rejoin else "registered", wid, b["n_samples"], b["device"],
                 len(self.workers), len(self._expected) or self.cfg.min_workers)
        self.metrics.write("register", worker=wid, n_samples=b["n_samples"], device=b["device"],
                           rejoin=rejoin, phase=self.phase, round=self.round, time=time.time())
        body = {"run_id": self.run_id, "incarnation": self.incarnation, "phase": self.phase,
                "round": self.round, "version": self.version, "rounds": self.cfg.rounds}
        if self.phase != JOINING:
            body["setup"] = self.family.setup_info_
        send(self.rep, M.WELCOME, body)

    def _on_fetch(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        if self.phase == JOINING:
            raise ProtocolError("no model yet: the cluster is still joining", code="not_ready")
        if self.phase == TRAINING and self.open is None:
            raise ProtocolError(f"round {self.round} is not open yet", code="not_ready")
        payload = self.family.payload_for(ws.worker_id)
        send(self.rep, M.MODEL, self._payload_body(payload, with_setup=True), payload.arrays)

    def _payload_body(self, payload: Payload, with_setup: bool) -> dict[str, Any]:
        deadline = self.open.deadline - time.monotonic() if self.open else 0.0
        body = {"run_id": self.run_id, "phase": self.phase, "round": self.round,
                "version": self.version, "meta": payload.meta, "deadline_s": deadline,
                "participants": self.open.participants if self.open else [],
                "sent_at": time.time()}  # wall clock: latency on one machine's loopback
        if with_setup:
            body["setup"] = self.family.setup_info_
        return body

    def _on_update(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        b = msg.body
        rnd = self.open
        if self.phase == TRAINING and rnd is None and b["round"] == self.round:
            # A resumed master before it reopens the round: the worker keeps its update's
            # round pending and redoes it when the round is published.
            raise ProtocolError(f"round {self.round} is not open yet", code="not_ready")
        if self.phase != TRAINING or rnd is None or b["round"] != rnd.number:
            raise ProtocolError(f"update for round {b['round']}, but "
                                f"{'round ' + str(self.round) if rnd else 'no round'} is open",
                                code="stale_round")
        if b["version"] != self.version:
            raise ProtocolError(f"update built on model version {b['version']}, the round "
                                f"sent version {self.version}", code="stale_round")
        if ws.worker_id not in rnd.participants:
            raise ProtocolError(f"{ws.worker_id} was not sampled for round {rnd.number}",
                                code="not_selected")
        if ws.worker_id in rnd.results:  # a Lazy Pirate resend: acknowledged, not recounted
            send(self.rep, M.ACK, {"round": rnd.number, "duplicate": True})
            return
        if b["n_samples"] < 1:
            raise ProtocolError("update: n_samples must be >= 1", code="bad_field")
        M.check_metrics(b["metrics"], "update.metrics")
        arrays = decompress(str(b.get("compression", "none")), msg.arrays,
                            self.family.payload_for(ws.worker_id).arrays)
        self.family.check_update(arrays)
        rnd.results[ws.worker_id] = ClientResult(ws.worker_id, arrays, b["n_samples"])
        upload = time.time() - b["sent_at"] if isinstance(b.get("sent_at"), float) else None
        rnd.metrics[ws.worker_id] = {**b["metrics"], "bytes_out": nbytes,
                                     **({"upload_s": upload} if upload is not None else {})}
        rnd.bytes_in += nbytes
        send(self.rep, M.ACK, {"round": rnd.number, "duplicate": False})

    def _on_report(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        M.check_report(msg.body["report"])
        ws.report = dict(msg.body["report"])
        log.info("final report from %s", ws.worker_id)
        send(self.rep, M.ACK, {"round": self.round, "duplicate": False})

    def _on_ping(self, msg: Message, nbytes: int) -> None:
        self._worker(msg)
        send(self.rep, M.PONG, {"phase": self.phase, "round": self.round,
                                "version": self.version})

    # ------------------------------------------------------------------ the job
    def _advance(self, now: float) -> None:
        if self.phase == JOINING:
            self._maybe_start(now)
        elif self.phase == TRAINING:
            if self.open is None:  # resumed: reopen once the workers have had time to hear us
                if now >= self._resume_at:
                    self._start_round(now)
            else:
                self._maybe_close_round(now)
        elif self.phase == REPORTING:
            waiting = [w for w in self.workers.values() if w.report is None]
            if not waiting or now >= self._report_deadline:
                if waiting:
                    log.warning("no final report from %s", ", ".join(w.worker_id
                                                                     for w in waiting))
                self._finish()

    def _maybe_start(self, now: float) -> None:
        n = len(self.workers)
        everyone = self._expected and self._expected <= set(self.workers)
        waited = self._first_join is not None and now - self._first_join >= self.cfg.join_timeout
        if not (everyone or (not self._expected and n >= self.cfg.min_workers)
                or (waited and n >= self.cfg.min_workers)):
            if now - self._join_started >= 10.0:  # waiting is normal; waiting silently is not
                self._join_started = now
                log.info("waiting for workers: %d registered (%s), min_workers=%d%s", n,
                         ", ".join(sorted(self.workers)) or "none", self.cfg.min_workers,
                         f", expecting {', '.join(sorted(self._expected - set(self.workers)))}"
                         if self._expected else "")
            return
        regs = {w.worker_id: w.info for w in self.workers.values()}
        try:
            self.family.setup(regs)
        except Exception as exc:  # check_info admitted them, so this is a family bug
            log.exception("pre-training exchange failed")
            raise RuntimeError(f"pre-training exchange failed: {exc}") from None
        self.phase = TRAINING
        self.round = 1
        # What start-up built (torch, the model, the vocabulary) lives to the end: out of the
        # collector's sight, a full collection in the middle of a round takes under 1 ms, not
        # the 100-340 ms measured with it in view.
        gc.freeze()
        log.info("starting with %d worker(s): %s", n, ", ".join(sorted(self.workers)))
        self._start_round(time.monotonic())  # setup() may have taken a while

    def _alive(self, worker_id: str, now: float | None = None) -> bool:
        """Heard from within ``heartbeat_timeout`` (workers ping every second)."""
        now = time.monotonic() if now is None else now
        return now - self.workers[worker_id].last_seen <= self.cfg.heartbeat_timeout

    def _sample(self) -> list[str]:
        """This round's participants: a fraction C of the registered workers, at least one.

        With C = 1 every registered worker takes part (one that is down may come back within
        the round); with C < 1 the sample is drawn among the live ones.
        """
        everyone = sorted(self.workers)
        k = max(1, round(self.cfg.client_fraction * len(everyone)))
        if k >= len(everyone):
            return everyone
        live = [w for w in everyone if self._alive(w)] or everyone
        return sorted(self.rng.choice(live, size=min(k, len(live)), replace=False).tolist())

    def _start_round(self, now: float) -> None:
        fixed = self.family.participants()  # a step of several rounds keeps its workers
        rnd = RoundState(self.round, now, now + self.cfg.round_deadline,
                         self._sample() if fixed is None else fixed)
        self.open = rnd
        first = rnd.number == 1  # the setup information rides along once
        t0 = time.perf_counter()
        if self.family.per_worker:
            for wid in rnd.participants:
                p = self.family.payload_for(wid)
                rnd.broadcast_bytes += send(self.pub, M.DIRECT, self._payload_body(p, first),
                                            p.arrays, topic=M.direct_topic(wid))
        else:
            p = self.family.payload_for("")
            rnd.broadcast_bytes = send(self.pub, M.ROUND, self._payload_body(p, first), p.arrays,
                                       topic=M.TOPIC_ROUND)
        rnd.publish_time = time.perf_counter() - t0
        self._announce()  # tell late or lossy subscribers at once that a round is open

    def _maybe_close_round(self, now: float) -> None:
        rnd = self.open
        assert rnd is not None
        waiting = [w for w in rnd.participants if w not in rnd.results]
        live = [w for w in waiting if w in self.workers and self._alive(w, now)]
        enough = len(rnd.results) >= min(self.cfg.min_workers, len(rnd.participants))
        # Dead participants are dropped at once rather than at the deadline.
        if not ((not live and enough) or (now >= rnd.deadline and enough)):
            if now >= rnd.deadline and now - rnd.last_wait_log >= 10.0:
                rnd.last_wait_log = now
                log.warning("round %d: deadline passed with %d update(s), min_workers=%d; "
                            "waiting for more", rnd.number, len(rnd.results),
                            self.cfg.min_workers)
            return
        missing = sorted(waiting)
        if missing:
            dead = [w for w in missing if w not in live]
            # Millisecond rounds would repeat the same warning hundreds of times a second while
            # a worker is down: warn once per absence, the rest goes to the debug log (and every
            # round's `missing` to metrics.jsonl).
            level = logging.DEBUG if set(missing) <= self._absent else logging.WARNING
            log.log(level, "round %d: closing without %s%s", rnd.number, ", ".join(missing),
                    f" (no heartbeat for {self.cfg.heartbeat_timeout:g}s: "
                    f"{', '.join(dead)})" if dead else " (deadline)")
            self._absent |= set(missing)
        back = sorted(self._absent & set(rnd.results))
        if back:
            log.info("round %d: %s reported again", rnd.number, ", ".join(back))
            self._absent -= set(back)
        t0 = time.perf_counter()
        # In worker order, not arrival order: the same updates always give the same sum.
        results = [rnd.results[w] for w in sorted(rnd.results)]
        self.family.aggregate(rnd.number, results)
        aggregate_time = time.perf_counter() - t0
        self.version += 1
        events = self._log_round(rnd, aggregate_time, missing)
        self.open = None
        # The round's events reach metrics.jsonl once a checkpoint covering it is on disk, so
        # the log never shows a round that a resumed master would run again.
        every = self.cfg.checkpoint_every
        last = rnd.number >= self.cfg.rounds or self.family.finished()
        # Within the time budget: a 100 MB model written every round would slow every round
        # by the write's disk and memory traffic (at 25 M parameters: +200 ms a round).
        due = every and (last or (rnd.number % every == 0 and self._checkpoints.ready()))
        if every and not due and rnd.number % every == 0 and not self._budget_logged:
            self._budget_logged = True
            log.info("a checkpoint takes %.2f s to write: skipping rounds' checkpoints to keep "
                     "writing under %g %% of the time (checkpoint_budget)",
                     self._checkpoints.last_write_s, 100 * self.cfg.checkpoint_budget)
        ckpt = self._checkpoint(events) if due else None  # the state as this round left it
        try:
            self._next_round(last)
        finally:
            # Handed to the writer thread only once the next round is out: its serialization
            # would otherwise hold the GIL while the main thread publishes.
            self._checkpoints.submit(ckpt, events, hold=bool(every))

    def _next_round(self, last: bool) -> None:
        if last:
            self.phase = REPORTING
            self._report_deadline = time.monotonic() + C.REPORT_TIMEOUT
            send(self.pub, M.SHUTDOWN, {"run_id": self.run_id, "version": self.version},
                 topic=M.TOPIC_SHUTDOWN)
            self._announce()
            log.info("training done after %d round(s); collecting final reports", self.round)
        else:
            self.round += 1
            self._start_round(time.monotonic())

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, events: list[dict[str, Any]]) -> Checkpoint:
        family_meta, family_arrays = self.family.state()
        meta = {
            "events": events,
            "run_id": self.run_id, "round": self.round, "version": self.version,
            "setup_info": self.family.setup_info_, "global_meta": self.family.global_.meta,
            "registrations": {w.worker_id: {"n_samples": w.n_samples, "device": w.device,
                                            "info": w.info} for w in self.workers.values()},
            "rng_state": self.rng.bit_generator.state, "family_meta": family_meta,
            "family": self.cfg.family, "strategy": self.family.strategy.name,
        }
        return Checkpoint(meta, dict(self.family.global_.arrays), self.family.strategy.state(),
                          family_arrays)

    def _restore(self, ckpt: Checkpoint) -> None:
        m = ckpt.meta
        if m.get("family") != self.cfg.family or m.get("strategy") != self.family.strategy.name:
            raise RuntimeError(f"the checkpoint is of {m.get('family')}/{m.get('strategy')}, "
                               f"the config asks for {self.cfg.family}/"
                               f"{self.family.strategy.name}")
        self.run_id = m["run_id"]
        self.version = int(m["version"])
        self.family.setup_info_ = m["setup_info"]
        self.family.global_ = Payload(m["global_meta"], dict(ckpt.global_arrays))
        self.family.strategy.load_state(ckpt.strategy_arrays)
        self.family.load_state(m["family_meta"], ckpt.family_arrays)
        self.rng.bit_generator.state = m["rng_state"]
        now = time.monotonic()
        for wid, r in m["registrations"].items():
            self.workers[wid] = WorkerState(wid, r["n_samples"], r["device"], r["info"], now, now)
        done = int(m["round"])
        # The last round's events, if the master died between its checkpoint and its log line.
        logged = {(e.get("event"), e.get("round"), e.get("worker"))
                  for e in read_metrics(self.out / "metrics.jsonl")}
        for e in m.get("events", []):
            if (e["event"], e.get("round"), e.get("worker")) not in logged:
                self.metrics.write(**e)
        self._resume_at = now + C.RESUME_GRACE
        if done >= self.cfg.rounds:
            self.round, self.phase = done, REPORTING
            self._report_deadline = now + C.REPORT_TIMEOUT
        else:
            self.round, self.phase = done + 1, TRAINING
        self.metrics.write("resume", run_id=self.run_id, completed_round=done,
                           version=self.version, time=time.time())
        gc.freeze()  # as at a first start (see _maybe_start)
        log.info("resumed job %s after round %d (model version %d)", self.run_id, done,
                 self.version)

    def _log_round(self, rnd: RoundState, aggregate_time: float, missing: list[str]
                   ) -> list[dict[str, Any]]:
        """Log the round and return its metrics events (written with its checkpoint)."""
        duration = time.monotonic() - rnd.started
        slowest = max((m.get("train_time", 0.0) for m in rnd.metrics.values()), default=0.0)
        slowest_compute = max((m.get("train_time", 0.0) + m.get("eval_time", 0.0)
                               for m in rnd.metrics.values()), default=0.0)
        events = [dict(event="worker_round", round=rnd.number, worker=wid,
                       n_samples=rnd.results[wid].n_samples, **m)
                  for wid, m in sorted(rnd.metrics.items())]
        scores = [m["macro_f1"] for m in rnd.metrics.values() if "macro_f1" in m]
        events.append(dict(
            event="round", round=rnd.number, version=self.version, n_updates=len(rnd.results),
            missing=missing, duration_s=duration, slowest_train_s=slowest,
            overhead_s=duration - slowest, slowest_compute_s=slowest_compute,
            comm_overhead_s=duration - slowest_compute, aggregate_s=aggregate_time,
            publish_s=rnd.publish_time, broadcast_bytes=rnd.broadcast_bytes,
            bytes_in=rnd.bytes_in, mean_macro_f1=float(np.mean(scores)) if scores else None,
            participants=rnd.participants, time=time.time()))
        log.info("round %d/%d: %d update(s) in %.3fs (slowest training %.3fs, overhead "
                 "%.1f ms)%s", rnd.number, self.cfg.rounds, len(rnd.results), duration, slowest,
                 1000 * (duration - slowest),
                 f", global macro-F1 at round start {np.mean(scores):.3f}" if scores else "")
        return events

    def _finish(self) -> None:
        self._checkpoints.flush()  # every round's events are in the log before the summary
        final = self.family.global_
        buf = _npz_bytes(final.arrays)
        atomic_write_bytes(self.out / "model.npz", buf)
        atomic_write_bytes(self.out / "model.json", json.dumps(
            {"family": self.cfg.family, "setup": self.family.setup_info_, "meta": final.meta,
             "rounds": self.round,
             "version": self.version, "run_id": self.run_id}, indent=2).encode())
        sim = None
        if self.cfg.baselines:
            log.info("training the centralized baseline on the pooled data")
            sim = self.family.simulation_baselines()
        sim = sim or {}
        rows = comparison_rows({w: s.report for w, s in self.workers.items()},
                               sim.get("centralized"))
        table = format_table(rows, sim.get("pooled"))
        atomic_write_bytes(self.out / "comparison.md", (table + "\n").encode())
        atomic_write_bytes(self.out / "comparison.json", json.dumps(
            {"per_worker": rows, "pooled": sim.get("pooled")}, indent=2).encode())
        self.summary = {"run_id": self.run_id, "rounds": self.round, "version": self.version,
                        "workers": sorted(self.workers), "comparison": rows,
                        "pooled": sim.get("pooled"), "errors_served": self.errors_served}
        atomic_write_bytes(self.out / "summary.json", json.dumps(self.summary, indent=2).encode())
        self.metrics.write("done", rounds=self.round, version=self.version, time=time.time())
        log.info("results in %s\n%s", self.out, table)
        self.phase = DONE
        # A last few announcements so workers still listening learn the job is over.
        for _ in range(3):
            self._announce()
            time.sleep(C.ANNOUNCE_INTERVAL / 2)


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()
