"""Synchronous gFedNTM steps per second on a real cluster over TCP loopback.

``fedctl run`` starts a master and 3 workers as separate processes (plaintext ZeroMQ on
127.0.0.1), ProdLDA in ``mode: sync`` with the default network (2 x 100 softplus, batch 64,
Adam) at V = 2000 words and K = 50 topics, on the bundled dbpedia_10k abstracts, twice:

* batch norm over each worker's own batch (``sync_batch_norm: false``): a step is one round:
  publish the weights (PUB), every worker computes its mini-batch gradient and uploads it
  (REQ), the master averages, steps Adam and publishes again;
* batch norm over the union of the workers' batches (the default): a step is five rounds
  (:mod:`common.models.ntm_sync_bn`: two forward and two backward exchanges of per-feature
  statistics, then the gradients).

From ``metrics.jsonl``: the ``round`` events' ``duration_s`` summed over each step's rounds
(first and last step excluded: they also score the model) give steps per second, and the time
between the round events closing the first and the next-to-last step gives the wall-clock rate.
For scale, the same gradient computed in-process (no network) is timed too.

Usage: ``python benchmarks/ntm_sync_steps.py [--steps 300] [--batch-norm both|sync|local]``.
Writes ``benchmarks/results/ntm_sync_steps.{md,json}``.
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
from common.net.transport import free_ports  # noqa: E402
from fedctl.launch import child_env, fedctl_command  # noqa: E402

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


def run_cluster(args: argparse.Namespace, sync_bn: bool) -> dict:
    """One ``fedctl run`` of ``args.steps`` synchronous steps; per-step figures."""
    per_step = 5 if sync_bn else 1
    out = Path(tempfile.mkdtemp(prefix="ntm_steps_"))
    pub, rep = free_ports(2)
    raw = {"master": {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                      "rep_port": rep},
           "workers": [f"w{i + 1}" for i in range(args.workers)],
           "model": {"family": "prodlda", "mode": "sync", "n_topics": args.topics,
                     "vocab_size": args.vocab, "eval_every": 10 ** 9,
                     "sync_batch_norm": sync_bn},
           "rounds": args.steps * per_step, "min_workers": args.workers,
           "checkpoint_every": args.checkpoint_every * per_step,
           "compression": {"kind": args.compression},
           "data": {"path": str(ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"),
                    "limit": args.limit, "partition": "iid"},
           "output_dir": str(out / "out"), "baselines": False, "seed": 0}
    cfg = out / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    t0 = time.perf_counter()
    # `fedctl run` itself is what is timed: it starts the master and workers (fedctl.launch).
    proc = subprocess.run(fedctl_command("run", "--config", str(cfg)), cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=1800)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"fedctl run failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "out" / "metrics.jsonl").open()]
    rounds = [e for e in events if e["event"] == "round"]
    setup = json.loads((out / "out" / "model.json").read_text())["setup"]
    steps = [rounds[i:i + per_step] for i in range(0, len(rounds), per_step)]
    inner = steps[1:-1]  # the first and the last step also score the model

    def per_step_ms(key: str) -> float:
        return float(1000 * np.median([sum(e[key] for e in st) for st in inner]))

    dur = np.array([sum(e["duration_s"] for e in st) for st in inner])
    wall = steps[-2][-1]["time"] - steps[0][-1]["time"]
    n_params = sum(int(np.prod(a.shape)) for a in np.load(out / "out" / "model.npz").values())
    return {
        "sync_batch_norm": sync_bn, "rounds_per_step": per_step,
        "workers": args.workers, "vocab": len(setup["vocabulary"]), "topics": args.topics,
        "parameters": n_params, "steps": len(steps),
        "steps_per_s_from_durations": float(len(dur) / dur.sum()),
        "steps_per_s_wall": float((len(steps) - 2) / wall),
        "median_step_ms": float(1000 * np.median(dur)),
        "p90_step_ms": float(1000 * np.percentile(dur, 90)),
        "median_aggregate_ms": per_step_ms("aggregate_s"),
        "median_slowest_train_ms": per_step_ms("slowest_train_s"),
        "median_comm_overhead_ms": per_step_ms("comm_overhead_s"),
        "bytes_per_step": float(np.median([sum(e["broadcast_bytes"] + e["bytes_in"]
                                               for e in st) for st in inner])),
        "fedctl_run_seconds": total,
    }


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
    ap.add_argument("--batch-norm", choices=("both", "sync", "local"), default="both",
                    help="batch norm over the union of the workers' batches, over each "
                         "worker's own, or both runs")
    args = ap.parse_args()
    modes = {"both": (False, True), "sync": (True,), "local": (False,)}[args.batch_norm]
    runs = [run_cluster(args, sync_bn) for sync_bn in modes]
    grad_ms = in_process_gradient_ms(runs[0]["vocab"], args.topics)
    load = os.getloadavg()[0]
    res = {"runs": runs, "in_process_gradient_ms": grad_ms, "cpu_count": os.cpu_count(),
           "load_average_at_end": load}
    r0 = runs[0]
    names = {False: "each worker's own batch", True: "union of the batches"}
    rows = [("batch norm over", lambda r: names[r["sync_batch_norm"]]),
            ("rounds per step", lambda r: str(r["rounds_per_step"])),
            ("steps/s (from round durations)", lambda r: f"{r['steps_per_s_from_durations']:.1f}"),
            ("steps/s (wall clock)", lambda r: f"{r['steps_per_s_wall']:.1f}"),
            ("median step", lambda r: f"{r['median_step_ms']:.1f} ms "
                                      f"(p90 {r['p90_step_ms']:.1f} ms)"),
            ("of which workers' computing (slowest per round)",
             lambda r: f"{r['median_slowest_train_ms']:.1f} ms"),
            ("of which master's merging + Adam step",
             lambda r: f"{r['median_aggregate_ms']:.1f} ms"),
            ("communication and scheduling", lambda r: f"{r['median_comm_overhead_ms']:.1f} ms"),
            ("bytes per step (broadcasts + uploads)",
             lambda r: f"{r['bytes_per_step'] / 1e6:.2f} MB")]
    lines = [
        "# Synchronous gFedNTM steps on loopback",
        "",
        f"ProdLDA, `mode: sync`, {r0['workers']} worker processes + 1 master on "
        f"{res['cpu_count']} CPU cores (load average {load:.1f} at the end), "
        f"plaintext ZeroMQ over 127.0.0.1, V = {r0['vocab']}, K = {r0['topics']} "
        f"({r0['parameters']:,} numbers in the model), batch 64 per worker, "
        f"{args.steps} steps, checkpoint every {args.checkpoint_every} steps, "
        f"update compression {args.compression}. One gradient in-process (no network): "
        f"{grad_ms:.1f} ms.",
        "",
        "| metric | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
        "|---|" + "---|" * len(runs)]
    lines += [f"| {name} | " + " | ".join(f(r) for r in runs) + " |" for name, f in rows]
    lines += ["", "gFedNTM's reference implementation sleeps 3 s after each client at every "
              "mini-batch: ≥ 9 s per step with 3 clients."]
    md = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ntm_sync_steps.md").write_text(md + "\n")
    (RESULTS / "ntm_sync_steps.json").write_text(json.dumps(res, indent=2))
    print(md)


if __name__ == "__main__":
    main()
