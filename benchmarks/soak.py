"""A long run of the default job: do memory, descriptors and round time stay flat? (issues 28, 30)

``cluster.yaml``'s job (the mlp one-vs-rest classifier on ``data/dbpedia_10k``, 3 workers,
CURVE, evaluation every round) through ``fedctl run``, as a user starts it, for ``--rounds``
rounds (default 10,000) or until ``--hours``, with free ports and ``baselines: false`` (the
local-only and centralized baselines would train for as many epochs as the run has rounds,
after it: they are not what is measured). While it runs, every ``--interval`` seconds, each
process's resident memory (``VmRSS``) and open file descriptors are read from ``/proc``: the
launcher, the master and the three workers. Each round's time comes from the master's metrics
log.

The goal (issue 28): memory, descriptors and round time flat within 5 % from the first tenth of
the run to the last (medians of each tenth; issue 30 asks the same of round time over 3,000
rounds). Writes ``benchmarks/results/soak_<rounds>.{md,json,png}``.

Usage: ``python benchmarks/soak.py [--rounds 10000] [--hours 1] [--interval 5] [--work DIR]``;
``--replot`` redraws the figure and table from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.net.transport import free_ports  # noqa: E402
from common.runlog import MetricsTail  # noqa: E402
from fedctl.bench.report import command_line, current_commit  # noqa: E402
from fedctl.launch import child_env, fedctl_command  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL = 0.05  # flat: the last tenth's median within 5 % of the first tenth's
FRESH = "a fresh worker's round (probe), CPU ms"


def children(pid: int) -> dict[str, int]:
    """The processes ``fedctl run`` (``pid``) started, by role: ``master``, ``w1``..."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid:
                continue
            args = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if b"master" in args:
            found["master"] = int(stat.parent.name)
        elif b"--id" in args:
            found[args[args.index(b"--id") + 1].decode()] = int(stat.parent.name)
    return found


TICK = os.sysconf("SC_CLK_TCK")


