"""A cluster started by hand on one machine, with each process's default CPU threads against
every process taking every core.

The README's "four terminals": ``fedctl master`` and three ``fedctl worker`` commands, each
started on its own (no ``--threads``, no ``OMP_NUM_THREADS``), the master on loopback, the
first worker started before the others. Three settings, taken in turns:

* ``defaults``: what the commands choose by themselves (fedctl/cli.py: a worker counts the
  ``fedctl worker`` processes running and, the master being on loopback, the cluster's own
  workers and master; the master its share beside them);
* ``before``: the defaults before those, given as ``--threads``: the master every core, and
  worker N, counting the N workers started by then, the cores ÷ N (the first one every core);
* ``every core``: each process given ``--threads`` = the cores.

The job: ProdLDA ``mode: sync`` with batch norm over the union (V = 2000, K = 50, batch 64 a
worker, five exchanges a step), whose millisecond rounds show what a process spinning threads
it cannot run costs. Steps a second from ``metrics.jsonl`` (the rounds' ``duration_s``).

Usage: ``python benchmarks/threads_by_hand.py [--repeats 3] [--steps 150]``. Writes
``benchmarks/results/threads_by_hand.{md,json}``.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.net.transport import free_ports  # noqa: E402
from fedctl.bench.report import command_line, current_commit, median_range  # noqa: E402
from fedctl.launch import child_env, fedctl_command, usable_cores  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKERS = ("w1", "w2", "w3")
SETTINGS = ("defaults", "before", "every core")


def run_by_hand(steps: int, setting: str) -> dict:
    """The master and three workers started one by one as separate commands; the job's
    steps a second and the threads each process said it took."""
    work = Path(tempfile.mkdtemp(prefix="threads_by_hand_"))
    pub, rep = free_ports(2)
    raw = {"master": {"host": "127.0.0.1", "pub_port": pub, "rep_port": rep},
           "workers": list(WORKERS),
           "model": {"family": "prodlda", "mode": "sync", "n_topics": 50, "vocab_size": 2000,
                     "eval_every": 10 ** 9, "sync_batch_norm": True},
           "rounds": 5 * steps, "min_workers": len(WORKERS), "checkpoint_every": 500,
           "data": {"path": str(ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"),
                    "limit": 3000, "partition": "iid"},
           "output_dir": str(work / "out"), "baselines": False, "seed": 0}
    cfg = work / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    cores = os.cpu_count() or 1
    procs = []
    try:
        for i, name in enumerate(("master", *WORKERS)):
            args = (("master", "--config", str(cfg)) if name == "master" else
                    ("worker", "--config", str(cfg), "--id", name))
            threads = {"defaults": None, "every core": cores,
                       "before": cores if name == "master" else max(1, cores // i)}[setting]
            extra = ("--threads", str(threads)) if threads else ()
            log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(fedctl_command(*args, *extra, "--log-level",
                                                          "debug"),
                                           cwd=ROOT, env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
            time.sleep(0.5)  # one terminal after another
        codes = [p.wait(timeout=900) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    if any(codes):
        sys.exit(f"a process failed ({codes}); logs in {work}")
    rounds = [e for e in map(json.loads, (work / "out" / "metrics.jsonl").open())
              if e["event"] == "round"]
    told = {}
    for name in ("master", *WORKERS):
        text = (work / f"{name}.log").read_text(errors="replace")
        line = next((ln for ln in text.splitlines() if "CPU threads" in ln), "")
        told[name] = line.split("CPU threads", 1)[-1].strip(" :") if line else "-"
    return {"setting": setting, "steps": len(rounds) // 5,
            "steps_per_s": len(rounds) / 5 / sum(e["duration_s"] for e in rounds),
            "threads": told, "load_before": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    runs = [run_by_hand(args.steps, s) for _ in range(args.repeats) for s in SETTINGS]
    rows = []
    for s in SETTINGS:
        mine = [r for r in runs if r["setting"] == s]
        rows.append(f"| {s} | {median_range([r['steps_per_s'] for r in mine], 1)} | "
                    f"{mine[-1]['threads']['master']} | {mine[-1]['threads']['w1']} | "
                    f"{mine[-1]['threads']['w3']} |")
    text = "\n".join([
        "# A cluster started by hand: default threads against every core", "",
        f"`{command_line(ROOT)}` (commit {current_commit(ROOT)})", "",
        __doc__.split("\n\n", 1)[1].split("\n\nUsage")[0], "",
        f"{usable_cores()} cores, {args.repeats} runs of each setting in turns, "
        f"{args.steps} steps a run; load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after. Steps a second: median (min–max).", "",
        "| setting | steps a second | master's threads | w1's (started first) | w3's (last) |",
        "|---|---|---|---|---|", *rows, ""])
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "threads_by_hand.md").write_text(text)
    (args.results / "threads_by_hand.json").write_text(json.dumps(runs, indent=1))
    print(text)


if __name__ == "__main__":
    main()
