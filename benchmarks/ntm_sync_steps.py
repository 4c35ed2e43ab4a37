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

With ``--secure``, each configuration also runs under ``privacy.secure_aggregation`` (every
round then the four exchanges of a secure round: :mod:`common.models.ntm_secure`).

Usage: ``python benchmarks/ntm_sync_steps.py [--steps 300] [--batch-norm both|sync|local]
[--secure] [--repeats 3]``. Writes ``benchmarks/results/ntm_sync_steps.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.net.transport import free_ports  # noqa: E402
from common.runlog import round_cpu  # noqa: E402
from fedctl.bench.report import command_line, current_commit, median_range  # noqa: E402
from fedctl.launch import child_env, fedctl_command, usable_cores  # noqa: E402

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


def run_cluster(args: argparse.Namespace, sync_bn: bool, secure: bool = False) -> dict:
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
    if secure:
        raw["privacy"] = {"secure_aggregation": {}}
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
    cpu = round_cpu(events)  # a step's CPU is that of its rounds together
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
        "cpu_per_step_ms": float(1000 * np.median([sum(cpu.get(e["round"], 0.0) for e in st)
                                                    for st in inner])),
        "master_cpu_per_step_ms": per_step_ms("cpu_s"),
        "bytes_per_step": float(np.median([sum(e["broadcast_bytes"] + e["bytes_in"]
                                               for e in st) for st in inner])),
        "fedctl_run_seconds": total,
    }


def _configs(args: argparse.Namespace) -> list[tuple[bool, bool]]:
    """(synchronized batch norm, secure aggregation) of each configuration run."""
    modes = {"both": (False, True), "sync": (True,), "local": (False,)}[args.batch_norm]
    return [(bn, sec) for bn in modes for sec in ((False, True) if args.secure else (False,))]


def _label(r: dict) -> str:
    bn = "union batch norm" if r["sync_batch_norm"] else "per-node batch norm"
    return bn + (", secure" if r["secure"] else "")


