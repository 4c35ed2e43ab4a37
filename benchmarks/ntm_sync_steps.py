"""Synchronous gFedNTM steps per second on a real cluster over TCP loopback.

``fedctl run`` starts a master and 3 workers as separate processes (plaintext ZeroMQ on
127.0.0.1), ProdLDA in ``mode: sync`` with the default network (2 x 100 softplus, batch 64,
Adam) at V = 2000 words and K = 50 topics, on the bundled dbpedia_10k abstracts. Each round of
the cluster is one synchronous step: publish the weights (PUB), every worker computes its
mini-batch gradient and uploads it (REQ), the master averages, steps Adam and publishes again.

From ``metrics.jsonl``: the ``round`` events' ``duration_s`` (first and last step excluded:
they also score the model) give steps per second, and the time between the second and the
last round event gives the wall-clock rate. For scale, the same gradient computed in-process
(no network) is timed too.

Usage: ``python benchmarks/ntm_sync_steps.py [--steps 300]``. Writes
``benchmarks/results/ntm_sync_steps.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.transport import free_ports  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"



def in_process_gradient_ms(vocab: int, topics: int, repeats: int = 50) -> float:
    """Median milliseconds of one worker's gradient (batch 64), no network."""
    import scipy.sparse as sp
    import torch

    from common.models.ntm import NTMParams

    torch.set_num_threads(1)
    X = sp.random(640, vocab, density=0.02, format="csr", dtype=np.float32,
                  random_state=0) * 3
    model = NTMParams(n_topics=topics).model().initialize(vocab)
    times = []
    for i in range(repeats):
        rows = np.arange(64 * (i % 10), 64 * (i % 10 + 1))
        t0 = time.perf_counter()
        model.gradients(X, None, rows)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--topics", type=int, default=50)
    ap.add_argument("--limit", type=int, default=3000, help="documents of dbpedia_10k used")
    ap.add_argument("--checkpoint-every", type=int, default=100,
                    help="master checkpoint period in steps (a sync run takes thousands of "
                         "steps; 1 writes 4 MB and fsyncs at every step)")
    ap.add_argument("--compression", default="none", help="update compression: none, float16")
    args = ap.parse_args()

    out = Path(tempfile.mkdtemp(prefix="ntm_steps_"))
    pub, rep = free_ports(2)
    raw = {"master": {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                      "rep_port": rep},
           "workers": [f"w{i + 1}" for i in range(args.workers)],
           "model": {"family": "prodlda", "mode": "sync", "n_topics": args.topics,
                     "vocab_size": args.vocab, "eval_every": 10 ** 9},
           "rounds": args.steps, "min_workers": args.workers,
           "checkpoint_every": args.checkpoint_every,
           "compression": {"kind": args.compression},
           "data": {"path": str(ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"),
                    "limit": args.limit, "partition": "iid"},
           "output_dir": str(out / "out"), "baselines": False, "seed": 0}
    cfg = out / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "common.cli", "run", "--config", str(cfg)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"fedctl run failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "out" / "metrics.jsonl").open()]
    rounds = [e for e in events if e["event"] == "round"]
    setup = json.loads((out / "out" / "model.json").read_text())["setup"]
    inner = rounds[1:-1]  # the first and the last step also score the model
    dur = np.array([e["duration_s"] for e in inner])
    wall = rounds[-2]["time"] - rounds[0]["time"]
    grad_ms = in_process_gradient_ms(len(setup["vocabulary"]), args.topics)
    n_params = sum(int(np.prod(a.shape)) for a in np.load(out / "out" / "model.npz").values())
    res = {
        "workers": args.workers, "vocab": len(setup["vocabulary"]), "topics": args.topics,
        "parameters": n_params, "steps": len(rounds),
        "steps_per_s_from_durations": float(len(dur) / dur.sum()),
        "steps_per_s_wall": float((len(rounds) - 2) / wall),
        "median_step_ms": float(1000 * np.median(dur)),
        "p90_step_ms": float(1000 * np.percentile(dur, 90)),
        "median_aggregate_ms": float(1000 * np.median([e["aggregate_s"] for e in inner])),
        "median_slowest_train_ms": float(1000 * np.median([e["slowest_train_s"]
                                                           for e in inner])),
        "median_comm_overhead_ms": float(1000 * np.median([e["comm_overhead_s"]
                                                           for e in inner])),
        "in_process_gradient_ms": grad_ms,
        "bytes_per_step": float(np.median([e["broadcast_bytes"] + e["bytes_in"]
                                           for e in inner])),
        "fedctl_run_seconds": total, "cpu_count": os.cpu_count(),
    }
    md = "\n".join([
        "# Synchronous gFedNTM steps on loopback",
        "",
        f"ProdLDA, `mode: sync`, {res['workers']} worker processes + 1 master on "
        f"{res['cpu_count']} CPU cores (load average {os.getloadavg()[0]:.1f} at the end), "
        f"plaintext ZeroMQ over 127.0.0.1, V = {res['vocab']}, K = {res['topics']} "
        f"({res['parameters']:,} numbers in the model), batch 64 per worker, "
        f"{res['steps']} steps, checkpoint every {args.checkpoint_every} steps, "
        f"update compression {args.compression}.",
        "",
        "| metric | value |", "|---|---|",
        f"| steps/s (from round durations) | {res['steps_per_s_from_durations']:.1f} |",
        f"| steps/s (wall clock) | {res['steps_per_s_wall']:.1f} |",
        f"| median step | {res['median_step_ms']:.1f} ms (p90 {res['p90_step_ms']:.1f} ms) |",
        f"| of which slowest worker's gradient | {res['median_slowest_train_ms']:.1f} ms |",
        f"| of which master's average + Adam step | {res['median_aggregate_ms']:.1f} ms |",
        f"| communication and scheduling | {res['median_comm_overhead_ms']:.1f} ms |",
        f"| one gradient in-process (no network) | {res['in_process_gradient_ms']:.1f} ms |",
        f"| bytes per step (broadcast + uploads) | {res['bytes_per_step'] / 1e6:.2f} MB |",
        "",
        "gFedNTM's reference implementation sleeps 3 s after each client at every "
        "mini-batch: ≥ 9 s per step with 3 clients.",
    ])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ntm_sync_steps.md").write_text(md + "\n")
    (RESULTS / "ntm_sync_steps.json").write_text(json.dumps(res, indent=2))
    print(md)


if __name__ == "__main__":
    main()
