"""Many workers as threads of one process, for the scaling benchmarks.

A process a worker costs a few hundred MB (the interpreter, torch), so N = 1,000 workers do not
fit as processes on one machine; as threads of a single process they fit (about 9 MB each) but
starve: every worker's heartbeat thread and poll loop wants the interpreter lock, and past ~900
threads registrations stalled (``benchmarks/results/scaling_1000.md``). A pool splits them:
``P`` processes of ``N / P`` threads, each process with one ZeroMQ context and one torch thread.

``python -m fedctl.bench.worker_pool --config CLUSTER.yaml --ids w1,w2,...`` runs the named
workers of the job and exits 0 once they all have, 1 if any failed (its error on stderr).
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from common.config import ClusterConfig, load_config

#: Sockets a worker holds (SUB, REQ, the heartbeat's REQ), each a descriptor or two.
SOCKETS_PER_WORKER = 4
DESCRIPTORS_PER_WORKER = 8


def start_thread_workers(cfg: ClusterConfig, ids: Sequence[str], errors: list[str]
                         ) -> list[threading.Thread]:
    """The workers ``ids`` of the job ``cfg`` (as the worker processes would read it), each
    a daemon thread of this process, one torch thread in all; a worker's exception is
    appended to ``errors``."""
    import torch
    import zmq

    from worker.client import Worker

    torch.set_num_threads(1)
    # ZeroMQ's default of 1,023 sockets a context, and the usual 1,024 descriptors, end at
    # N ~ 300 workers a process. A context of its own: the limit holds only if set before its
    # first socket.
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, SOCKETS_PER_WORKER * len(ids) + 64)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = DESCRIPTORS_PER_WORKER * len(ids) + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

    def work(wid: str) -> None:
        try:
            Worker(cfg, wid, ctx=ctx).run()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            errors.append(f"{wid}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(w,), daemon=True, name=f"worker-{w}")
               for w in ids]
    for t in threads:
        t.start()
    return threads


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="the job's cluster.yaml")
    ap.add_argument("--ids", required=True, help="comma-separated worker ids to run")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    ids = [w for w in args.ids.split(",") if w]
    unknown = sorted(set(ids) - {w.name for w in cfg.workers})
    if unknown:
        print(f"worker_pool: not workers of {args.config}: {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    errors: list[str] = []
    for t in start_thread_workers(cfg, ids, errors):
        t.join()
    for e in errors:
        print(f"worker_pool: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
