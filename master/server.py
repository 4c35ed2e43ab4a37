"""The master: announce on PUB, serve REQ/REP, run rounds, aggregate, report.

One thread, one event loop. Each turn it announces itself when due, answers the requests
waiting on REP (each answer is quick: validation and bookkeeping), and advances the job's
phase: joining -> training -> reporting -> done. Aggregation runs between requests, never
inside one, so a slow aggregation never holds a REQ waiting beyond its own cost.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq

from common import constants as C
from common.aggregate import all_finite
from common.atomic import hold_lock
from common.config import ClusterConfig, data_terms, job_terms
from common.constants import REPORTS_FILE, STRATEGY_ARRAY_PREFIX
from common.data.shards import simulated
from common.net import errors
from common.net import messages as M
from common.net.compression import decompress
from common.net.security import server_keys, start_authenticator
from common.net.transport import (
    bind_pub,
    bind_rep,
    decode_request,
    recv_request,
    send,
    send_error,
)
from common.net.wire import Message, ProtocolError
from common.privacy.laplace import laplace_epsilon
from common.runlog import MetricsLog, RoundLines, read_metrics
from common.secagg.protocol import round_context
from common.secagg.ring import ring_bits
from common.tracking import make_sinks
from master import screening
from master.agreement import job_differences, listed, refusal
from master.checkpoint import Checkpoint, CheckpointWriter, capture, restore
from master.families import Payload, ServerFamily, make_server_family
from master.families.base import check_arrays
from master.memory import MemoryCeiling, default_limit, resident_bytes
from master.outputs import write_config, write_model, write_results
from master.privacy import PrivacyLedger, batching
from master.rounds import RateLimiter, Roster, RoundState, may_close, round_events
from master.secagg import DONE as SECURE_DONE
from master.secagg import FAILED as SECURE_FAILED
from master.secagg import SecureRound
from master.strategies import ClientResult

log = logging.getLogger("fedctl.master")

JOINING, TRAINING, REPORTING, DONE = M.JOINING, M.TRAINING, M.REPORTING, M.DONE
#: What the refusals of senders past MAX_REFUSED_SENDERS are counted under.
OTHER_SENDERS = "(other senders)"
JOIN_LOG_INTERVAL_S = 10.0  # how often waiting for workers says so
#: Refusals of an update for what it holds (not for when or by whom it came): its worker will
#: not send that round again.
REFUSED_UPDATE = frozenset({errors.BAD_FIELD, errors.DTYPE, errors.SHAPE, errors.NOT_FINITE,
                            errors.REJECTED})



class _RedoAnswer(ProtocolError):
    """An error answer that a restart causes, not the worker (a resumed master's round not
    open yet, or one it went back before; a secure round begun again): the worker redoes the
    round, and summary.json does not count it among the worker's refused requests."""


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut at ``limit`` characters (a list of a thousand worker names)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _abstains(rnd: RoundState, worker_id: str) -> bool:
    """Whether a worker's update says, in the clear, that it sat the round out (its
    ``abstain`` metric: a step of several rounds it holds no state of). Under secure
    aggregation this is how the master knows who; a plain upload shows it in its arrays too."""
    return bool(rnd.metrics.get(worker_id, {}).get("abstain"))


def _log_dropped(worker_id: str, round_: int, dropped: Sequence[str]) -> None:
    if dropped:  # one line per update taken: bounded by the rounds, as the updates are
        log.warning("round %d: %s's update is taken without its metric(s) %s: not finite, "
                    "past MAX_METRIC, a score outside its range, or a duration outside "
                    "[0, MAX_TIMING_S]", round_, worker_id, ", ".join(dropped))