def sample(pid: int) -> dict[str, float] | None:
    """A process's resident memory (MiB), open descriptors and CPU time so far (s), or None
    once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = next(int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("VmRSS:"))
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
        return {"rss_mib": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "cpu_s": cpu}
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def probe() -> float:
    """CPU seconds a fixed piece of arithmetic takes now (CPU time, not wall time: the
    cluster's own processes competing for the cores do not count): whether the machine itself
    got slower (its clock, other tenants of the host), apart from anything fedctl does."""
    import numpy as np

    # Element-wise work only: numpy runs it on this thread, where a BLAS product would spread
    # over a pool whose threads spin (CPU time) while they wait for the busy cores.
    a = np.random.default_rng(0).random(200_000)
    t0 = time.process_time()
    for _ in range(20):
        a = np.tanh(a * 1.1 + 0.1)
    return time.process_time() - t0


#: The fresh round probe's work: the default job's model (cluster.yaml: hidden 256, batch 64,
#: one epoch) on as many rows as its largest worker holds (2,835 of dbpedia_10k's 14 classes).
PROBE_ROWS, PROBE_DIM, PROBE_CLASSES, PROBE_HIDDEN = 2835, 384, 14, 256


def probe_round() -> float:
    """CPU seconds a *fresh* worker's round takes now: the default job's model built anew and
    trained one epoch on fixed rows, on one torch thread as each worker trains. The same work
    as a long-lived worker's round, with nothing carried over from earlier rounds, measured on
    the same machine at the same moment: a long-lived worker slower against it has
    accumulated something; both slower together is the machine."""
    import numpy as np
    import torch

    from common.models.mlp import MLPClassifier

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((PROBE_ROWS, PROBE_DIM)).astype(np.float32)
    y = rng.integers(0, PROBE_CLASSES, PROBE_ROWS)
    t0 = time.process_time()
    MLPClassifier(PROBE_DIM, PROBE_CLASSES, hidden=PROBE_HIDDEN, batch_size=64).fit(X, y)
    return time.process_time() - t0


def soak(work: Path, rounds: int, hours: float, interval: float) -> dict[str, Any]:
    out = work / "run"
    pub, rep = free_ports(2)
    cmd = fedctl_command("run", "--config", str(ROOT / "cluster.yaml"), "--rounds",
                         str(rounds), "--output", str(out), "--no-progress", "--set",
                         "baselines=false", "--set", f"master.pub_port={pub}", "--set",
                         f"master.rep_port={rep}", "--set", f"security.keys_dir={work / 'keys'}")
    log = open(work / "fedctl-run.log", "w")  # noqa: SIM115 - closed below
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    samples: list[dict[str, Any]] = []
    tail = MetricsTail(out.with_name(out.name + ".partial") / "metrics.jsonl")
    done = 0
    deadline = t0 + 3600 * hours
    stopped_early = False
    while proc.poll() is None:
        time.sleep(interval)
        done += sum(e["event"] == "round" for e in tail.new_events())
        row: dict[str, Any] = {"t": time.monotonic() - t0, "rounds_done": done,
                               "probe_s": probe(), "round_probe_s": probe_round()}
        for role, pid in {"launcher": proc.pid, **children(proc.pid)}.items():
            got = sample(pid)
            if got is not None:
                row[role] = got
        samples.append(row)
        if time.monotonic() > deadline and not stopped_early:
            stopped_early = True  # the time is up: stop it as a user would, by Ctrl-C
            proc.send_signal(2)
    log.close()
    if proc.wait() != 0 and not stopped_early:
        raise SystemExit(f"fedctl run failed ({proc.returncode}): see {work / 'fedctl-run.log'}")
    metrics = next(p / "metrics.jsonl" for p in (out, out.with_name(out.name + ".partial"),
                                                  out.with_name(out.name + ".failed"))
                    if (p / "metrics.jsonl").exists())
    events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rounds_ev = [e for e in events if e["event"] == "round"]
    workers = [e for e in events if e["event"] == "worker_round"]
    return {"rounds_asked": rounds, "rounds": len(rounds_ev), "stopped_by_time": stopped_early,
            "wall_s": time.monotonic() - t0, "interval_s": interval, "samples": samples,
            "round_s": [e["duration_s"] for e in rounds_ev],
            "train_s": {w: [e["train_time"] for e in workers if e["worker"] == w]
                        for w in sorted({e["worker"] for e in workers})}}


def tenths(xs: list[float]) -> tuple[float, float]:
    """Medians of the first and of the last tenth of ``xs``."""
    k = max(1, len(xs) // 10)
    return st.median(xs[:k]), st.median(xs[-k:])


def series(res: dict[str, Any]) -> dict[str, list[float]]:
    """Every figure compared, in the order it was sampled."""
    out = {"round time, ms": [1000 * x for x in res["round_s"]]}
    for w, xs in res["train_s"].items():
        out[f"{w} training, ms"] = [1000 * x for x in xs]
    for what, key in (("RSS, MiB", "rss_mib"), ("open descriptors", "fds")):
        for r, xs in sampled(res, key).items():
            out[f"{r} {what}"] = [x for _, x in xs]
    for r, xs in sampled(res, "cpu_s").items():
        # CPU time a round between two samples: what the process did, however the two cores
        # were shared out meanwhile.
        out[f"{r} CPU a round, ms"] = [1000 * (c1 - c0) / (n1 - n0) for (n0, c0), (n1, c1)
                                       in zip(xs, xs[1:], strict=False) if n1 > n0]
    probes = [s["probe_s"] for s in res["samples"]
              if 0 < s["rounds_done"] < res["rounds"] and "probe_s" in s]
    if probes:
        out["the machine: fixed probe, CPU ms"] = [1000 * x for x in probes]
    fresh = [s["round_probe_s"] for s in res["samples"]
             if 0 < s["rounds_done"] < res["rounds"] and "round_probe_s" in s]
    if fresh:
        out[FRESH] = [1000 * x for x in fresh]
    return out


def sampled(res: dict[str, Any], key: str) -> dict[str, list[tuple[int, float]]]:
    """Each process's ``key`` as (rounds done, value), over the rounds only: start-up (imports,
    embeddings) and the closing reports are not what a long run accumulates."""
    out: dict[str, list[tuple[int, float]]] = {}
    for s in res["samples"]:
        if not 0 < s["rounds_done"] < res["rounds"]:
            continue
        for r in ("master", "w1", "w2", "w3", "launcher"):
            if key in s.get(r, {}):
                out.setdefault(r, []).append((s["rounds_done"], s[r][key]))
    return out


def table(res: dict[str, Any]) -> list[str]:
    lines = ["| figure | first tenth (median) | last tenth (median) | change | within 5 % |",
             "|---|---|---|---|---|"]
    s = series(res)
    probe = s.get("the machine: fixed probe, CPU ms", [])
    for name, xs in s.items():
        if len(xs) < 10:
            continue
        a, b = tenths(xs)
        change = (b - a) / a if a else 0.0
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {100 * change:+.1f} % | "
                     f"{'yes' if abs(change) <= GOAL else '**no**'} |")
    if len(probe) >= 10 and res.get("probe", "elementwise") == "elementwise":
        # What a figure did beyond the machine's own change of speed over the run. (Runs
        # whose probe was a BLAS product are not divided: its spinning pool threads count as
        # CPU time when the cores are busy, so it measured contention too.)
        pa, pb = tenths(probe)
        for name, xs in s.items():
            if len(xs) >= 10 and ("CPU a round" in name or name == "round time, ms") \
                    and "launcher" not in name:
                a, b = tenths(xs)
                change = (b / pb) / (a / pa) - 1 if a and pa else 0.0
                lines.append(f"| {name} ÷ the machine's probe | {a / pa:.3f} | {b / pb:.3f} | "
                             f"{100 * change:+.1f} % | "
                             f"{'yes' if abs(change) <= GOAL else '**no**'} |")
    fresh = s.get(FRESH, [])
    if len(fresh) >= 10:
        # The same work done fresh at the same moments: what a long-lived process did beyond
        # anything the machine did to all work of its kind.
        fa, fb = tenths(fresh)
        for name, xs in s.items():
            if len(xs) >= 10 and name != FRESH and (
                    name == "round time, ms" or name.endswith("training, ms")
                    or ("CPU a round" in name and name[:1] == "w")):
                a, b = tenths(xs)
                change = (b / fb) / (a / fa) - 1 if a and fa else 0.0
                lines.append(f"| {name} ÷ a fresh worker's round | {a / fa:.3f} | "
                             f"{b / fb:.3f} | {100 * change:+.1f} % | "
                             f"{'yes' if abs(change) <= GOAL else '**no**'} |")
    return lines


def plot(path: Path, res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = series(res)
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=False)
    rounds = np.arange(1, len(s["round time, ms"]) + 1)
    window = max(1, len(rounds) // 100)
    ax = axes[0]
    for name, xs in s.items():
        if name == "round time, ms" or name.endswith("training, ms"):
            smooth = np.convolve(xs, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window, len(xs) + 1), smooth, label=name, lw=1)
    fresh = [(x["rounds_done"], 1000 * x["round_probe_s"]) for x in res["samples"]
             if 0 < x["rounds_done"] < res["rounds"] and "round_probe_s" in x]
    if fresh:  # the same work done fresh at each sample: the machine's own drift
        ax.plot([a for a, _ in fresh], [b for _, b in fresh], color="0.4", ls="--", lw=1,
                label="a fresh worker's round (probe), CPU ms")
    ax.set_xlabel("round")
    ax.set_ylabel(f"ms (mean of {window} rounds)")
    ax.set_title(f"{res['rounds']:,} rounds of the default job: round and training times")
    ax.legend(frameon=False, fontsize=8, ncol=2)
    ax.set_ylim(bottom=0)
    for ax, key, label in ((axes[1], "rss_mib", "resident memory, MiB"),
                           (axes[2], "fds", "open file descriptors")):
        for role, xs in sampled(res, key).items():
            ax.plot([a for a, _ in xs], [b for _, b in xs], label=role, lw=1.2)
        ax.set_xlabel(f"rounds done (sampled every {res['interval_s']:g} s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.set_xlim(0, res["rounds"])
        # between the lines: RSS runs at some hundreds of MiB, descriptors at 3, 21 and 37
        ax.legend(frameon=False, fontsize=8, ncol=5, loc="center right",
                  bbox_to_anchor=(1.0, 0.5 if key == "rss_mib" else 0.3))
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(res: dict[str, Any], results: Path) -> None:
    name = f"soak_{res['rounds_asked']}"
    (results / f"{name}.json").write_text(json.dumps(res))
    plot(results / f"{name}.png", res)
    lines = [f"# Soak: {res['rounds']:,} rounds of the default job", "",
             f"`{res['command']}`", "",
             f"`fedctl run` of `cluster.yaml` (mlp, 3 workers as processes, CURVE, evaluation "
             f"every round), `baselines: false`; {res['rounds']:,} rounds "
             f"{'(stopped at the time limit) ' if res['stopped_by_time'] else ''}in "
             f"{res['wall_s'] / 60:.1f} min; /proc sampled every {res['interval_s']:g} s "
             f"({len(res['samples'])} samples). Load average before: "
             f"{res['load_before'][0]:.2f}; commit {res['commit']}. Each figure: the median of "
             "the first tenth of the run against that of the last tenth (rounds for times, "
             "samples for memory and descriptors); the goal is a change within 5 %. *CPU a "
             "round*: a process's CPU time (user + system) between two samples over the rounds "
             "done meanwhile, which does not depend on how the 2 cores were shared; *the "
             "machine*: a fixed piece of numpy arithmetic timed at each sample (its CPU time), "
             "which moves only if the machine itself got faster or slower (other tenants of "
             "the host); *÷ the machine's probe*: a figure relative to it, what is left once "
             "the machine's own change is taken out; *a fresh worker's round*: the default "
             "job's model built anew and trained one epoch on fixed rows at each sample (CPU "
             "time, one torch thread), the same work with nothing carried over, and *÷ a fresh "
             "worker's round* a figure relative to it. The launcher's CPU a round is under a "
             "clock tick (10 ms) between samples: its change says nothing.", "",
             *table(res), "", *([res["note"], ""] if res.get("note") else []),
             f"![soak]({name}.png)", ""]
    (results / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(table(res)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10_000)
    ap.add_argument("--hours", type=float, default=1.0, help="stop by then (default 1)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="redraw the table and figure from a results JSON")
    ap.add_argument("--note", default=None,
                    help="a paragraph for the report (what else ran meanwhile), kept in the JSON")
    args = ap.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    if args.replot:
        res = json.loads(args.replot.read_text())
        if args.note:
            res["note"] = args.note
        report(res, args.results)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    commit = current_commit(ROOT)  # what runs
    res = soak(work, args.rounds, args.hours, args.interval)
    res.update(command=command_line(ROOT), load_before=load, commit=commit, note=args.note,
               probe="elementwise")
    report(res, args.results)


if __name__ == "__main__":
    main()
