"""What `fedctl run` costs before and around training: forked processes against fresh interpreters.

`fedctl run` forks its master and workers from a fork server that imported torch, torch._dynamo
(which torch.optim loads on an optimizer's first use) and scikit-learn once; with
``FEDCTL_FORK=0`` each starts a fresh interpreter and imports them itself (about 4 s of CPU
each). This benchmark runs the bundled default job (cluster.yaml: a master and 3 workers, the
MLP, the embedding cache already filled) for a few rounds both ways, alternating, and reports
per way the wall time of the whole command and the CPU the whole machine spent meanwhile
(``/proc/stat``: every process, the fork server's children too).

Run from the repository root (after `make demo`, so that the embeddings are cached):

    .venv/bin/python benchmarks/run_startup.py [--repeats 5] [--rounds 2] [--out DIR]

Writes ``run_startup.{md,json}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"forked (default)": "1", "fresh interpreters (FEDCTL_FORK=0)": "0"}


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has spent (user, nice, system, irq, softirq)."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = fh.readline().split()[1:]
    ticks = sum(int(fields[i]) for i in (0, 1, 2, 5, 6))
    return ticks / os.sysconf("SC_CLK_TCK")


def one_run(fork: str, rounds: int, out: Path) -> tuple[float, float]:
    """Wall seconds and machine CPU seconds of one `fedctl run`."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, FEDCTL_FORK=fork)
    cmd = [sys.executable, "-m", "fedctl.cli", "run", "--config", str(ROOT / "cluster.yaml"),
           "--rounds", str(rounds), "-o", str(out), "--no-progress", "--overwrite"]
    cpu0, t0 = machine_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, machine_cpu_s() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"fedctl run failed (FEDCTL_FORK={fork}):\n{proc.stderr[-3000:]}")
    return wall, cpu


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per way (alternating)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the default job")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way, fork in WAYS.items():
                runs[way].append(one_run(fork, args.rounds, Path(tmp) / "run"))
                print(f"run {i + 1}/{args.repeats}, {way}: {runs[way][-1][0]:.1f} s, "
                      f"{runs[way][-1][1]:.1f} CPU-s", file=sys.stderr)
    header = (f"`fedctl run` of the default job (cluster.yaml: master + 3 workers, MLP), "
              f"{args.rounds} rounds, embeddings cached; {args.repeats} runs per way, "
              f"alternating; median (min–max); {os.cpu_count()} cores, load "
              f"{load:.2f} at the start.\n\n"
              f"Command: `.venv/bin/python benchmarks/run_startup.py --repeats {args.repeats} "
              f"--rounds {args.rounds}`\n")
    rows = ["| processes started | wall, s | CPU of the machine, s |", "|---|---|---|"]
    rows += [f"| {way} | {_cell([w for w, _ in r])} | {_cell([c for _, c in r])} |"
             for way, r in runs.items()]
    report = header + "\n" + "\n".join(rows) + "\n"
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run_startup.md").write_text(report, encoding="utf-8")
    (args.out / "run_startup.json").write_text(json.dumps(
        {"rounds": args.rounds, "repeats": args.repeats, "load": load,
         "runs": {way: [{"wall_s": w, "cpu_s": c} for w, c in r] for way, r in runs.items()}},
        indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
