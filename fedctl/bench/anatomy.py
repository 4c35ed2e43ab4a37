"""Section ``anatomy``: where a round's time goes by model size, and the bare pyzmq exchange
of the same bytes for comparison."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ClusterConfig
from common.net.transport import free_ports
from fedctl.bench.harness import _median, bench_config, n_params, run_cluster
from fedctl.bench.plan import Plan
from fedctl.launch import usable_cores


def anatomy(run: dict[str, Any]) -> dict[str, float | None]:
    """Median per-round decomposition along each round's critical path.

    The critical worker of a round is the one whose broadcast + evaluation + training +
    upload is longest; ``other`` is the round's duration less its broadcast, evaluation,
    training, upload and the master's aggregation (the worker's parameter copies and
    (de)compression, the master's validation, queueing and event-loop latency). ``cpu`` is
    the CPU time the round cost the master and its workers together
    (:func:`common.runlog.round_cpu`), and ``train_cpu`` the CPU of the workers' training (their
    ``fit_cpu_s``): on C cores rounds cannot follow each other faster than ``cpu / C``.
    """
    parts: dict[str, list[float]] = {k: [] for k in ("broadcast", "eval", "train", "upload",
                                                     "aggregate", "other", "publish", "cpu",
                                                     "train_cpu")}
    for r in run["rounds"]:
        ws = [w for w in run["worker_rounds"] if w["round"] == r["round"]]
        if not ws:
            continue

        def path(w: dict[str, Any]) -> float:
            return sum(w.get(k) or 0.0 for k in ("broadcast_s", "eval_time", "train_time",
                                                 "upload_s"))

        crit = max(ws, key=path)
        b, e, t, u = (crit.get(k) or 0.0 for k in ("broadcast_s", "eval_time", "train_time",
                                                   "upload_s"))
        parts["broadcast"].append(b)
        parts["eval"].append(e)
        parts["train"].append(t)
        parts["upload"].append(u)
        parts["aggregate"].append(r["aggregate_s"])
        parts["publish"].append(r["publish_s"])
        parts["other"].append(max(0.0, r["duration_s"] - b - e - t - u - r["aggregate_s"]))
        if r.get("machine_cpu_s") is not None:
            parts["cpu"].append(r["machine_cpu_s"])
            parts["train_cpu"].append(sum(w.get("fit_cpu_s") or 0.0 for w in ws))
    return {k: _median(v) for k, v in parts.items()}


def _bare_peer(pub: int, rep: int, reps: int) -> None:  # pragma: no cover - child process
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{rep}")
    while True:  # slow joiner: wait for a hello, then say ready
        frames = sub.recv_multipart()
        if frames[0] == b"hello":
            break
    req.send_multipart([b"ready", b""])
    req.recv_multipart()
    for _ in range(reps):
        frames = sub.recv_multipart(copy=False)
        while frames[0].bytes == b"hello":
            frames = sub.recv_multipart(copy=False)
        got = time.time()
        stamp = json.dumps({"got": got, "sent": time.time()}).encode()
        req.send_multipart([b"u", stamp, *frames[1:]], copy=False)  # the same bytes back
        req.recv_multipart()
    sub.close(0)
    req.close(0)
    ctx.term()


def bare_exchange(shapes: Sequence[tuple[int, ...]], n_peers: int = 3, reps: int = 5
                  ) -> dict[str, Any]:
    """Time the bare bytes of a round with plain pyzmq: one PUB message of ``shapes`` (float32
    arrays, one frame each, zero-copy) to ``n_peers`` SUB processes, then each sends the same
    frames back over REQ/REP and gets a one-frame reply.

    Returns
    -------
    dict
        Medians over ``reps``: ``round_s`` (publish to last reply), ``broadcast_s`` (publish to
        the last peer's receipt) and ``upload_s`` (slowest REQ send to REP receipt); ``bytes``.
    """
    import zmq

    arrays = [np.ones(s, dtype=np.float32) for s in shapes]
    pub_port, rep_port = free_ports(2)
    spawn = mp.get_context("spawn")
    peers = [spawn.Process(target=_bare_peer, args=(pub_port, rep_port, reps), daemon=True)
             for _ in range(n_peers)]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    rep = ctx.socket(zmq.REP)
    rep.bind(f"tcp://127.0.0.1:{rep_port}")
    for p in peers:
        p.start()
    rounds, broadcasts, uploads = [], [], []
    try:
        ready = 0
        while ready < n_peers:
            pub.send_multipart([b"hello", b""])
            if rep.poll(100):
                rep.recv_multipart()
                rep.send(b"ok")
                ready += 1
        for _ in range(reps):
            t0 = time.time()
            pub.send_multipart([b"r", b"{}", *arrays], copy=False)
            got, up = [], []
            for _ in range(n_peers):
                if not rep.poll(120_000):
                    raise RuntimeError("bare exchange: a peer did not answer in 120 s")
                frames = rep.recv_multipart(copy=False)
                arrived = time.time()
                stamp = json.loads(frames[1].bytes)
                rep.send(b"ack")
                got.append(stamp["got"] - t0)
                up.append(arrived - stamp["sent"])
            rounds.append(time.time() - t0)
            broadcasts.append(max(got))
            uploads.append(max(up))
    finally:
        for p in peers:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        pub.close(0)
        rep.close(0)
        ctx.term()
    return {"round_s": _median(rounds), "broadcast_s": _median(broadcasts),
            "upload_s": _median(uploads), "reps": reps, "n_peers": n_peers,
            "bytes": int(sum(a.nbytes for a in arrays))}


def section_anatomy(base: ClusterConfig, plan: Plan, work: Path, log: Callable[[str], None]
                    ) -> dict[str, Any]:
    """Round anatomy by model size, and the bare exchange of the same bytes."""
    out = {}
    for hidden in plan.anatomy_hidden:
        big = hidden > 20_000
        rounds, reps = plan.anatomy_rounds_for(n_params(hidden))
        cfg = bench_config(base, work / f"anatomy_{hidden}", rounds=rounds,
                           eval_every=0, baselines=False, **{
                               "model.hidden": hidden, "model.batch_size": 1024,
                               "model.local_epochs": 1, "data.limit": plan.anatomy_limit,
                               "data.partition": "iid", "security.mode": "none",
                               "heartbeat_timeout": 30.0 if big else base.heartbeat_timeout})
        log(f"anatomy: hidden {hidden} ({n_params(hidden) / 1e6:.2f} M parameters), "
            f"{rounds} rounds")
        run = run_cluster(cfg, profile=plan.profile)
        shapes = [(hidden, 384), (hidden,), (2, hidden), (2,)]
        log(f"anatomy: bare pyzmq exchange of the same {4 * n_params(hidden) / 1e6:.1f} MB, "
            f"{reps} times")
        bare = bare_exchange(shapes, n_peers=len(cfg.workers), reps=reps)
        out[str(hidden)] = {"hidden": hidden, "params": n_params(hidden), "run": run,
                            "anatomy": anatomy(run), "bare": bare, "cores": usable_cores()}
    return out

