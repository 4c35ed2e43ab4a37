"""The worker: hold the documents, listen on SUB, train locally, report over REQ.

Join (the slow-joiner handshake): subscribe, wait for the master's announcement, and only then
register over REQ, so the first round's broadcast cannot be lost to a SUB still connecting.

Each round arrives on PUB. A broadcast can still be missed (a high-water mark, a late join, a
restart), so the periodic announcement doubles as a beacon: a worker that sees an announcement
for a round it has not received fetches the model over REQ instead.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import math
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from common import constants as C
from common.aggregate import all_finite
from common.config import ClusterConfig, ConfigError, job_terms, share_terms
from common.constants import STRATEGY_ARRAY_PREFIX
from common.data.embedding import resolve_device
from common.data.shards import local_data, worker_seed
from common.models.numerics import flush_denormals
from common.net import errors
from common.net import messages as M
from common.net.compression import Compressor
from common.net.security import HandshakeWatch, SecurityError, client_keys
from common.net.transport import (
    LazyPirateClient,
    PeerUnreachable,
    RemoteError,
    SocketSetup,
    connect_sub,
    recv,
)
from common.net.wire import Message, ProtocolError
from common.privacy.dp import clip_update
from common.runlog import RoundLines
from worker import devices
from worker.families import ClientFamily, make_client_family
from worker.secagg import SecAggError, SecureUpload
from worker.snapshots import Snapshots, find_run_snapshots

log = logging.getLogger("fedctl.worker")

WAITING_LOG_INTERVAL_S = 10.0  # how often a worker waiting for its master says so
BUSY_RETRIES = 10  # a request refused as too frequent is sent again this many times...
BUSY_WAIT_S = 1.0  # ...this long apart (a registration may come once every REGISTER_INTERVAL)


class Heartbeat(threading.Thread):
    """Pings the master every ``HEARTBEAT_INTERVAL`` from its own REQ socket, so the master
    knows this worker is alive even while a long local update holds the main loop.

    A master that answers ``unknown_worker`` has lost this worker (it was restarted from a
    checkpoint, or dropped it): ``lost`` is set and the main loop registers again.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: str,
                 setup: SocketSetup | None, process: str) -> None:
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self.process = process
        self.client = LazyPirateClient(ctx, endpoint, timeout=C.HEARTBEAT_INTERVAL, retries=1,
                                       setup=setup)
        self.worker_id = worker_id
        self.lost = threading.Event()
        self.stopped = threading.Event()
        self.excluded: RemoteError | None = None  # the master took this worker out of the job

    def run(self) -> None:
        try:
            while not self.stopped.wait(C.HEARTBEAT_INTERVAL):
                try:
                    self.client.request(M.PING, {"worker_id": self.worker_id,
                                                 "process": self.process})
                except RemoteError as exc:
                    if exc.code == errors.UNKNOWN_WORKER:
                        self.lost.set()
                    elif exc.code in (errors.EXCLUDED, errors.IDENTITY, errors.REPLACED):
                        self.excluded = exc
                        return
                except PeerUnreachable:
                    pass  # the master may be restarting; the main loop decides when to give up
        finally:
            self.client.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=2 * C.HEARTBEAT_INTERVAL)


class JobFailed(RuntimeError):
    """The master ended the job without a model (its reason follows): this worker exits with
    :data:`JOB_FAILED_EXIT`, which a supervisor does not restart it for (it would only wait
    for a job that is over)."""


#: The exit status of a worker whose job failed at the master (systemd: RestartPreventExitStatus).
JOB_FAILED_EXIT = 3


def request_attempts(join_timeout: float) -> int:
    """Attempts of a worker's request (each waits REQUEST_TIMEOUT or more for its reply):
    enough to wait ``join_timeout`` for a master that went away."""
    return max(C.REQUEST_RETRIES, math.ceil(join_timeout / C.REQUEST_TIMEOUT))