def plot(res: dict, path: Path) -> None:
    """Steps per second of each configuration: median bar, one dot per run, the goal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[float]] = {}
    ceilings: dict[str, list[float]] = {}
    cores = res.get("cores")
    for r in res["runs"]:
        groups.setdefault(_label(r), []).append(r["steps_per_s_wall"])
        if cores and r.get("cpu_per_step_ms"):
            ceilings.setdefault(_label(r), []).append(1000 * cores / r["cpu_per_step_ms"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, xs) in enumerate(groups.items()):
        ax.bar(i, float(np.median(xs)), color="#4c72b0" if "secure" not in label else "#dd8452")
        ax.plot([i] * len(xs), xs, "k.", ms=6)
        ax.text(i - 0.3, float(np.median(xs)) / 2, f"{np.median(xs):.0f}", ha="center",
                color="white", fontweight="bold")
        if label in ceilings:  # what the CPU a step costs allows on these cores
            top = float(np.median(ceilings[label]))
            ax.plot([i - 0.4, i + 0.4], [top, top], color="#c44e52", lw=2,
                    label=f"most {cores} cores allow (CPU a step)" if i == 0 else None)
            ax.text(i + 0.4, top + 1.5, f"{top:.0f}", ha="right", va="bottom", fontsize=8,
                    color="#c44e52")
    ax.axhline(100, color="0.4", ls="--", lw=1)
    ax.text(len(groups) - 0.5, 101, "goal (union batch norm)", ha="right", va="bottom",
            fontsize=8, color="0.3")
    ax.set_xticks(range(len(groups)), [g.replace(", ", ",\n") for g in groups], fontsize=8)
    ax.set_ylabel("synchronous steps / s (wall clock)")
    r0 = res["runs"][0]
    ax.set_title(f"ProdLDA sync, V = {r0['vocab']}, K = {r0['topics']}, {r0['workers']} workers "
                 f"({res['repeats']} runs each)", fontsize=9)
    ax.set_ylim(0, max(110, max(max(x) for x in groups.values()) * 1.15))
    if ceilings:
        ax.legend(loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    ap.add_argument("--secure", action="store_true",
                    help="also each configuration under privacy.secure_aggregation")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each configuration, taken in turns")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    cores = usable_cores()  # what the cluster's processes may run on
    runs = []
    for _ in range(args.repeats):  # in turns, so that a slow spell of the machine hits all
        for sync_bn, secure in _configs(args):
            runs.append({**run_cluster(args, sync_bn, secure), "secure": secure})
    grad_ms = in_process_gradient_ms(runs[0]["vocab"], args.topics)
    load = os.getloadavg()[0]
    res = {"runs": runs, "in_process_gradient_ms": grad_ms, "cpu_count": os.cpu_count(),
           "cores": cores,
           "load_average_before": load_before, "load_average_at_end": load,
           "repeats": args.repeats, "command": command_line(ROOT),
           "commit": current_commit(ROOT)}
    r0 = runs[0]
    configs = {}
    for r in runs:
        configs.setdefault(_label(r), []).append(r)

    def cell(key: str, scale: float = 1.0, digits: int = 1) -> Callable[[list[dict]], str]:
        return lambda rs: median_range([scale * r[key] for r in rs], digits)

    rows = [("rounds per step", lambda rs: str(rs[0]["rounds_per_step"])),
            ("steps/s (wall clock)", cell("steps_per_s_wall")),
            ("steps/s (from round durations)", cell("steps_per_s_from_durations")),
            ("median step, ms", cell("median_step_ms")),
            ("of which workers' computing (slowest per round), ms",
             cell("median_slowest_train_ms")),
            ("of which master's merging + Adam step, ms", cell("median_aggregate_ms")),
            ("communication and scheduling, ms", cell("median_comm_overhead_ms")),
            ("bytes per step (broadcasts + uploads), MB", cell("bytes_per_step", 1e-6, 2)),
            ("CPU per step, master + workers, every thread (core-ms)", cell("cpu_per_step_ms")),
            ("of which the master's (core-ms)", cell("master_cpu_per_step_ms")),
            (f"most steps/s {cores} cores allow (cores ÷ CPU per step)",
             lambda rs: median_range([1000 * cores / r["cpu_per_step_ms"] for r in rs], 1))]
    lines = [
        "# Synchronous gFedNTM steps on loopback",
        "",
        f"`{res['command']}` (commit {res['commit']})",
        "",
        f"ProdLDA, `mode: sync`, {r0['workers']} worker processes + 1 master on "
        f"{res['cpu_count']} CPU cores (load average {load_before:.1f} before, {load:.1f} "
        f"after), plaintext ZeroMQ over 127.0.0.1, V = {r0['vocab']}, K = {r0['topics']} "
        f"({r0['parameters']:,} numbers in the model), batch 64 per worker, "
        f"{args.steps} steps, checkpoint every {args.checkpoint_every} steps, "
        f"update compression {args.compression}; each configuration {args.repeats} times, "
        f"in turns: median (min–max) over the runs. One gradient in-process (no network): "
        f"{grad_ms:.1f} ms.",
        "",
        "| metric | " + " | ".join(configs) + " |",
        "|---|" + "---|" * len(configs)]
    lines += [f"| {name} | " + " | ".join(f(rs) for rs in configs.values()) + " |"
              for name, f in rows]
    lines += ["", "CPU per step is each process's `cpu_s` (metrics.jsonl: CPU time between two "
              "of its rounds, every thread: ZeroMQ's I/O, the heartbeat, the kernel's work for "
              "it) summed over the master, the workers and the step's rounds. However the "
              "processes share the cores, steps cannot follow each other faster than that CPU "
              f"spread over all {cores} of them allows: the last row is the ceiling this "
              "machine puts on the configuration, with every process's CPU as it is now.", "",
              "gFedNTM's reference implementation sleeps 3 s after each client at every "
              "mini-batch: ≥ 9 s per step with 3 clients.", "",
              "![steps per second](ntm_sync_steps.png)"]
    md = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ntm_sync_steps.md").write_text(md + "\n")
    (RESULTS / "ntm_sync_steps.json").write_text(json.dumps(res, indent=2))
    plot(res, RESULTS / "ntm_sync_steps.png")
    print(md)


if __name__ == "__main__":
    main()