def _same_arrays(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two models hold the very same array objects (a payload built anew for each
    call, LDA's per-worker one, holds the same arrays)."""
    return a is b or (a.keys() == b.keys() and all(a[k] is b[k] for k in a))


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
        for note in self.family.notes:
            log.warning("%s", note)
        self.family.warm_up()
        self.run_id = secrets.token_hex(4)
        # A new one at every start of the process: workers that see it change re-register.
        self.incarnation = secrets.token_hex(4)
        self.phase = JOINING
        self.round = 0
        self.version = 0
        self.roster = Roster(cfg.heartbeat_timeout, cfg.client_fraction, cfg.seed,
                             among_live=cfg.privacy.client_dp is None)
        self.workers = self.roster.workers  # by id: what the master knows of each
        self.open: RoundState | None = None
        self.secure: SecureRound | None = None  # the open round's, with secure_aggregation
        self._noticed_stage: tuple[bytes, str] | None = None  # the last stage told on PUB
        self.out = Path(cfg.output_dir)
        if resume:  # before anything is written there
            Checkpoint.check_resumable(self.out, cfg.rounds)
        self.out.mkdir(parents=True, exist_ok=True)
        try:  # before anything is written there
            self._lock = hold_lock(self.out / C.MASTER_LOCK)
        except BlockingIOError:
            raise RuntimeError(f"output_dir: another master is writing into {self.out} (its "
                               f"process still runs); stop it, or choose another output_dir"
                               ) from None
        try:
            self._init_rest(cfg, resume)
        except BaseException:  # refused: the folder is free again
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None
            raise

    def _init_rest(self, cfg: ClusterConfig, resume: bool) -> None:
        """The master's state after its output folder is taken."""
        self.metrics = MetricsLog(self.out / "metrics.jsonl",
                                  make_sinks(cfg.tracking, self.out, self.run_id)
                                  if cfg.tracking.enabled else ())
        self.errors_served = 0
        self.refused: dict[str, Counter] = defaultdict(Counter)  # worker -> code -> count
        self._last_refusal = ""  # the last update refused in a round: why nothing trained
        self.excluded: dict[str, str] = {}  # worker -> why it takes no further part
        self._silent: Counter = Counter()  # rounds a live participant sent nothing, not forgiven
        self._rounds_since_forgiven: Counter = Counter()  # toward forgiving the next one
        self._secure_rejoins: Counter = Counter()  # same-process restarts of secure rounds
        self._abstained: Counter = Counter()  # abstentions not yet forgiven
        self._steps_since_forgiven: Counter = Counter()  # toward forgiving the next one
        self._reports_taken: Counter = Counter()  # final reports kept, by worker
        self._registrations: dict[str, list[float]] = {}  # logged ones, by worker (monotonic)
        self._rates = RateLimiter(C.REQUEST_RATE, C.REQUEST_BURST)
        self._register_tried: dict[str, float] = {}  # CURVE identity -> its last register
        self.max_message_bytes = int(cfg.max_message_mb * 1024**2)
        self.summary: dict[str, Any] = {}
        self._first_join: float | None = None
        self._join_started = time.monotonic()
        self._report_deadline = 0.0
        self._next_announce = 0.0
        self._announced_at = -float("inf")
        self._expected = {w.name for w in cfg.workers}
        self._resume_at = 0.0
        self._rejoin_until = 0.0  # resumed after training: the workers' time to come back
        self._model_written: int | None = None  # the version model.npz holds, once written
        # Went back to a checkpoint, and its first round has not closed: requests of rounds past
        # it were sent to the master that died (not counted as the workers' refusals).
        self._resumed = False
        self._training_since = 0.0  # when training started (or resumed)
        self._next_scan = 0.0  # when _abandoned next looks at every worker
        self._budget_logged = False
        self._absent: set[str] = set()  # warned of once, until they report again
        self._round_lines = RoundLines()  # a line a round, paced (millisecond rounds)
        self._missing_said: set[str] = set()  # the missing workers the last round line had
        self._growth = screening.GrowthWindow()  # the published models' recent norms
        self._distances = screening.DistanceHistory()  # the aggregated updates' distances
        # why the secure sums since the last of their kind applied were not, and that kind
        # (length, family's secure_kind)
        self._refused_sums: list[tuple[tuple[int, int | None], str]] = []
        # Called before each tick of serve(): the command line's check that no stop signal's
        # exception was swallowed on the way (fedctl.run.raise_if_stopped).
        self.on_tick: Callable[[], None] | None = None
        self._cpu_mark = time.process_time()  # this process's CPU at the last round's close
        self.pub: zmq.Socket | None = None
        self.rep: zmq.Socket | None = None
        self._rep_setup = None
        self._memory = MemoryCeiling(None)  # set at bind()
        self._auth = None
        self._checkpoints = CheckpointWriter(self.out, self.metrics, cfg.checkpoint_budget)
        self.privacy = PrivacyLedger(cfg.privacy, cfg.client_fraction)
        self._terms = job_terms(cfg)  # kept in each checkpoint: a resume must agree with them
        # ... and with how the master's own data was split (its baselines are cut from it)
        # (kept whether or not baselines are on: the shares the workers train on follow them)
        self._data_terms = data_terms(cfg) if simulated(cfg) else {}
        if resume:
            try:
                ckpt = Checkpoint.load(self.out)
                try:
                    self._restore(ckpt)
                except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
                    # A record edited by hand (or by someone else): one line, not a traceback.
                    raise RuntimeError(
                        f"{self.out / 'checkpoint.npz'}: its record is not a checkpoint's "
                        f"({type(exc).__name__}: {str(exc)[:120]}): resume is not possible "
                        f"from it") from None
            except BaseException:  # refused: its log closed (the lock goes in __init__)
                self._checkpoints.close()
                self.metrics.close()
                raise

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
        self._rep_setup = setup
        for attr, endpoint, key in (("pub", m.pub_bind, "pub_port"), ("rep", m.rep_bind,
                                                                       "rep_port")):
            try:
                sock = (bind_pub(self.ctx, endpoint, setup=setup) if attr == "pub"
                        else bind_rep(self.ctx, endpoint, self.max_message_bytes, setup=setup))
            except zmq.ZMQError as exc:
                self.close()
                raise OSError(f"cannot bind {endpoint} (master.{key}): {exc.strerror}") from None
            setattr(self, attr, sock)
        limit = (default_limit() if self.cfg.memory_limit_mb is None
                 else int(self.cfg.memory_limit_mb * 1024**2))
        self._memory = MemoryCeiling(limit)
        rss = resident_bytes()
        if limit is not None and rss is not None and limit - rss < self.max_message_bytes:
            log.warning("memory: memory_limit_mb leaves %d MiB above the master's %d MiB, "
                        "less than one max_message_mb (%g): an update that large would be "
                        "dropped again at every try", max(limit - rss, 0) // 1024**2,
                        rss // 1024**2, self.cfg.max_message_mb)
        log.info("master %s: PUB %s, REP %s, %s with %s, %d round(s), waiting for %s",
                 self.run_id, m.pub_bind, m.rep_bind, self.cfg.family, self.family.strategy.name,
                 self.cfg.rounds, ", ".join(sorted(self._expected)) or
                 f"{self.cfg.min_workers} worker(s)")

    def serve(self) -> dict[str, Any]:
        """Run the job to the end; returns the summary written to ``summary.json``."""
        if self.rep is None:
            self.bind()
        if not (self.out / "cluster.yaml").exists():  # `fedctl run` wrote it already
            write_config(self.out, self.cfg)  # what the run was, for load_model and show
        self.metrics.write("start", run_id=self.run_id, family=self.cfg.family,
                           strategy=self.family.strategy.name, rounds=self.cfg.rounds,
                           time=time.time())
        try:
            while self.phase != DONE:
                if self.on_tick is not None:
                    self.on_tick()
                self._tick()
        finally:
            self._checkpoints.close()  # its last events go to the log before the log closes
            self.metrics.close()
        return self.summary

    def close(self) -> None:
        self._checkpoints.close()
        if self._lock is not None:  # the output folder is free for a resume
            os.close(self._lock)
            self._lock = None
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
        timeout = max(0, min(C.POLL_INTERVAL_MS, int((self._next_announce - now) * 1000)))
        if self.rep.poll(timeout, zmq.POLLIN):
            # Serve what is waiting, but no more than a turn's share: a peer that keeps the
            # queue full must not keep a round that has its updates from closing.
            served = 0
            while served < C.MAX_REQUESTS_PER_TURN and self.rep.poll(0, zmq.POLLIN):
                self._serve_one()
                served += 1
        self._advance(time.monotonic())
        self._notice_secure_stage()
        # (not once done: the baselines at the end are the master's own memory)
        if self.phase != DONE and (rss := self._memory.over()) is not None:
            self._drop_connections(rss)

    def _drop_connections(self, rss: int) -> None:
        """Past the memory ceiling (master/memory.py): close the REP socket, with every
        connection's queued requests and the one being received, and bind it again."""
        limit = self._memory.limit
        self.rep.close(linger=0)
        after = self._memory.settle()
        deadline = time.monotonic() + C.MEMORY_SETTLE_S
        while True:  # libzmq closes the old listener on its own thread: the port frees soon
            try:
                self.rep = bind_rep(self.ctx, self.cfg.master.rep_bind, self.max_message_bytes,
                                    setup=self._rep_setup)
                break
            except zmq.ZMQError as exc:
                if time.monotonic() >= deadline:
                    raise OSError(f"cannot bind {self.cfg.master.rep_bind} again after "
                                  f"dropping its connections: {exc.strerror}") from None
                time.sleep(0.05)
        mib = 1024**2
        log.warning("memory: %d MiB resident, past memory_limit_mb (%d): dropped every "
                    "connection to the REP port and the requests ZeroMQ held on them (a request "
                    "is held whole before it can be read); %s MiB after, workers send again",
                    rss // mib, limit // mib, "?" if after is None else after // mib)
        self.metrics.write("connections_dropped", round=self.round, rss_mb=rss / mib,
                           limit_mb=limit / mib, time=time.time())
        if after is not None and after > limit:
            self._memory.raise_to(after)
            log.warning("memory: the master's own memory (%d MiB) is past memory_limit_mb; "
                        "the ceiling is now %d MiB (set memory_limit_mb higher)",
                        after // mib, self._memory.limit // mib)

    def _notice_secure_stage(self) -> None:
        """Tell the open secure round's workers on PUB that its stage changed: those waiting
        for it ask again at once instead of at their next poll (docs/PROTOCOL.md)."""
        sa = self.secure
        stage = None if sa is None else (sa.context, sa.stage)
        if stage is None or stage == self._noticed_stage:
            return
        self._noticed_stage = stage
        send(self.pub, M.SECAGG_STAGE, {"round": sa.number, "attempt": sa.attempt,
                                        "stage": sa.stage, "context": sa.context},
             topic=M.TOPIC_ANNOUNCE)

    def _announce(self) -> None:
        self._announced_at = time.monotonic()
        self._next_announce = self._announced_at + C.ANNOUNCE_INTERVAL
        send(self.pub, M.ANNOUNCE, {"run_id": self.run_id, "incarnation": self.incarnation,
                                    # so that a worker of another job leaves before it says
                                    # anything about its documents (see Worker._register); the
                                    # family's own name, however cluster.yaml spelled a plug-in
                                    "family": self.family.name,
                                    "phase": self.phase, "round": self.round,
                                    "version": self.version, "rounds": self.cfg.rounds,
                                    "open": self.open is not None,
                                    # A secure round begun again: its workers redo it.
                                    "attempt": self.secure.attempt if self.secure else 0,
                                    # why a job ended without a model: its workers exit 3
                                    **({"failed": str(self.summary["failed"])[:500]}
                                       if self.phase == DONE and self.summary.get("failed")
                                       else {})},
             topic=M.TOPIC_ANNOUNCE)

    # ------------------------------------------------------------------ requests
    def _serve_one(self) -> None:
        frames, nbytes, identity = recv_request(self.rep)
        # With CURVE the key names the sender before anything is decoded: a flooding peer is
        # refused at the cost of a lookup.
        if identity is not None and not self._rates.allow(identity):
            return self._refuse(errors.BUSY, "too many requests: slow down", identity)
        if (identity is not None and bytes(frames[0].buffer) == M.REGISTER.encode()
                and len(frames) > 1 and len(frames[1]) > C.LARGE_REGISTER_BYTES):
            # The one request whose header may be large: that is decoded once per
            # REGISTER_INTERVAL a key (a small one costs no more than any other request).
            now = time.monotonic()
            if now - self._register_tried.get(identity, -float("inf")) < C.REGISTER_INTERVAL:
                return self._refuse(errors.BUSY, f"register at most once every "
                                    f"{C.REGISTER_INTERVAL:g}s", identity)
            self._register_tried[identity] = now
        try:
            msg = decode_request(frames, nbytes, self.max_message_bytes)
        except ProtocolError as exc:
            return self._refuse(exc.code, str(exc), identity or "?")
        except Exception as exc:  # a decoder's bug must not take the master down either
            log.exception("error decoding a request from %r", identity or "?")
            return self._refuse(errors.REJECTED, f"{type(exc).__name__}: {exc}", identity or "?")
        del frames
        # Only a string names a sender: the repr of anything else a peer sent (a list nested a
        # thousand deep) could raise, here, outside the try below, and end the master.
        named = msg.body.get("worker_id")
        worker_id = named[:128] if isinstance(named, str) else "?"
        try:
            M.check_request(msg.kind, msg.body)
            if identity is not None and worker_id != identity:
                raise ProtocolError(f"{msg.kind} for worker {worker_id!r} sent with the key of "
                                    f"{identity!r}", code=errors.IDENTITY)
            if identity is None and not self._rates.allow(worker_id):
                raise ProtocolError("too many requests: slow down", code=errors.BUSY)
            if worker_id in self.excluded:
                raise ProtocolError(f"{worker_id} was excluded from this job: "
                                    f"{self.excluded[worker_id]}", code=errors.EXCLUDED)
            if msg.kind != M.REGISTER:
                self._same_process(worker_id, msg.body.get("process"))
            handler = {M.REGISTER: self._on_register, M.FETCH: self._on_fetch,
                       M.UPDATE: self._on_update, M.REPORT: self._on_report,
                       M.PING: self._on_ping, M.SECAGG: self._on_secagg}[msg.kind]
            handler(msg, nbytes)
        except _RedoAnswer as exc:  # a restart's doing, not the worker's: answered, not counted
            log.debug("answered %r: %s (%s)", identity or worker_id, exc, exc.code)
            send_error(self.rep, exc.code, str(exc))
        except ProtocolError as exc:
            self._refuse(exc.code, str(exc), identity or worker_id)
        except Exception as exc:  # a bug must not take the master down with it
            sender = identity or worker_id
            # (the traceback once per sender: repeating the request repeated it, 580 bytes of
            # log a request at the rate a sender is allowed)
            seen = self.refused.get(self._counted_as(sender), {}).get(errors.REJECTED)
            log.log(logging.DEBUG if seen else logging.ERROR,
                    "error serving %s from %r", msg.kind, worker_id, exc_info=True)
            self._refuse(errors.REJECTED, f"{type(exc).__name__}: {exc}", sender)

    def _refuse(self, code: str, message: str, sender: str) -> None:
        """Answer with an error; the first refusal of each kind per sender is logged, the rest
        counted (a flood must not flood the log too) and totalled in summary.json."""
        self.errors_served += 1
        sender = self._counted_as(sender)
        self.refused[sender][code] += 1
        level = logging.WARNING if self.refused[sender][code] == 1 else logging.DEBUG
        log.log(level, "refused a request from %r: %s (%s)%s", sender, message, code,
                "; further ones of this kind are counted, not logged"
                if level == logging.WARNING else "")
        send_error(self.rep, code, message)

    def _counted_as(self, sender: str) -> str:
        """Whom ``sender``'s refusals are counted under. Without CURVE a name costs nothing:
        200,000 made-up ones grew the table (and the log, a line each) by 100 MB. Past
        MAX_REFUSED_SENDERS, new ones are counted together."""
        if sender not in self.refused and len(self.refused) >= C.MAX_REFUSED_SENDERS:
            return OTHER_SENDERS
        return sender

    def _same_process(self, worker_id: str, process: Any) -> None:
        """Refuse a request from another process than the one registered under ``worker_id``
        (``replaced``): of two processes started with one id, the one registered first leaves
        with one line, rather than both training and one being refused round after round. A
        restarted worker is the registered one: it registered again."""
        ws = self.workers.get(worker_id)
        if ws is not None and ws.process is not None and process is not None \
                and process != ws.process:
            raise ProtocolError(f"another process registered as {worker_id} after this one "
                                f"(two workers started with one --id?)", code=errors.REPLACED)

    def _worker(self, msg: Message) -> Any:
        ws = self.workers.get(msg.body["worker_id"])
        if ws is None:
            raise ProtocolError(f"worker {msg.body['worker_id']!r} is not registered",
                                code=errors.UNKNOWN_WORKER)
        ws.last_seen = time.monotonic()
        return ws

    def _on_register(self, msg: Message, nbytes: int) -> None:
        b = msg.body
        wid = b["worker_id"]
        if self._expected and wid not in self._expected:
            raise ProtocolError(f"worker {wid!r} is not in this cluster's worker list",
                                code=errors.UNKNOWN_WORKER)
        if (not self.cfg.workers and wid not in self.workers
                and len(self.workers) >= C.MAX_UNLISTED_WORKERS):
            raise ProtocolError(f"worker {wid!r}: this cluster has no worker list and already "
                                f"admits {len(self.workers)} workers, its most "
                                f"(MAX_UNLISTED_WORKERS)", code=errors.TOO_LARGE)
        allowed = self.family.info_fields
        if allowed is not None:
            unknown = sorted(str(k)[:40] for k in b["info"] if k not in allowed)
            if unknown:
                raise ProtocolError(f"register.info: unknown field(s) {unknown} (this family "
                                    f"takes {sorted(allowed)})", code=errors.BAD_FIELD)
        known = self.workers.get(wid)
        if known is not None and known.n_samples != b["n_samples"]:
            raise ProtocolError(f"register: {wid} registered with {known.n_samples} samples, "
                                f"not {b['n_samples']}", code=errors.REJECTED)
        if "job" in b:  # (a plug-in's worker may not say)
            differences = job_differences(self.cfg, self.family, b["job"], there=f"on {wid}",
                                          here="at the master")
            if differences:
                raise ProtocolError(refusal(wid, differences), code=errors.REJECTED)
        self.family.check_info(b["info"])
        declared = self.family.declared_documents(b["info"])
        if declared is not None and declared[1] > b["n_samples"]:
            raise ProtocolError(f"register.info.{declared[0]}: {declared[1]:g} documents, more "
                                f"than the {b['n_samples']} registered (n_samples)",
                                code=errors.BAD_FIELD)
        if self.phase != JOINING:
            self.family.admit(wid, b["info"])
        rejoin = self.roster.add(wid, b["n_samples"], b["device"], b["info"])
        process = b.get("process")
        # A registration the same process repeats within REREGISTER_QUIET_S says nothing new,
        # and past REGISTER_LOG_LIMIT in a window nothing more is news either: logged at debug
        # only, so that one member at its request rate cannot fill the disk with log lines and
        # events. A restarted process (forked in milliseconds) is news.
        quiet = ((known is not None and known.process == process
                  and time.monotonic() - known.registered_at < C.REREGISTER_QUIET_S)
                 or not self._registration_logged(wid))
        if rejoin and known is not None and known.process not in (None, process) and not quiet:
            log.warning("%s registered again from another process (%s, was %s): requests of "
                        "the earlier one are refused from now on", wid, process, known.process)
        self.workers[wid].process = process
        if (rejoin and self.secure is not None and wid in self.secure.points
                and self.secure.stage not in (SECURE_DONE, SECURE_FAILED)):
            if known is not None and known.process == process:
                # Its secrets are still in the same process: each restart it asks for only
                # delays the round (held twice a round, 80 s a round at a 10 s deadline, and
                # never counted). A few in a job are strikes; honest ones are rare.
                self._secure_rejoins[wid] += 1
                if self._secure_rejoins[wid] >= C.ABSTAIN_LIMIT:
                    why = (f"registered again from the same process in secure rounds "
                           f"{self._secure_rejoins[wid]} times (ABSTAIN_LIMIT), each "
                           f"restarting the round")
                    self._exclude(wid, why)
                    raise ProtocolError(f"{wid} is excluded from this job: {why}",
                                        code=errors.EXCLUDED)
            if self.secure.attempt >= C.SECAGG_MAX_ATTEMPTS:
                # Each restart gives the round a new deadline: unbounded, one member's
                # registrations would hold the round open for ever.
                why = (f"registered again in round {self.secure.number}'s secure "
                       f"aggregation after its {C.SECAGG_MAX_ATTEMPTS - 1} restarts")
                self._exclude(wid, why)
                raise ProtocolError(f"{wid} is excluded from this job: {why}",
                                    code=errors.EXCLUDED)
            self._restart_secure(f"{wid} registered again: its secrets went with its old "
                                 f"process")
        if self._first_join is None:
            self._first_join = time.monotonic()
        log.log(logging.DEBUG if quiet else logging.INFO, "%s %s: %d samples on %s (%d/%d "
                "registered)", "re-registered" if rejoin else "registered", wid,
                b["n_samples"], b["device"], len(self.workers),
                len(self._expected) or self.cfg.min_workers)
        if not quiet:
            self.metrics.write("register", worker=wid, n_samples=b["n_samples"],
                               device=b["device"], rejoin=rejoin, phase=self.phase,
                               round=self.round, time=time.time())
        body = {"run_id": self.run_id, "incarnation": self.incarnation, "phase": self.phase,
                "round": self.round, "version": self.version, "rounds": self.cfg.rounds}
        if self.phase != JOINING:
            body["setup"] = self.family.setup_info_
        send(self.rep, M.WELCOME, body)

    def _registration_logged(self, worker_id: str) -> bool:
        """Whether a registration of ``worker_id`` now is within REGISTER_LOG_LIMIT in the last
        REGISTER_LOG_WINDOW_S (counted if so); the first one past the limit says so once."""
        now = time.monotonic()
        times = [t for t in self._registrations.get(worker_id, [])
                 if now - t < C.REGISTER_LOG_WINDOW_S]
        self._registrations[worker_id] = times
        if len(times) > C.REGISTER_LOG_LIMIT:
            return False
        times.append(now)
        if len(times) > C.REGISTER_LOG_LIMIT:
            log.warning("%s registered %d times within %g s: its registrations are not logged "
                        "until it slows down", worker_id, len(times), C.REGISTER_LOG_WINDOW_S)
            return False
        return True

    def _on_fetch(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        if self.phase == JOINING:
            raise ProtocolError("no model yet: the cluster is still joining", code=errors.NOT_READY)
        if self.phase == TRAINING and self.open is None:
            raise (_RedoAnswer if self._resumed else ProtocolError)(
                f"round {self.round} is not open yet", code=errors.NOT_READY)
        payload = self.family.payload_for(ws.worker_id)
        # The setup (a vocabulary, a class list) only for a worker that asks for it.
        with_setup = msg.body.get("setup", True) is not False
        send(self.rep, M.MODEL, self._payload_body(payload, with_setup),
             self._with_strategy_arrays(payload.arrays))

    def _with_strategy_arrays(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """The model's arrays and those the strategy sends along (SCAFFOLD's control)."""
        extra = self.family.strategy.client_arrays(arrays)
        return {**arrays, **extra} if extra else arrays

    def _payload_body(self, payload: Payload, with_setup: bool) -> dict[str, Any]:
        deadline = self.open.deadline - time.monotonic() if self.open else 0.0
        base = self.family.base_round(self.round)
        # Worker snapshots a resumed master may still ask for start at its checkpoint's base.
        written = self._checkpoints.written_base
        keep = base if not self.cfg.checkpoint_every else min(base, written or 0)
        body = {"run_id": self.run_id, "phase": self.phase, "round": self.round,
                "version": self.version, "deadline_s": deadline,
                # What the strategy asks of the workers (FedProx's proximal_mu) rides along.
                "meta": {**payload.meta, **self.family.strategy.client_settings()},
                "participants": self.open.participants if self.open else [],
                "base": base, "keep": keep,
                "sent_at": time.time()}  # wall clock: latency on one machine's loopback
        if with_setup:
            body["setup"] = self.family.setup_info_
        if self.secure is not None:
            body["secagg"] = self.secure.settings()
        return body

    def _on_update(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        try:
            self._take_update(ws, msg, nbytes)
        except ProtocolError as exc:
            # A worker whose update was refused moves on to the next round: past its deadline
            # the round does not wait for it even when short of min_workers.
            if exc.code in REFUSED_UPDATE and self.open is not None \
                    and ws.worker_id in self.open.participants:
                self.open.refused.add(ws.worker_id)
                self.open.refused_at = time.monotonic()
                self._last_refusal = f"{ws.worker_id}'s: {exc}"
            raise

    def _take_update(self, ws: Any, msg: Message, nbytes: int) -> None:
        b = msg.body
        rnd = self.open
        if self.phase == TRAINING and rnd is None and b["round"] == self.round:
            # A resumed master before it reopens the round: the worker keeps its update's
            # round pending and redoes it when the round is published.
            raise _RedoAnswer(f"round {self.round} is not open yet", code=errors.NOT_READY)
        self._check_after_resume(b["round"])
        if self.phase != TRAINING or rnd is None or b["round"] != rnd.number:
            raise ProtocolError(f"update for round {b['round']}, but "
                                f"{'round ' + str(self.round) if rnd else 'no round'} is open",
                                code=errors.STALE_ROUND)
        if b["version"] != self.version:
            raise ProtocolError(f"update built on model version {b['version']}, the round "
                                f"sent version {self.version}", code=errors.STALE_ROUND)
        if ws.worker_id not in rnd.participants:
            raise ProtocolError(f"{ws.worker_id} was not sampled for round {rnd.number}",
                                code=errors.NOT_SELECTED)
        if ws.worker_id in rnd.results:  # a Lazy Pirate resend: acknowledged, not recounted
            send(self.rep, M.ACK, {"round": rnd.number, "duplicate": True})
            return
        if ws.max_weight is None:  # once a registration: LDA's sums its whole vocabulary
            ws.max_weight = self.family.max_weight(ws.n_samples, ws.info)
        most = ws.max_weight
        if not 1 <= b["n_samples"] <= most:
            raise ProtocolError(f"update: n_samples must be 1-{most}, what {ws.worker_id}'s "
                                f"registration allows", code=errors.BAD_FIELD)
        metrics, dropped = M.in_range_metrics(b["metrics"], "update.metrics")
        M.check_numeric(msg.arrays, "update")
        if self.secure is not None:
            # A masked input: nothing in it can be checked but its form (master/secagg.py).
            self._same_secure_round(b)
            self.secure.take_input(ws.worker_id, msg.arrays)
            rnd.results[ws.worker_id] = ClientResult(ws.worker_id, {}, b["n_samples"])
            rnd.metrics[ws.worker_id] = {**metrics, "bytes_out": nbytes}
            _log_dropped(ws.worker_id, rnd.number, dropped)
            rnd.bytes_in += nbytes
            send(self.rep, M.ACK, {"round": rnd.number, "duplicate": False})
            return
        model = self.family.payload_for(ws.worker_id).arrays
        arrays = dict(msg.arrays)
        wanted = self.family.strategy.upload_arrays(model)
        extra = {k: arrays.pop(k) for k in list(arrays) if k.startswith(STRATEGY_ARRAY_PREFIX)}
        check_arrays(extra, wanted)  # the strategy's own (SCAFFOLD's), exactly
        arrays = decompress(str(b.get("compression", "none")), arrays, model)
        self.family.check_update(arrays)
        self.family.check_claims(arrays, b["n_samples"])
        rnd.results[ws.worker_id] = ClientResult(ws.worker_id, arrays, b["n_samples"], extra)
        rnd.distances[ws.worker_id] = (model, screening.distance(arrays, model))
        upload = (min(max(0.0, time.time() - b["sent_at"]), C.MAX_TIMING_S)
                  if isinstance(b.get("sent_at"), float) else None)
        rnd.metrics[ws.worker_id] = {**metrics, "bytes_out": nbytes,
                                     **({"upload_s": upload} if upload is not None else {})}
        _log_dropped(ws.worker_id, rnd.number, dropped)
        rnd.bytes_in += nbytes
        send(self.rep, M.ACK, {"round": rnd.number, "duplicate": False})

    def _on_report(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        M.check_report(msg.body["report"])
        report = dict(msg.body["report"])
        if report == ws.report:  # sent again (a retry whose reply was lost): kept already
            send(self.rep, M.ACK, {"round": self.round, "duplicate": True})
            return
        # Each one kept is appended to a file and logged: one member must not fill the disk.
        # One not kept is still acknowledged (kept: false): an honest worker that reports to
        # a master resumed into training, or restarts past the limit, must not fail for it.
        if (self.phase in (JOINING, TRAINING)
                or self._reports_taken[ws.worker_id] >= C.MAX_REPORTS_PER_WORKER):
            log.debug("report from %s not kept (phase %s, %d kept)", ws.worker_id, self.phase,
                      self._reports_taken[ws.worker_id])
            send(self.rep, M.ACK, {"round": self.round, "duplicate": False, "kept": False})
            return
        self._reports_taken[ws.worker_id] += 1
        ws.report = report
        log.info("final report from %s", ws.worker_id)
        # Kept at once, one line each (appended, not the whole set rewritten per report): a
        # master that dies before its end is resumed with them (the workers that sent them have
        # left, and no checkpoint follows the last round).
        try:
            with open(self.out / REPORTS_FILE, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"run_id": self.run_id, "worker": ws.worker_id,
                                     "report": ws.report}) + "\n")
        except OSError as exc:  # the report is taken all the same
            log.warning("cannot keep the report in %s: %s", self.out / REPORTS_FILE,
                        exc.strerror)
        send(self.rep, M.ACK, {"round": self.round, "duplicate": False})

    def _restore_reports(self) -> None:
        """The final reports a master that died at its end had received, on the model it
        resumes with (a report of another version scored another model)."""
        try:
            lines = read_metrics(self.out / REPORTS_FILE)  # (a line cut short is skipped)
        except OSError:
            return
        kept = {e.get("worker"): e.get("report") for e in lines  # another job's are left out
                if isinstance(e, dict) and e.get("run_id") == self.run_id}
        for wid, report in kept.items():
            ws = self.workers.get(wid)
            if ws is None or not isinstance(report, dict) or report.get("version") != \
                    self.version:
                continue
            try:
                M.check_report(report)
            except ProtocolError:
                continue
            ws.report = report
            log.info("final report from %s, kept from before the resume", wid)

    def _check_after_resume(self, round_: Any) -> None:
        """A request of a round past the one a resumed master went back to: sent to the master
        that died, the round is run again. Stale, but the resume's doing, not the worker's."""
        if (self._resumed and self.phase == TRAINING and isinstance(round_, int)
                and round_ > self.round):
            raise _RedoAnswer(f"round {round_} is from before the master resumed at round "
                              f"{self.round}: it is run again", code=errors.STALE_ROUND)

    def _on_secagg(self, msg: Message, nbytes: int) -> None:
        ws = self._worker(msg)
        if self.cfg.privacy.secure_aggregation is None:
            raise ProtocolError("this job has no secure aggregation", code=errors.REJECTED)
        if self.phase == TRAINING and self.open is None and msg.body["round"] == self.round:
            raise _RedoAnswer(f"round {self.round} is not open yet", code=errors.NOT_READY)
        self._check_after_resume(msg.body["round"])
        if self.phase in (REPORTING, DONE):
            why = self.summary.get("failed")
            raise ProtocolError(f"the job's training is over{': ' + why if why else ''}",
                                code=errors.STALE_ROUND)
        if self.secure is None or self.open is None or msg.body["round"] != self.open.number:
            raise ProtocolError(f"secagg for round {msg.body['round']}, but "
                                f"{'round ' + str(self.round) if self.open else 'no round'} "
                                f"is open", code=errors.STALE_ROUND)
        self._same_secure_round(msg.body)
        send(self.rep, M.SECAGG, self.secure.on_request(ws.worker_id, msg.body))

    def _same_secure_round(self, body: dict[str, Any]) -> None:
        """A secure round's message must name this master's round: one sent to a master since
        resumed is of a round opened again, which the worker redoes with fresh keys."""
        assert self.secure is not None
        if body.get("context") != self.secure.context:
            raise _RedoAnswer(f"round {self.secure.number} was begun again (a master or a "
                              f"worker restarted): redo it", code=errors.NOT_READY)

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
            elif self.excluded and len(self.workers) < self.cfg.min_workers:
                self._fail(f"{len(self.workers)} worker(s) left after excluding "
                           f"{', '.join(sorted(self.excluded))}, min_workers is "
                           f"{self.cfg.min_workers}")
            elif (heard := self._abandoned(now)) is not None:
                self._fail(f"{len(heard)} worker(s) heard from ({', '.join(heard) or 'none'}) "
                           f"in the last heartbeat_timeout + join_timeout "
                           f"({self.cfg.heartbeat_timeout + self.cfg.join_timeout:g}s), "
                           f"min_workers is {self.cfg.min_workers}: the job cannot go on; "
                           f"{self._resume_hint()}{self._refused_keys()}")
            else:
                self._maybe_close_round(now)
        elif self.phase == REPORTING:
            # Wait for every live worker's report (a local-only baseline may take long), not
            # for a dead one, and never past report_timeout.
            waiting = [w.worker_id for w in self.workers.values() if w.report is None]
            live = [w for w in waiting if self.roster.alive(w, now) or now < self._rejoin_until]
            if not live or now >= self._report_deadline:
                if waiting:
                    log.warning("no final report from %s%s", ", ".join(waiting),
                                "" if live else f" (no heartbeat for "
                                f"{self.cfg.heartbeat_timeout:g}s)")
                self._finish()

    def _resume_hint(self, checkpointed: bool = False) -> str:
        """How a job that cannot go on is continued, where it can be (``checkpointed``: a
        checkpoint of this round is on its way to disk)."""
        if not checkpointed and not (self.out / "checkpoint.npz").is_file():
            return ("no checkpoint has been written (checkpoint_every 0, or none was due yet), "
                    "so there is nothing to resume from")
        return "the checkpoint is kept: start the workers and `fedctl master --resume`"

    def _refused_keys(self) -> str:
        """A note on the connections CURVE refused, for lines that say no one came."""
        denied = self._auth.denied if self._auth is not None else 0
        return (f"; {denied} connection(s) refused for keys not admitted (see the warnings "
                f"above)" if denied else "")

    def _maybe_start(self, now: float) -> None:
        n = len(self.workers)
        everyone = self._expected and self._expected <= set(self.workers)
        waited = self._first_join is not None and now - self._first_join >= self.cfg.join_timeout
        if not (everyone or (not self._expected and n >= self.cfg.min_workers)
                or (waited and n >= self.cfg.min_workers)):
            if now - self._join_started >= JOIN_LOG_INTERVAL_S:  # waiting is normal; silently not
                self._join_started = now
                log.info("waiting for workers: %d registered (%s), min_workers=%d%s%s", n,
                         ", ".join(sorted(self.workers)) or "none", self.cfg.min_workers,
                         f", expecting {', '.join(sorted(self._expected - set(self.workers)))}"
                         if self._expected else "", self._refused_keys())
            return
        if not self._setup_family():
            return
        why = self.privacy.first_round_refusal(
            {w: s.n_samples for w, s in self.workers.items()}, *batching(self.family))
        if why is not None:
            self._fail(why)
            return
        n = len(self.workers)
        self.phase = TRAINING
        self.round = 1
        # What start-up built (torch, the model, the vocabulary) lives to the end: out of the
        # collector's sight, a full collection in the middle of a round takes under 1 ms, not
        # the 100-340 ms measured with it in view.
        gc.freeze()
        self._training_since = time.monotonic()
        self._cpu_mark = time.process_time()  # the set-up is not round 1's CPU
        log.info("starting with %d worker(s): %s", n, ", ".join(sorted(self.workers)))
        self._start_round(time.monotonic())  # setup() may have taken a while

    def _abandoned(self, now: float) -> list[str] | None:
        """The workers heard from lately, when they are fewer than ``min_workers`` and have
        been for ``heartbeat_timeout`` and then ``join_timeout`` more (a resumed master whose
        workers are gone; a crashed worker that leaves too few): no round could close, and
        waiting longer would be forever. None while the job can go on."""
        limit = self.cfg.heartbeat_timeout + self.cfg.join_timeout
        # Counted from the start of training at the earliest: a long setup (or a resume) held
        # this loop, not the workers. A scan of every worker at most once a second, not every
        # turn of the loop.
        if not self.workers or now - self._training_since <= limit or now < self._next_scan:
            return None
        self._next_scan = now + 1.0
        heard = sorted(w for w, s in self.workers.items()
                       if w not in self.excluded and now - s.last_seen <= limit)
        return heard if len(heard) < self.cfg.min_workers else None

    def _setup_family(self) -> bool:
        """The pre-training exchange. A registration that makes it fail (each passed
        ``check_info`` alone, but they cannot be combined: a feature size of its own, a class
        list too long in union) is found by leaving each worker out in turn; if exactly one is
        to blame it is excluded and the job goes on without it, else the job ends with the
        error. True when training can start."""
        # In worker order, not arrival order: the same registrations always give the same start.
        regs = {wid: self.workers[wid].info for wid in sorted(self.workers)}
        try:
            self.family.setup(regs)
            return True
        except Exception as exc:  # the family's own words, whatever it raised
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ProtocolError) \
                else str(exc)
        blamed = []
        for wid in sorted(regs) if len(regs) > 1 else []:
            try:
                make_server_family(self.cfg).setup({k: v for k, v in regs.items() if k != wid})
            except Exception:
                continue
            blamed.append(wid)
        if len(blamed) != 1:
            self._fail(f"the pre-training exchange failed: {error}")
            return False
        (wid,) = blamed
        self._exclude(wid, f"its registration breaks the pre-training exchange ({error})")
        self.family = make_server_family(self.cfg)  # a clean one: setup() may have left state
        if len(self.workers) < self.cfg.min_workers:
            self._fail(f"the pre-training exchange failed: {error}; without {wid}, "
                       f"{len(self.workers)} worker(s) are left, min_workers is "
                       f"{self.cfg.min_workers}")
            return False
        self.family.setup({wid: self.workers[wid].info for wid in sorted(self.workers)})
        return True

    def _exclude(self, worker_id: str, why: str) -> None:
        """Take a worker out of the job for good: its requests are refused (``excluded``)
        with ``why``, rounds no longer go to it, and the end does not wait for its report."""
        self.excluded[worker_id] = why
        self.roster.workers.pop(worker_id, None)
        self._expected.discard(worker_id)
        log.warning("excluded %s from the job: %s", worker_id, why)
        self.metrics.write("excluded", worker=worker_id, reason=why, round=self.round,
                           time=time.time())

    def _fail(self, message: str) -> None:
        """End the job cleanly without a model: one line in the log and in summary.json."""
        log.error("%s", message)
        self.metrics.write("failed", reason=message, round=self.round, time=time.time())
        self.summary = {"run_id": self.run_id, "failed": message, "rounds": self.round,
                        "refused": self._refusals(), "excluded": dict(self.excluded)}
        self.phase = DONE
        # A few announcements, and the requests meanwhile answered (a worker waiting on a
        # secure round's next stage hears it has ended rather than wait out its retries).
        for _ in range(3):
            self._announce()
            until = time.monotonic() + C.ANNOUNCE_INTERVAL / 2
            while (left := until - time.monotonic()) > 0:
                if self.rep is not None and self.rep.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self._serve_one()

    def _refusals(self) -> dict[str, dict[str, int]]:
        return {w: dict(c) for w, c in sorted(self.refused.items())}

    def _sample(self) -> list[str]:
        """This round's participants; the privacy ledger hears the rate they were drawn at."""
        self.privacy.note_workers(len(self.roster))
        return self.roster.sample()

    def _start_round(self, now: float) -> None:
        if not self.workers or (self.excluded and len(self.workers) < self.cfg.min_workers):
            # (Exclusions at a round's close: a round of no one ended the master by ValueError.)
            return self._fail(f"{len(self.workers)} worker(s) left after excluding "
                              f"{', '.join(sorted(self.excluded)) or 'none'}, min_workers is "
                              f"{self.cfg.min_workers}")
        fixed = self.family.participants()  # a step of several rounds keeps its workers
        broken = False
        if fixed is not None:
            # Less any excluded since (one that registered again mid-round): the family then
            # sees a member missing from the step and starts it again.
            kept = [w for w in fixed if w in self.workers]
            broken = kept != fixed
            fixed = kept or self._sample()
        rnd = RoundState(self.round, now, now + self.cfg.round_deadline,
                         self._sample() if fixed is None else fixed,
                         mid_step=fixed is not None, step_broken=broken)
        self.open = rnd
        if self.cfg.privacy.secure_aggregation is not None:
            self._start_secure(rnd, attempt=1)
        first = rnd.number == 1  # the setup information rides along once
        t0 = time.perf_counter()
        if self.family.per_worker:
            # Each worker's own payload is for it alone: the round is announced on PUB, which
            # every admitted key can read, and each fetches its payload over REQ, where its key
            # is checked (docs/PROTOCOL.md, "Per-worker payloads").
            body = {**self._payload_body(Payload(), first), "per_worker": True}
            rnd.broadcast_bytes = send(self.pub, M.ROUND, body, topic=M.TOPIC_ROUND)
        else:
            p = self.family.payload_for("")
            rnd.broadcast_bytes = send(self.pub, M.ROUND, self._payload_body(p, first),
                                       self._with_strategy_arrays(p.arrays),
                                       topic=M.TOPIC_ROUND)
        rnd.publish_time = time.perf_counter() - t0
        # Tell late or lossy subscribers at once that a round is open (or within
        # ANNOUNCE_MIN_GAP, where the last announcement was that recent).
        self._next_announce = min(self._next_announce,
                                  self._announced_at + C.ANNOUNCE_MIN_GAP)
        if time.monotonic() >= self._next_announce:
            self._announce()

    def _start_secure(self, rnd: RoundState, attempt: int) -> None:
        """A secure round's bookkeeping (master/secagg.py), for a first or a later attempt."""
        sa = self.cfg.privacy.secure_aggregation
        assert sa is not None
        # DP-FedAvg weighs every worker alike (a weight is its sensitivity): each sends 1.
        n_max = 1 if self.cfg.privacy.client_dp is not None else max(
            self.family.max_weight(self.workers[w].n_samples, self.workers[w].info)
            for w in rnd.participants)
        bits, clip = self.family.secure_ring(ring_bits(self.cfg.compression["kind"]))
        self.secure = SecureRound(
            sa, rnd.number, rnd.participants,
            round_context(self.run_id, self.incarnation, rnd.number, attempt),
            self.family.secure_size(), n_max, rnd.deadline,
            self.cfg.seed, attempt, bits=bits, clip=clip)

    def _leave_out_unopened(self, rnd: RoundState, owner: str, revealers: int,
                            threshold: int) -> None:
        """The next attempt goes on without a member whose secret its shares did not open:
        with it, every attempt failed the same way (a commitment to another seed did). It
        counts as silent only where more than ``threshold`` members revealed shares of it, so
        that one forged share among them could not have caused it (:meth:`SecureRound._open`
        finds the others); with fewer, its revealer or it may be the one not honest."""
        rnd.participants = [w for w in rnd.participants if w != owner]
        blamed = revealers > threshold
        log.warning("round %d: %s is left out of the next attempt: its shares did not open its "
                    "secret%s", rnd.number, owner,
                    f" ({revealers} members revealed them; counted as silent)" if blamed else
                    f" (only {revealers} members revealed them: unverified who is not honest)")
        if blamed:
            self._spoiled_attempt(owner, "its shares did not open its secret")

    def _spoiled_attempt(self, worker_id: str, what: str) -> None:
        """Count a member that spoiled a secure attempt as silent; exclude it at
        ``ABSTAIN_LIMIT``."""
        self._silent[worker_id] += 1
        if self._silent[worker_id] >= C.ABSTAIN_LIMIT and worker_id not in self.excluded:
            self._exclude(worker_id, f"{what} {self._silent[worker_id]} times, not forgiven "
                                     f"(ABSTAIN_LIMIT)")

    def _restart_secure(self, why: str) -> None:
        """Begin the open secure round again: what its workers sent is dropped (only the sum
        is ever applied, so nothing is applied twice); they see the new attempt in the
        announcements and redo the round from their snapshots."""
        rnd, sa = self.open, self.secure
        assert rnd is not None and sa is not None
        log.warning("round %d: secure aggregation begins again (attempt %d): %s", rnd.number,
                    sa.attempt + 1, why)
        self.metrics.write("secagg_restart", round=rnd.number, attempt=sa.attempt + 1,
                           reason=why, time=time.time())
        rnd.results.clear()
        rnd.metrics.clear()
        rnd.deadline = time.monotonic() + self.cfg.round_deadline
        self._start_secure(rnd, sa.attempt + 1)
        self._announce()

    def _maybe_close_round(self, now: float) -> None:
        rnd = self.open
        assert rnd is not None
        if self.secure is not None:
            # A secure round closes when its last stage does (master/secagg.py).
            sa = self.secure
            sa.advance(now, lambda w: w in self.roster and self.roster.alive(w, now))
            if sa.stage not in (SECURE_DONE, SECURE_FAILED):
                return
            for revealer, owner in sorted(sa.forged):
                # Not an exclusion: the share may be wrong as the owner dealt it.
                log.warning("round %d: the share of %s's secret that %s revealed is not on the "
                            "polynomial the other shares fix: left out (unverified: %s, %s or a "
                            "pair colluding is not honest)", rnd.number, owner, revealer,
                            revealer, owner)
                self.metrics.write("secagg_share_left_out", round=rnd.number, revealer=revealer,
                                   owner=owner, time=time.time())
            sa.forged.clear()
            live = [w for w in rnd.participants if w in self.roster
                    and self.roster.alive(w, now)]
            # A member whose input is in the sum but who, alive, kept its shares back held the
            # round up for SECAGG_STAGE_TIMEOUT, and may have left too few shares to unmask:
            # silent, as one that sent nothing, once for each attempt it spoiled.
            withheld = [w for w in sa.withheld if w in live]
            if withheld:
                log.warning("round %d: %s revealed no shares within %gs; counted as silent",
                            rnd.number, ", ".join(withheld), C.SECAGG_STAGE_TIMEOUT)
            if (sa.stage == SECURE_FAILED and sa.attempt < C.SECAGG_MAX_ATTEMPTS
                    and len(live) >= sa.threshold):
                for wid in withheld:
                    self._spoiled_attempt(wid, "revealed no shares")
                if sa.unopened is not None:
                    self._leave_out_unopened(rnd, *sa.unopened, threshold=sa.threshold)
                return self._restart_secure(str(sa.failure))
        elif not may_close(rnd, self.roster, self.cfg.min_workers, now):
            self._count_overdue(rnd, now)
            return
        else:
            withheld = []
        missing = rnd.waiting()
        if missing:
            dead = [w for w in missing if not (w in self.roster and self.roster.alive(w, now))]
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
        self._count_silence(rnd, missing + withheld)
        progress = next(iter(self.family.trained(self.version).values()))
        t0 = time.perf_counter()
        aggregated = self._aggregate(rnd)
        aggregate_time = time.perf_counter() - t0
        stepped = aggregated and next(iter(self.family.trained(self.version + 1).values())
                                      ) > progress
        if stepped:  # a step completed: one abstention of its workers' forgiven every few
            for wid in (w for w in rnd.results if self._abstained[w] > 0):
                self._steps_since_forgiven[wid] += 1
                if self._steps_since_forgiven[wid] >= C.ABSTAIN_FORGIVEN_AFTER_STEPS:
                    self._steps_since_forgiven[wid] = 0
                    self._abstained[wid] -= 1
        elif rnd.mid_step:
            # An update screened out of a later round of a step of several makes the step start
            # again, as an abstention does: counted alike, else one member's outlier every step
            # kept the job from ever stepping. (Out of a step's first round, or of a round of
            # one, the step goes on without it: leaving it out is enough.)
            for wid in sorted(rnd.left_out):
                self._abstained[wid] += 1
                if self._abstained[wid] >= C.ABSTAIN_LIMIT and wid not in self.excluded:
                    self._exclude(wid, f"its updates were left out {self._abstained[wid]} "
                                       f"times, not forgiven by steps completed (ABSTAIN_LIMIT)")
        if aggregated:  # else nothing usable came: the next round starts from the same model
            self.version += 1
        events = self._round_events(rnd, aggregate_time, missing)
        self.open = None
        secure, self.secure = self.secure, None
        # The round's events reach metrics.jsonl once a checkpoint covering it is on disk, so
        # the log never shows a round that a resumed master would run again.
        every = self.cfg.checkpoint_every
        last = (self.family.budget_spent(rnd.number) or self.family.finished()
                or self.privacy.must_stop(self.version))
        self._say_round(rnd, events[-1], missing, last)
        # Within the time budget: a 100 MB model written every round would slow every round
        # by the write's disk and memory traffic (at 25 M parameters: +200 ms a round).
        due = every and (last or (rnd.number % every == 0 and self._checkpoints.ready()))
        if every and not due and rnd.number % every == 0 and not self._budget_logged:
            self._budget_logged = True
            log.info("a checkpoint takes %.1f ms to write, and rounds come faster: skipping "
                     "rounds' checkpoints to keep writing under %g %% of the time "
                     "(checkpoint_budget)", 1000 * self._checkpoints.last_write_s,
                     100 * self.cfg.checkpoint_budget)
        ckpt = self._checkpoint(events) if due else None  # the state as this round left it
        hopeless = self._secure_hopeless(secure, now, checkpointed=ckpt is not None)
        if hopeless is not None:
            self._checkpoints.submit(ckpt, events, hold=False)
            return self._fail(hopeless)
        try:
            self._next_round(last)
        finally:
            # Handed to the writer thread only once the next round is out: its serialization
            # would otherwise hold the GIL while the main thread publishes.
            self._checkpoints.submit(ckpt, events, hold=bool(every))

    def _aggregate(self, rnd: RoundState) -> bool:
        """Screen the round's updates, aggregate, and keep the result only if it can be right
        (:mod:`master.screening`); an aggregate that cannot is undone and retried without the
        update furthest out. False when no update is left to aggregate."""
        if self.secure is not None:
            return self._aggregate_secure(rnd)
        dist = {}
        for w, r in rnd.results.items():
            base = self.family.payload_for(w).arrays
            taken = rnd.distances.get(w)
            # (the model it was measured from may have been replaced since: a family's step
            # that moved on, a payload composed again)
            dist[w] = (taken[1] if taken is not None and _same_arrays(taken[0], base)
                       else screening.distance(r.arrays, base))
        counted = ({w: d for w, d in dist.items() if not self.family.abstained(rnd.results[w])}
                   if self.family.distance_screened else {})
        forms = {w: screening.form_of(r.arrays) for w, r in rnd.results.items()}
        for wid, why in self._distances.outliers(counted, forms).items():
            self._leave_out(rnd, wid, why)
        # A strategy's own uploads (SCAFFOLD's control changes) build state the master keeps
        # and sends on: screened the same way, by their norms.
        extra = {w: screening.norm(r.extra) for w, r in rnd.results.items() if r.extra}
        for wid, why in screening.outliers(extra).items():
            self._leave_out(rnd, wid, f"its strategy arrays: {why}")
        while rnd.results:
            results = screening.cap_weights(rnd.ordered_results(), self.cfg.max_weight_fraction)
            before, back = self.family.global_, self.family.savepoint()
            try:
                after = self.family.aggregate(rnd.number, results).arrays
                problem = self._growth.problem(before.arrays, after)
                if problem is None and extra:  # state built from the members' own arrays
                    problem = screening.state_problem(self.family.strategy.state())
            except Exception as exc:  # the family's arithmetic failed on these updates
                log.debug("aggregation failed", exc_info=True)
                problem = f"aggregation failed ({type(exc).__name__}: {exc})"
            if problem is None:
                self._growth.published()
                self._distances.aggregated(
                    {w: d for w, d in counted.items() if w in rnd.results}, forms)
                return True
            back()  # undone: the published model, the strategy's moments, the family's own
            worst = max(rnd.results, key=lambda w: (dist[w] + extra.get(w, 0.0), w))
            self._leave_out(rnd, worst, f"{problem}; left out as the update furthest out")
        log.warning("round %d: no update to aggregate: the model stays as it was", rnd.number)
        return False

    def _secure_hopeless(self, sa: SecureRound | None, now: float,
                         checkpointed: bool = False) -> str | None:
        """Why the job must end after a secure round: it failed with fewer live workers than
        its threshold, so that no later round could succeed either; or the last
        SECAGG_MAX_REFUSED_SUMS sums could not be applied. None otherwise."""
        if sa is None:
            return None
        if len(self._refused_sums) >= C.SECAGG_MAX_REFUSED_SUMS:
            return (f"the last {len(self._refused_sums)} secure sums could not be applied (the "
                    f"last: {self._refused_sums[-1][1]}): a member's update cannot be left out of "
                    f"a sum; the job cannot go on (run without secure aggregation to find whose "
                    f"updates are refused)")
        if sa.stage != SECURE_FAILED:
            return None
        live = sorted(w for w in self.workers if w not in self.excluded
                      and self.roster.alive(w, now))
        if len(live) >= sa.threshold:
            return None
        return (f"secure aggregation needs {sa.threshold} workers a round (its threshold) and "
                f"{len(live)} are alive ({', '.join(live) or 'none'}): the job cannot go on; "
                f"{self._resume_hint(checkpointed)}")

    def _aggregate_secure(self, rnd: RoundState) -> bool:
        """Fold the round's secure sum in: the strategy gets one result, the weighted average
        of the survivors' models, since that is all the master knows. No update can be
        screened; the aggregate is still checked. False when the round failed."""
        sa = self.secure
        assert sa is not None
        if sa.stage == SECURE_FAILED or sa.sum_ is None:
            log.error("round %d: secure aggregation failed: %s; nothing of the round is "
                      "applied, the model stays as it was", rnd.number, sa.failure)
            self.metrics.write("secagg_failed", round=rnd.number, reason=sa.failure,
                               time=time.time())
            return False
        survivors = sa.u3
        before, back = self.family.global_, self.family.savepoint()
        # Each member weighs its input by its declared documents over n_max (DP-FedAvg: 1
        # over 1), in the clear in its update: the sum's weights must come to as much.
        sent = (float(len(survivors)) if self.cfg.privacy.client_dp is not None
                else sum(rnd.results[w].n_samples for w in survivors) / sa.n_max)
        size: float | None = None
        kind = (sa.sum_.size, self.family.secure_kind())  # refusals are counted by kind
        abstained = tuple(w for w in survivors if _abstains(rnd, w))
        try:
            arrays = self.family.secure_result(sa.sum_, sa.n_max, len(survivors), sent,
                                               2 * sa.error_bound() / sa.clip + 1e-9)
            size = self.family.secure_distance(arrays)
            if size is not None:
                form = screening.form_of(arrays)
                if why := self._distances.sum_problem(form, size):
                    raise ValueError(why)
            self.family.check_update(arrays)
            result = ClientResult("secure-sum", arrays,
                                  sum(rnd.results[w].n_samples for w in survivors),
                                  members=tuple(survivors), abstained=abstained)
            copies = len(survivors) if self.family.strategy.sums_updates else 1
            after = self.family.aggregate(rnd.number, [result] * copies).arrays
            problem = self._growth.problem(before.arrays, after)
        except Exception as exc:
            log.debug("secure aggregation failed", exc_info=True)
            problem = f"aggregation failed ({type(exc).__name__}: {exc})"
        if problem is not None:
            back()
            log.warning("round %d: the secure sum cannot be applied: %s; the model stays as "
                        "it was", rnd.number, problem)
            self._refused_sums.append((kind, problem))
            self.family.secure_refused()
            return False
        # A sum of another kind applied does not end the streak: a synchronized step's
        # first phases passed while its gradients' sum was refused at every redo.
        self._refused_sums = [(k, why) for k, why in self._refused_sums if k != kind]
        # (not a sum some members sat out: their zeros would lower the floor; a member that
        # always abstains keeps it unset, and is excluded at ABSTAIN_LIMIT)
        if size is not None and not abstained:
            self._distances.sum_aggregated(form, size)
        self._growth.published()
        self.metrics.write("secagg", round=rnd.number, survivors=survivors,
                           dropped=sorted(set(sa.u2) - set(survivors)),
                           threshold=sa.threshold, error_bound=sa.error_bound(),
                           time=time.time())
        return True

    def _leave_out(self, rnd: RoundState, worker_id: str, why: str) -> None:
        rnd.left_out.add(worker_id)
        rnd.results.pop(worker_id, None)
        rnd.metrics.pop(worker_id, None)
        self.refused[worker_id][errors.OUTLIER] += 1
        log.warning("round %d: the update of %s is left out: %s", rnd.number, worker_id, why)
        self.metrics.write("left_out", round=rnd.number, worker=worker_id, reason=why,
                           time=time.time())

    def _count_overdue(self, rnd: RoundState, now: float) -> None:
        """A round that cannot close (it needs the update of a participant alive and silent)
        counts that participant silent at its deadline and again each ``round_deadline``
        after, and leaves it out of the round once it is excluded: one alive but never
        uploading held such a round open for ever, and nothing counted its silence, which
        only a closing round did."""
        if now < rnd.deadline:
            return
        periods = 1 + int((now - rnd.deadline) // self.cfg.round_deadline)
        if periods <= rnd.overdue_periods:
            return
        rnd.overdue_periods = periods
        for wid in rnd.waiting():
            if wid in self.excluded or wid not in self.roster or not self.roster.alive(wid, now):
                continue
            rnd.overdue.add(wid)
            self._silent[wid] += 1
            if self._silent[wid] >= C.ABSTAIN_LIMIT:
                self._exclude(wid, f"sent nothing usable in {self._silent[wid]} rounds or "
                                   f"deadlines, not forgiven by rounds answered (ABSTAIN_LIMIT)")
        # (out of the round: it closes with the others once min_workers counts without it)
        rnd.participants = [w for w in rnd.participants if w not in self.excluded]

    def _count_silence(self, rnd: RoundState, missing: list[str]) -> None:
        """A participant alive but silent ``ABSTAIN_LIMIT`` rounds in a row, or that abstains
        that many times with no step completed in between, is excluded: a step of several
        rounds would otherwise restart forever for its sake."""
        now = time.monotonic()
        silent = [w for w in missing if w in self.roster and self.roster.alive(w, now)]
        for wid in rnd.participants:
            if wid in silent:
                if wid not in rnd.overdue:  # (counted already while the round waited)
                    self._silent[wid] += 1
            elif self._silent[wid] > 0:
                self._rounds_since_forgiven[wid] += 1
                if self._rounds_since_forgiven[wid] >= C.SILENCE_FORGIVEN_AFTER_ROUNDS:
                    self._rounds_since_forgiven[wid] = 0
                    self._silent[wid] -= 1
        for wid, r in rnd.results.items():
            # (a round of a step one of whose members was excluded: the rest, or workers drawn
            # anew, may hold nothing of it, and abstain for no fault of theirs)
            if (self.family.abstained(r) or _abstains(rnd, wid)) and not rnd.step_broken:
                self._abstained[wid] += 1
        for wid in sorted(set(self._silent) | set(self._abstained)):
            if wid in self.excluded:
                continue
            if self._silent[wid] >= C.ABSTAIN_LIMIT:
                self._exclude(wid, f"sent nothing usable in {self._silent[wid]} rounds, not "
                                   f"forgiven by rounds answered (ABSTAIN_LIMIT)")
            elif self._abstained[wid] >= C.ABSTAIN_LIMIT:
                self._exclude(wid, f"abstained {self._abstained[wid]} times, not forgiven by "
                                   f"steps completed (ABSTAIN_LIMIT)")

    def _next_round(self, last: bool) -> None:
        # Its first round closed, a resumed master's workers all follow it: a request of a
        # round ahead of it is a worker's doing again, and counted.
        self._resumed = False
        if last:
            self.phase = REPORTING
            self._report_deadline = time.monotonic() + self.cfg.report_timeout
            self._training_over()
            send(self.pub, M.SHUTDOWN, {"run_id": self.run_id, "version": self.version},
                 topic=M.TOPIC_SHUTDOWN)
            self._announce()
            log.info("training done after %d round(s); collecting final reports", self.round)
        else:
            self.round += 1
            self._start_round(time.monotonic())

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, events: list[dict[str, Any]]) -> Checkpoint:
        return capture(self.family, {
            "events": events, "run_id": self.run_id, "round": self.round,
            "version": self.version, "registrations": self.roster.registrations(),
            "rng_state": self.roster.rng.bit_generator.state, "family": self.cfg.family,
            "strategy": self.family.strategy.name, "terms": self._terms,
            "data_terms": self._data_terms,
            # What summary.json tells of the members, which a resume must not forget (and an
            # excluded worker must stay excluded).
            "excluded": dict(self.excluded), "refused": self._refusals(),
            "errors_served": self.errors_served,
            # The counts that exclude a member (ABSTAIN_LIMIT): a resumed master that began
            # them at zero gave a member silent or abstaining up to its limit a new allowance.
            "misconduct": {"silent": dict(self._silent), "abstained": dict(self._abstained),
                           "steps_since_forgiven": dict(self._steps_since_forgiven),
                           "rounds_since_forgiven": dict(self._rounds_since_forgiven)},
            "client_rate": self.privacy.client_rate_,
            "growth": self._growth.state(), "distances": self._distances.state(),
            "resume_base": self.family.resume_base(self.round + 1)})

    def _restore(self, ckpt: Checkpoint) -> None:
        # A checkpoint someone else wrote: its model must be numbers, all finite, or the
        # resumed master would publish (and save) what no worker can train.
        for name, a in ckpt.global_arrays.items():
            if a.dtype.kind not in "fiub" or (a.dtype.kind == "f" and not all_finite(a)):
                raise ValueError(f"model array {name!r} holds "
                                 f"{'NaN or infinity' if a.dtype.kind == 'f' else a.dtype}")
        restore(ckpt, self.family)
        m = ckpt.meta
        if "terms" in m:  # (checkpoints written before the terms were kept: not compared)
            differences = job_differences(self.cfg, self.family, m["terms"],
                                          there="in the checkpoint", here="in the config")
            if differences:  # the run would go on under one model and be saved as another
                raise RuntimeError(f"--resume: the checkpoint's job is not {self.cfg.source}'s: "
                                   f"{listed(differences)}")
        kept = m.get("data_terms") or {}
        # (a term an older checkpoint did not keep is not compared)
        changed = [f"{'' if k == 'workers' else 'data.'}{k}: {_short(kept[k])} in the "
                   f"checkpoint, {_short(v)} in the config"
                   for k, v in self._data_terms.items() if k in kept and kept[k] != v
                   # (a file not on this node has no size to compare: a master that never
                   # reads it, baselines off)
                   and not (k == "bytes" and None in (v, kept[k]))]
        if changed:  # its baselines would be cut from other data than the workers trained on,
            # and with another worker list each worker's share is other documents
            raise RuntimeError(f"--resume: the checkpoint's data is not {self.cfg.source}'s: "
                               f"{listed(changed)}")
        self.run_id = m["run_id"]
        self.version = int(m["version"])
        self.roster.restore(m["registrations"], m["rng_state"])
        # The highest rate rounds drew workers at so far, and the roster's own: a master
        # resumed into its final reports draws no more, and stated ε at client_fraction's.
        if m.get("client_rate") is not None:
            self.privacy.note_rate(float(m["client_rate"]))
        self.privacy.note_workers(len(self.roster))
        self.excluded = {str(w): str(why) for w, why in (m.get("excluded") or {}).items()}
        self._expected -= set(self.excluded)
        for w, counts in (m.get("refused") or {}).items():
            self.refused[w].update(counts)
        self.errors_served = int(m.get("errors_served", 0))
        counts = m.get("misconduct") or {}  # (checkpoints before they were kept: none)
        for attr, key in (("_silent", "silent"), ("_abstained", "abstained"),
                          ("_steps_since_forgiven", "steps_since_forgiven"),
                          ("_rounds_since_forgiven", "rounds_since_forgiven")):
            setattr(self, attr, Counter({str(w): int(n) for w, n in
                                         (counts.get(key) or {}).items()}))
        self._growth.restore(m.get("growth") or [])  # (older checkpoints: empty windows)
        self._distances.restore(m.get("distances") or [])
        now = time.monotonic()
        done = int(m["round"])
        # Rounds past the checkpoint that a master stopped before its next checkpoint logged
        # (its writer logs what it holds on the way out, rather than lose it): they are run
        # again now, and would be in the log twice.
        again = self.metrics.drop(lambda e: e.get("event") in ("round", "worker_round")
                                  and isinstance(e.get("round"), int) and e["round"] > done)
        if again:
            log.info("metrics.jsonl: %d event(s) of rounds after %d removed; those rounds are "
                     "run again", again, done)
        # The last round's events, if the master died between its checkpoint and its log line.
        logged = {(e.get("event"), e.get("round"), e.get("worker"))
                  for e in read_metrics(self.out / "metrics.jsonl")}
        for e in m.get("events", []):
            if (e["event"], e.get("round"), e.get("worker")) not in logged:
                self.metrics.write_record(e)
        self._resume_at = now + C.RESUME_GRACE
        self._resumed = True
        self._training_since = now
        self._checkpoints.written_base = m.get("resume_base")
        if self.family.budget_spent(done) or self.family.finished():
            self.round, self.phase = done, REPORTING
            self._report_deadline = now + self.cfg.report_timeout
            # The workers restart by hand after it: each has join_timeout to come back.
            self._rejoin_until = now + self.cfg.join_timeout
            self._restore_reports()
            self._training_over()
        else:
            self.round, self.phase = done + 1, TRAINING
        self.metrics.write("resume", run_id=self.run_id, completed_round=done,
                           version=self.version, time=time.time())
        gc.freeze()  # as at a first start (see _maybe_start)
        self._cpu_mark = time.process_time()
        log.info("resumed job %s after round %d (model version %d)", self.run_id, done,
                 self.version)
        if self.phase == REPORTING:
            owed = sorted(w for w, ws in self.workers.items() if ws.report is None)
            if owed:
                log.info("training was over: waiting up to join_timeout (%gs) for the final "
                         "reports of %s (start them: `fedctl worker --id <w>`)",
                         self.cfg.join_timeout, ", ".join(owed))

    def _round_events(self, rnd: RoundState, aggregate_time: float, missing: list[str]
                      ) -> list[dict[str, Any]]:
        """The round's metrics events (written with its checkpoint), its privacy spent
        recorded."""
        events = round_events(rnd, self.version, aggregate_time, missing)
        r = events[-1]
        # This process's CPU since the last round closed, every thread (ZeroMQ's, the
        # checkpoint writer's): with the workers' own cpu_s, what a round costs the machine.
        cpu = time.process_time()
        r["cpu_s"], self._cpu_mark = cpu - self._cpu_mark, cpu
        sizes = None
        if self.cfg.privacy.dp_sgd is not None:  # (only DP-SGD's claims are bounded by them)
            sizes = {w: (self.workers[w].n_samples, *batching(self.family))
                     for w in rnd.metrics if w in self.workers}
        r.update(self.privacy.record(rnd.metrics, self.version, sizes))
        return events

    def _say_round(self, rnd: RoundState, r: Mapping[str, Any], missing: list[str],
                   last: bool) -> None:
        """The round's line in the log: paced (RoundLines), but always the last round's and
        one whose missing workers changed."""
        changed = set(missing) != self._missing_said
        self._missing_said = set(missing)
        # A synchronous family's redone steps take rounds past the planned number.
        of = (f"/{self.cfg.rounds}" if rnd.number <= self.cfg.rounds
              else f" ({self.cfg.rounds} planned, more for redone steps)")
        # Scoring can outlast training by far (NMF of 500 topics: 90 s against 1.5): said, or
        # it read as the framework's overhead.
        scoring = r["slowest_compute_s"] - r["slowest_train_s"]
        log.log(self._round_lines.level(matters=last or changed),
                "round %d%s: %d update(s) in %.3fs (slowest training %.3fs, overhead "
                "%.1f ms%s)%s", rnd.number, of, len(rnd.results), r["duration_s"],
                r["slowest_train_s"], 1000 * r["overhead_s"],
                f", of which the workers' scoring {scoring:.3f}s"
                if scoring > max(1.0, r["slowest_train_s"]) else "",
                f", global macro-F1 at round start {r['mean_macro_f1']:.3f}"
                if r["mean_macro_f1"] is not None else "")

    def _training_over(self) -> None:
        """The model written as soon as training is over: the reports and baselines after it
        may take minutes, and a job stopped meanwhile kept nothing of what it trained."""
        self._checkpoints.flush()  # the last round's events before this one
        write_model(self.out, self.family, self.cfg, self.round, self.version, self.run_id)
        self._model_written = self.version
        self.metrics.write("training_done", rounds=self.round, version=self.version,
                           time=time.time())

    def _finish(self) -> None:
        self._checkpoints.flush()  # every round's events are in the log before the summary
        if self._model_written != self.version:  # (a 100 MB model once, not twice)
            write_model(self.out, self.family, self.cfg, self.round, self.version,
                        self.run_id)
        trained = self.family.trained(self.version)
        unit, count = next(iter(trained.items()))
        unusable = self.family.model_problem() if count else None
        laplace = laplace_epsilon(self.cfg.family, self.cfg.family_params)
        self.summary, table = write_results(
            self.out, self.family, {w: s.report for w, s in self.workers.items()},
            self.cfg.baselines,
            {"run_id": self.run_id, "rounds": self.round, "version": self.version,
             "workers": sorted(self.workers), "trained": trained,
             # the run "completed" but changed nothing: not a success, for `fedctl runs` too
             **({"failed": f"nothing was trained: 0 {unit} in {self.round} round(s)"
                           + (f"; the last update refused was {self._last_refusal}"
                              if self._last_refusal else "")}
                if count == 0 else {"failed": unusable} if unusable else {}),
             "refused": self._refusals(), "excluded": dict(self.excluded),
             **({"privacy": self.privacy.summary(self.version)}
                if self.cfg.privacy.any else {}),
             **({"laplace_epsilon": laplace} if laplace else {})},
            self.errors_served)
        self.metrics.write("done", rounds=self.round, version=self.version, time=time.time())
        note = self.out / C.FAILED_NOTE
        if count and not unusable and note.is_file():  # resumed to its end: not failed
            note.unlink()
            log.info("%s: removed; this run failed once and was resumed to its end", note)
        final = self.out.name.removesuffix(C.STAGING_SUFFIX)
        log.info("results in %s%s\n%s", self.out.with_name(final), "" if final == self.out.name
                 else f" (this run's folder once `fedctl run` has seen every process end; "
                 f"{self.out.name} until then)", table)
        self.phase = DONE
        # A last few announcements so workers still listening learn the job is over.
        for _ in range(3):
            self._announce()
            time.sleep(C.ANNOUNCE_INTERVAL / 2)