class Worker:
    """One worker of the job described by ``cfg``.

    Parameters
    ----------
    cfg : ClusterConfig
    worker_id : str
        This worker's name (one of ``cfg.workers`` unless it brings its own data).
    data_path : str, optional
        A JSONL file of this worker's own documents; by default its share of ``cfg.data``.
    device : str, optional
        ``auto`` (CUDA when available), ``cpu``, ``cuda``...; default from the config.
    ctx : zmq.Context, optional
    state_dir : path, optional
        Where this worker keeps its snapshots (:mod:`worker.snapshots`); by default
        :func:`default_state_dir`. Unused with ``worker_snapshots: false``.
    """

    def __init__(self, cfg: ClusterConfig, worker_id: str, data_path: str | None = None,
                 device: str | None = None, ctx: zmq.Context | None = None,
                 state_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.ctx = ctx or zmq.Context.instance()
        if device is None:
            known = {w.name: w for w in cfg.workers}
            device = known[worker_id].device if worker_id in known else "auto"
        self.device = resolve_device(device)
        self.data = local_data(cfg, worker_id, data_path)
        self._own_state_dir = Path(state_dir or default_state_dir(cfg, worker_id))
        self.snapshots = (Snapshots(self._own_state_dir, worker_id)
                          if cfg.worker_snapshots else None)
        # In a history (runs/latest, or a run folder beside its latest link) with no folder
        # named: the history, where the run's snapshots may be in another run's folder (a run
        # `fedctl run` started keeps them in its own) or in runs/workers/.
        out = Path(cfg.output_dir)
        self._history = (out.parent if state_dir is None and (
            out.name == "latest" or (out.parent / "latest").is_symlink()) else None)
        self.run_id: str | None = None
        # This process's own token, in every request: the master tells two processes started
        # with one id apart (the earlier one is refused, `replaced`).
        self.process = secrets.token_hex(6)
        self._new_job()
        self.incarnation: str | None = None
        self.sub: zmq.Socket | None = None
        self.req: LazyPirateClient | None = None
        self.heartbeat: Heartbeat | None = None
        self._last_upload = time.monotonic()
        self._cpu_mark = time.process_time()  # CPU (all threads) at the last upload
        self._received_at = time.time()
        self._sub_bytes = 0
        self._sub_setup = None
        self._subscribed_at = 0.0
        self._clip_warned = False
        #: Why this worker's updates are refused when its training diverged, else None.
        self.diverged_: str | None = None
        self._round_lines = RoundLines()  # a line a round, paced (millisecond rounds)

    def _new_job(self) -> None:
        """What this worker holds of one job, as it is before the job's first round."""
        seed = worker_seed(self.cfg, self.worker_id)
        torch.manual_seed(seed)
        self.family: ClientFamily = make_client_family(self.cfg, self.data, self.device, seed)
        # A secure round's compression is its ring's width (common/secagg/ring.py): the update
        # itself goes into the masked input uncompressed.
        kind = (self.cfg.compression["kind"] if self.family.compressible
                and self.cfg.privacy.secure_aggregation is None else "none")
        self.compressor = Compressor(kind, self.cfg.compression.get("fraction", 0.01))
        self.state_round = 0  # the round the family's state is the state after
        self.ready = False  # set up by the pre-training exchange
        self.last_round = 0  # the last round this worker uploaded (or gave up on)
        self._trained = 0  # rounds trained: the device check counts these, not global rounds
        self._secure_done: dict[int, int] = {}  # round -> the secure attempt last done
        self._stash: collections.deque[Message] = collections.deque()

    def _request(self, kind: str, body: dict[str, Any], arrays: dict | None = None) -> Message:
        assert self.req is not None
        for attempt in range(BUSY_RETRIES):
            try:
                return self.req.request(kind, {"worker_id": self.worker_id,
                                               "process": self.process, **body}, arrays)
            except RemoteError as exc:
                # Refused for sending too often (fair service): wait, then try again.
                if exc.code != errors.BUSY or attempt == BUSY_RETRIES - 1:
                    raise
                time.sleep(BUSY_WAIT_S)
        raise AssertionError("unreachable")

    def run(self) -> dict[str, Any]:
        """Join, train every round, send the final report; returns that report."""
        flush_denormals()  # in the thread that trains (common/models/numerics.py says why)
        m = self.cfg.master
        setup = None
        # the first subscription's handshakes: refused keys, or security on one side only,
        # fail at once
        watch = HandshakeWatch(self.cfg.security.keys_dir if self.cfg.security.curve else None,
                               self.worker_id)
        self._sub_setup = watch
        if self.cfg.security.curve:
            setup = client_keys(self.cfg.security.keys_dir, self.worker_id).setup
            self._sub_setup = lambda sock: (setup(sock), watch(sock))
        self._subscribe()
        self._sub_setup = setup
        # A request goes on being retried for join_timeout: a master that died while this
        # worker uploaded may be resumed within it, as the README says (it gave up after
        # REQUEST_RETRIES attempts, 50 s, whatever join_timeout said).
        self.req = LazyPirateClient(self.ctx, m.rep_endpoint, setup=setup,
                                    retries=request_attempts(self.cfg.join_timeout))
        self.heartbeat = Heartbeat(self.ctx, m.rep_endpoint, self.worker_id, setup,
                                   self.process)
        try:
            try:
                first = self._wait_announce(self.cfg.join_timeout, watch)
            finally:
                watch.close()
            self._register(first)
            self.heartbeat.start()
            return self._loop()
        finally:
            if self.heartbeat.is_alive():
                self.heartbeat.stop()
            self.req.close()
            self.sub.close(linger=0)

    def _subscribe(self) -> None:
        """(Re)open the subscription to the master's PUB socket."""
        if self.sub is not None:
            self.sub.close(linger=0)
        self.sub = connect_sub(self.ctx, self.cfg.master.pub_endpoint,
                               [M.TOPIC_ANNOUNCE, M.TOPIC_ROUND, M.TOPIC_SHUTDOWN],
                               setup=self._sub_setup)
        self._subscribed_at = time.monotonic()

    def _wait_announce(self, timeout: float, watch: HandshakeWatch | None = None) -> Message:
        start = time.monotonic()
        deadline, said = start + timeout, start
        while time.monotonic() < deadline:
            msg = self._recv_sub(200)
            if msg is not None and msg.kind == M.ANNOUNCE:
                return msg
            if time.monotonic() - said >= WAITING_LOG_INTERVAL_S:  # not silent for minutes
                said = time.monotonic()
                log.info("waiting for the master at %s: %.0fs of join_timeout (%gs)",
                         self.cfg.master.pub_endpoint, said - start, timeout)
            refusal = watch.refusal() if watch is not None else None
            if refusal is not None:
                raise SecurityError(f"{self.cfg.master.pub_endpoint}: {refusal}")
        raise TimeoutError(f"no announcement from the master at {self.cfg.master.pub_endpoint} "
                           f"within {timeout:g}s: is it running, and is the port reachable?")

    def _recv_sub(self, timeout_ms: int) -> Message | None:
        if self._stash:  # what arrived while a secure round waited for its stage
            return self._stash.popleft()
        return self._receive(timeout_ms)

    def _receive(self, timeout_ms: int) -> Message | None:
        assert self.sub is not None
        if not self.sub.poll(timeout_ms, zmq.POLLIN):
            return None
        try:
            msg, nbytes = recv(self.sub)
        except ProtocolError as exc:
            log.warning("ignored a malformed broadcast: %s", exc)
            return None
        self._sub_bytes += nbytes
        self._received_at = time.time()
        return msg

    def _register(self, announce: Message) -> None:
        theirs = announce.body.get("family")
        if isinstance(theirs, str) and theirs != self.family.name:
            # Two jobs on one pair of ports, or a worker given another job's master: its
            # registration (class lists, a vocabulary) would tell that master about its
            # documents, and be refused field by field. (The families' own names: a plug-in
            # named by its entry point on one node and by module:Name on another is one family.)
            raise ConfigError(f"the master at {self.cfg.master.pub_endpoint} runs a "
                              f"{theirs[:64]} job, and {self.cfg.source} says model.family "
                              f"{self.cfg.family}: is another job's master on these ports? "
                              f"(nothing was sent)")
        info = self.family.registration_info()
        job = job_terms(self.cfg)
        if self.data.shared:  # how the shares are cut, lest it train on other documents
            job["data"] |= share_terms(self.cfg)
        reply = self._request(M.REGISTER, {"n_samples": self.family.n_samples,
                                           "device": self.device, "info": info, "job": job})
        run_id = reply.body.get("run_id")
        if self.run_id is not None and run_id is not None and run_id != self.run_id:
            # The master was started again without --resume: a new job, whose round 1 comes
            # after this worker's old rounds (it used to wait for ever for a round past them).
            # What was registered (its documents' sizes, classes, words) holds for it too.
            log.warning("the master runs a new job (%s; this worker was in %s): starting over",
                        run_id, self.run_id)
            self._new_job()
        self.run_id = run_id
        self.incarnation = reply.body.get("incarnation")
        rounds = reply.body.get("rounds")
        if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds != self.cfg.rounds:
            # The job's length is the master's (--rounds given to it alone); a local-only
            # baseline trained for this config's count compared unlike with like.
            if 0 < rounds <= C.MAX_ROUNDS:
                log.info("the master's job has %d rounds (%s says %d): this worker follows it",
                         rounds, self.cfg.source, self.cfg.rounds)
                self.cfg.rounds = rounds
            else:
                log.warning("the master's welcome says %d rounds: not believable, this worker "
                            "keeps %s's %d", rounds, self.cfg.source, self.cfg.rounds)
        if self.snapshots is not None and self.run_id is not None:
            run_id = str(self.run_id)
            if self._history is not None and not self.snapshots.holds(run_id):
                # A resumed run: its snapshots may be elsewhere in the history; else (a new
                # job) this worker's own folder, not one found for an earlier job.
                found = find_run_snapshots(self._history, self.worker_id, run_id)
                folder = found if found is not None else self._own_state_dir
                if folder != self.snapshots.folder:
                    if found is not None:
                        log.info("%s: its snapshots of run %s are in %s", self.worker_id,
                                 run_id, found)
                    self.snapshots = Snapshots(folder, self.worker_id)
            self.snapshots.adopt(run_id)
        log.info("%s registered with master %s (%d training, %d test documents, %s)",
                 self.worker_id, self.run_id, self.data.n_train, len(self.data.test_index),
                 self.device)
        if "setup" in reply.body and not self.ready:  # joined after the pre-training exchange
            self._setup(reply.body["setup"])
        # A worker that joins mid-job starts with the round that is open now.
        if reply.body.get("phase") == M.TRAINING:
            self.last_round = int(reply.body.get("round", 1)) - 1

    def _setup(self, setup: dict[str, Any]) -> None:
        self.family.setup(setup)
        self.ready = True
        if self.snapshots is not None:
            rounds = self.snapshots.rounds()
            if rounds:  # a restart: carry on from where this worker was
                self._load_state(self.snapshots.load(rounds[-1]))
                self.state_round = rounds[-1]
                log.info("%s: back to its own state after round %d (%s)", self.worker_id,
                         rounds[-1], self.snapshots.folder)
            else:
                self.snapshots.save(0, self._state())
        gc.freeze()  # start-up's objects out of the collector's sight (see Master._maybe_start)
        self._cpu_mark = time.process_time()  # the set-up is not round 1's CPU

    def _loop(self) -> dict[str, Any]:
        silent_since = last_poll = time.monotonic()
        while True:
            msg = self._recv_sub(200)
            now = time.monotonic()
            if now - last_poll > 5.0:  # this process was paused (or busy): not the master's fault
                silent_since = now
            last_poll = now
            if msg is None:
                if now - silent_since > self.cfg.join_timeout:
                    raise TimeoutError(f"the master has been silent for "
                                       f"{self.cfg.join_timeout:g}s")
                if min(now - silent_since, now - self._subscribed_at) > \
                        C.SUB_SILENCE_RESUBSCRIBE:
                    # The announcements stopped: the master is down, or this end of the
                    # connection is gone (a new address); a new subscription finds out.
                    log.info("no announcement for %.0fs: subscribing again", now - silent_since)
                    self._subscribe()
                continue
            silent_since = now
            if self.heartbeat is not None and self.heartbeat.excluded is not None:
                raise self.heartbeat.excluded
            if self.heartbeat is not None and self.heartbeat.lost.is_set():
                log.warning("the master no longer knows this worker: registering again")
                self.heartbeat.lost.clear()
                self._register(msg)
                continue
            if msg.kind == M.ANNOUNCE and msg.body.get("incarnation") not in (None,
                                                                             self.incarnation):
                # The master restarted (from its checkpoint): whatever this worker sent the
                # old process may be lost, so join again and redo the open round.
                log.warning("the master restarted: registering again")
                self._register(msg)
                continue
            if msg.kind == M.ROUND:
                msg = self._newest(msg)
                if msg.kind == M.SHUTDOWN:
                    return self._finish()
                if msg.body.get("round", 0) > self.last_round:
                    self._train(msg)
            elif msg.kind == M.SHUTDOWN:
                return self._finish()
            elif msg.kind == M.ANNOUNCE:
                phase, rnd = msg.body.get("phase"), int(msg.body.get("round", 0))
                if phase == M.REPORTING:
                    return self._finish()
                if phase == M.DONE:  # the master stopped waiting for reports: nothing to send
                    why = msg.body.get("failed")
                    if isinstance(why, str) and why:  # a supervisor must not read success
                        raise JobFailed(f"the job failed at the master: {why}")
                    log.warning("%s: the job ended before this worker reported", self.worker_id)
                    return {}
                again = (rnd == self.last_round
                         and int(msg.body.get("attempt", 0)) > self._secure_done.get(rnd, 0))
                if (phase == M.TRAINING and (rnd > self.last_round or again)
                        and msg.body.get("open", True)):
                    # A round is open that never reached us on PUB (or a secure round was
                    # begun again): fetch it over REQ.
                    log.info("round %d %s: fetching it", rnd,
                             "begun again" if again else "announced but not received")
                    try:
                        model = self._request(M.FETCH, {})
                    except RemoteError as exc:
                        if exc.code != errors.NOT_READY:
                            raise
                        continue  # it closed (or the master restarted) meanwhile
                    self._train(model)

    def _newest(self, msg: Message) -> Message:
        """The newest round already queued behind ``msg``, or a queued shutdown.

        A worker that fell behind (it was starting up, paused, or slow) would otherwise train
        on every round it missed, one after another, each refused as stale. Announcements in
        the queue are dropped: they are beacons, and the next one says the same.
        """
        assert self.sub is not None
        first = int(msg.body.get("round", 0))
        while self._stash or self.sub.poll(0, zmq.POLLIN):
            queued = self._recv_sub(0)
            if queued is None:
                continue
            if queued.kind == M.SHUTDOWN:
                return queued
            if (queued.kind == M.ROUND
                    and queued.body.get("round", 0) > msg.body.get("round", 0)):
                msg = queued
        if int(msg.body.get("round", 0)) != first:
            log.info("rounds %d to %d were published while this worker was busy: skipping "
                     "to round %d", first, int(msg.body["round"]) - 1, int(msg.body["round"]))
        return msg

    def _train(self, msg: Message) -> None:
        body = msg.body
        rnd = int(body["round"])
        participants = body.get("participants") or []
        if participants and self.worker_id not in participants:
            log.debug("round %d: not sampled", rnd)
            self.last_round = rnd
            return
        if body.get("per_worker"):
            # This worker's own payload: not on PUB, where every admitted key could read it,
            # but over REQ, where the master checks the key.
            try:
                msg = self._request(M.FETCH, {"setup": not self.ready})
            except RemoteError as exc:
                if exc.code != errors.NOT_READY:
                    raise
                return  # the round closed meanwhile; the next announcement says what is open
            body = msg.body
            if int(body.get("round", rnd)) != rnd:
                return
        if not self.ready:  # round 1 carries the setup; a worker that missed it fetches it
            self._setup(body["setup"] if "setup" in body else
                        self._request(M.FETCH, {}).body["setup"])
        self._go_back(rnd, int(body.get("base", rnd - 1)))
        received = time.monotonic()
        wait_time = received - self._last_upload
        bytes_in = self._sub_bytes
        self._sub_bytes = 0
        every = self.cfg.eval_every
        t0 = time.perf_counter()
        meta, model = split_payload(body["meta"], msg.arrays)
        devices.reset_peak(self.device)
        try:
            scores = (self.family.evaluate(meta, model)
                      if every and (rnd - 1) % every == 0 else {})
            eval_time = time.perf_counter() - t0
            fit_cpu = time.process_time()
            result = self.family.fit(rnd, meta, model)
            fit_cpu = time.process_time() - fit_cpu
        except Exception as exc:
            if devices.is_out_of_memory(exc):
                raise devices.GPUMemoryError(devices.out_of_memory_message(
                    self.worker_id, self.device, rnd, self.family.name,
                    self.cfg.family_params, self.cfg.source)) from None
            raise
        metrics = {**{k: float(v) for k, v in scores.items()},
                   **{k: float(v) for k, v in result.metrics.items()},
                   "eval_time": eval_time, "wait_time": wait_time, "bytes_in": bytes_in,
                   "fit_cpu_s": min(fit_cpu, C.MAX_TIMING_S)}
        loss = metrics.get("train_loss")
        if (loss is not None and not math.isfinite(loss) and self.diverged_ is None
                and not all(all_finite(np.asarray(a)) for a in result.arrays.values())):
            # The master refuses updates that hold NaN or Inf: say why here, once. (A loss
            # alone past float32's range, on a model another member blew up, is not this
            # worker's divergence: its update is taken without the number.)
            lr = self.cfg.family_params.get("lr")
            self.diverged_ = (f"training diverged (loss {loss} in round {rnd}): lower the "
                              f"learning rate"
                              + (f" (model.lr is {lr:g})" if isinstance(lr, (int, float))
                                 else ""))
            log.error("round %d: %s; the master refuses updates that hold NaN or Inf", rnd,
                      self.diverged_)
        # Where the round really ran: a tensor made without device= trains on the CPU.
        self._trained += 1  # a worker sampled out of rounds 1, 11, 21... is checked too
        on_gpu = (devices.tensors_on_gpu(self.family) if devices.check_due(self._trained)
                  else None)
        for key, value in (("tensors_on_gpu", on_gpu),
                           ("gpu_peak_mb", devices.peak_mb(self.device))):
            if value is not None:
                metrics[key] = value
        if isinstance(body.get("sent_at"), float):  # PUB: serialize + wire + queue + decode
            metrics["broadcast_s"] = max(0.0, self._received_at - body["sent_at"])
        arrays = result.arrays
        if self.cfg.privacy.client_dp is not None:
            # DP-FedAvg: the change this worker sends is bounded here, before it leaves (the
            # master clips again, and adds the noise).
            arrays, norm = clip_update(arrays, model, self.cfg.privacy.client_dp.clip)
            metrics["update_norm"] = norm
        # Compressed first: error feedback's residual is state the snapshot must hold.
        arrays = self.compressor.compress(arrays, model)
        if self.snapshots is not None and self.family.snapshot_due(meta):
            # Before the update leaves: a worker killed after sending has its state on disk.
            t0 = time.perf_counter()
            self.snapshots.save(rnd, self._state(), keep=int(body.get("keep", rnd - 1)))
            metrics["snapshot_time"] = time.perf_counter() - t0
        self.state_round = rnd
        secure = body.get("secagg")
        if secure is not None:
            # DP-FedAvg weighs every worker alike: weight 1 (the master's n_max is 1 too).
            weight = 1 if self.cfg.privacy.client_dp is not None else result.n_samples
            vector, clipped = self.family.secure_vector(arrays, model, weight,
                                                        int(secure["n_max"]),
                                                        float(secure["clip"]))
            metrics["secagg_clipped"] = clipped
            if clipped and not self._clip_warned:
                self._clip_warned = True
                log.warning("round %d: %.2g %% of the update's coordinates moved more than "
                            "secure_aggregation.clip (%g) and were clipped", rnd, 100 * clipped,
                            float(secure["clip"]))
        # This process's CPU since its last upload, every thread (ZeroMQ's, the heartbeat's):
        # what the round cost the machine, whoever waited for a core meanwhile. (The upload's
        # own sending falls in the next round's; workers that are threads of one process each
        # see the whole process's.)
        cpu = time.process_time()
        metrics["cpu_s"] = min(cpu - self._cpu_mark, C.MAX_TIMING_S)
        self._cpu_mark = cpu
        try:
            update = {"round": rnd, "version": int(body["version"]),
                      "n_samples": result.n_samples, "metrics": metrics,
                      "compression": self.compressor.kind, "sent_at": time.time()}
            if secure is not None:
                reply = SecureUpload(self.worker_id, secure, self._request,
                                     self._await_secure_stage).run(rnd, update, vector)
            else:
                reply = self._request(M.UPDATE, update, arrays)
            # Only what the round measured: a step of several rounds has a loss in one of
            # them, and scores only where the master asked for them.
            said = [f"{label} {metrics[key]:.4f}" for key, label in (
                ("train_loss", "loss"), ("macro_f1", "global model before training macro-F1"))
                if key in metrics]
            last = rnd >= self.cfg.rounds
            log.log(self._round_lines.level(matters=last or bool(reply.body.get("duplicate"))),
                    "round %d: %s%.3fs training%s", rnd, "".join(x + ", " for x in said),
                    metrics.get("train_time", 0.0),
                    " (resend)" if reply.body.get("duplicate") else "")
        except RemoteError as exc:
            if exc.code == errors.NOT_READY:
                # A resumed master that has not reopened this round yet: redo it when it does.
                log.warning("round %d: %s; will redo it when it opens", rnd, exc)
                return
            # Too late (the round closed at its deadline) or refused: move on to the next one.
            log.warning("round %d: update not accepted: %s", rnd, exc)
        except SecAggError as exc:
            log.warning("round %d: secure aggregation: %s; this worker sits the round out",
                        rnd, exc)
        self.last_round = rnd
        if secure is not None:  # done with this attempt; the master may begin another
            self._secure_done = {rnd: int(secure.get("attempt", 1))}
        self._last_upload = time.monotonic()

    def _await_secure_stage(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the master's word on PUB that a secure round's
        stage changed (``secagg_stage``); whatever else arrives meanwhile is kept, in order,
        for the main loop."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._receive(max(1, int(left * 1000)))
            if msg is None:
                continue
            if msg.kind == M.SECAGG_STAGE:
                return
            self._stash.append(msg)

    def _state(self) -> dict[str, Any]:
        # torch's global generator too: dropout and some initializers draw from it.
        return {"family": self.family.local_state(), "torch_rng": torch.get_rng_state(),
                "compression": self.compressor.residual_}

    def _load_state(self, tree: dict[str, Any]) -> None:
        self.family.load_local_state(tree["family"])
        torch.set_rng_state(tree["torch_rng"])
        self.compressor.residual_ = dict(tree.get("compression") or {})

    def _go_back(self, rnd: int, base: int) -> None:
        """Round ``rnd`` builds on this worker's state after round ``base``: a resumed master
        (or a redone step) went back to it. If this worker's state is newer, load its snapshot
        of then, so that it trains as in the run that never failed."""
        if self.state_round <= base or self.snapshots is None:
            return
        found = self.snapshots.back_to(base)
        if found is None:
            log.warning("round %d builds on round %d, but %s has no state from then: it "
                        "goes on from its state after round %d", rnd, base, self.worker_id,
                        self.state_round)
            return
        self.state_round, tree = found
        stream = self.family.privacy_stream()  # never rewound: see WorkerFamily.privacy_stream
        self._load_state(tree)
        if stream is not None:
            self.family.resume_privacy_stream(stream)
            # On disk too: back_to deleted the newer snapshots, the only files that held the
            # stream as it is, and a worker killed before its next save would restart from
            # this one's and draw the sent rounds' noise again.
            self.snapshots.save(self.state_round, self._state())
        log.info("round %d builds on round %d: back to %s's state after round %d%s", rnd, base,
                 self.worker_id, self.state_round,
                 "" if stream is None else " (its privacy noise and accountant go on as they "
                 "were: a replayed round costs ε again)")

    def _finish(self) -> dict[str, Any]:
        final = self._request(M.FETCH, {})
        if not self.ready:
            self._setup(final.body["setup"])
        federated = _reportable(self.family.final_scores(
            *split_payload(final.body["meta"], final.arrays)), "federated")
        local_only = (_reportable(self.family.local_baseline(), "local-only") if self.cfg.baselines
                      else None)
        report = {"federated": federated, "local_only": local_only,
                  "n_train": self.data.n_train, "n_test": int(len(self.data.test_index)),
                  "version": int(final.body.get("version", 0)), "labelled": self.data.labelled}
        self._request(M.REPORT, {"report": report})
        if self.snapshots is not None:  # the job is over: nothing left to go back to
            shutil.rmtree(self.snapshots.folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # workers/, once the last worker is done
                self.snapshots.folder.parent.rmdir()
        log.info("%s done: federated %s%s", self.worker_id, headline(federated),
                 f", local-only {headline(local_only)}" if local_only else "")
        return report


#: The score a worker's closing log line names, the first of these its family reports.
HEADLINE_SCORES = {"macro_f1": "macro-F1", "accuracy": "accuracy", "perplexity": "perplexity",
                   "npmi_doc": "NPMI (doc)", "c_npmi": "C_NPMI", "clusters_used": "clusters used"}


def _reportable(scores: dict[str, Any] | None, which: str) -> dict[str, Any] | None:
    """The scores without those the master would refuse in a report (not finite, past
    ``MAX_METRIC``, outside their ``SCORE_RANGES``: a perplexity past float's range, on a
    model blown up), which made the worker fail at the end of its job."""
    if scores is None:
        return None

    # (a value not a number is no score: the master says what is wrong with it)
    left = sorted(k for k, v in scores.items() if isinstance(v, (int, float))
                  and not isinstance(v, bool) and not M.reportable(k, v))
    if left:
        log.warning("the %s model's %s out of range: left out of the report", which,
                    ", ".join(f"{k} ({scores[k]:.6g})" for k in left)
                    + (" is" if len(left) == 1 else " are"))
    return {k: v for k, v in scores.items() if k not in left}


def split_payload(meta: dict[str, Any], arrays: dict[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A payload's model arrays apart from the strategy's (``strategy.*``: SCAFFOLD's control
    variate), which the family finds in ``meta["strategy_arrays"]``."""
    extra = {k: v for k, v in arrays.items() if k.startswith(STRATEGY_ARRAY_PREFIX)}
    if not extra:
        return meta, arrays
    return ({**meta, "strategy_arrays": extra},
            {k: v for k, v in arrays.items() if k not in extra})


def default_state_dir(cfg: ClusterConfig, worker_id: str) -> Path:
    """``<output_dir>/workers/<id>``; beside a history link (``runs/latest``), in
    ``runs/workers/<id>``, not in the finished run the link points at."""
    out = Path(cfg.output_dir)
    return (out.parent if out.name == "latest" else out) / "workers" / worker_id


def headline(scores: dict[str, Any] | None) -> str:
    """``"macro-F1 0.9123"``: the first of :data:`HEADLINE_SCORES` in ``scores``, whatever the
    family (a topic model has no macro-F1)."""
    for key, label in HEADLINE_SCORES.items():
        if scores and key in scores:
            return f"{label} {scores[key]:.4f}"
    return "no scores"
