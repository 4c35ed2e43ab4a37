"""Robust aggregation against one hostile worker on a real cluster (issue 27's acceptance).

The default job (``cluster.yaml``: the mlp classifier on data/dbpedia_10k, one-vs-rest
MeanOfTransportation, Dirichlet α = 0.5 partition, 20 rounds, seed 0) split among five workers
w1..w5, with ``security: {mode: none}`` (loopback only), ``baselines: false``, its own output
folder and free ports. For each strategy (FedAvg; FedMedian; trimmed mean, β = 0.2; Krum,
f = 1) the job runs once clean (five ``fedctl worker``) and once per attack, with w5 replaced by
the test-only poisoning worker ``python -m tests.poisoner --attack X``, which trains honestly on
its share, then sends instead:

* ``signflip``: ``global − 10·u`` (its update ``u`` reversed, ten times as far);
* ``noise``: ``global + g``, Gaussian noise of the update's own norm;
* ``shift``: ``new + 1`` on every parameter.

The master (``fedctl master --config ...``) and each worker (``fedctl worker --config ... --id
wN --threads 1``) run as separate processes over TCP loopback; embeddings come from the user's
cache (the first run's w1 log must say "cache hit", or the run is reported as embedding).

Per run: the score, i.e. the mean over the honest workers w1..w4 of the federated macro-F1 in
``summary.json`` (each worker's own held-out test documents, scored with the final global
model), the poisoner's own share left aside so that clean and attacked runs are scored on the
same documents; its difference from the same strategy's clean run; and what the master's own
screening (:mod:`master.screening`: an update over 20x the round's median distance, or an
aggregate whose norm grows past 100x, is left out) removed, from the ``left_out`` events of
``metrics.jsonl`` and the master log's "left out" / "refused" lines, so that a run where the
screening, not the strategy, stopped the poisoner says so.

Usage: ``python benchmarks/robust.py [--strategies fedavg,fedmedian,fedtrimmedavg,krum]
[--attacks signflip,noise,shift] [--work DIR]``. Writes ``benchmarks/results/robust.{md,json,
png}`` (``--results`` elsewhere).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.net.transport import free_ports  # noqa: E402
from common.runlog import read_metrics  # noqa: E402
from fedctl.bench.report import command_line  # noqa: E402
from fedctl.launch import child_env, fedctl_command  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_JOB = ROOT / "cluster.yaml"
WORKERS = ("w1", "w2", "w3", "w4", "w5")
HONEST = WORKERS[:-1]  # scored; w5 is the one that turns hostile
HOSTILE = WORKERS[-1]
RUN_TIMEOUT_S = 900  # a run still going this long after its start is a hang
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg"},
    "fedmedian": {"name": "fedmedian"},
    "fedtrimmedavg": {"name": "fedtrimmedavg", "beta": 0.2},
    "krum": {"name": "krum", "num_malicious_clients": 1},
}
LABELS = {"fedavg": "FedAvg", "fedmedian": "FedMedian", "fedtrimmedavg": "trimmed mean (β 0.2)",
          "krum": "Krum (f = 1)"}
ATTACKS = ("signflip", "noise", "shift")
ROBUST_TOLERANCE = 0.01  # acceptance: a robust rule within 1 point of its clean run


def source_state() -> dict[str, Any]:
    """The commit the processes run and what differs from it (``git status --porcelain``)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD") or None,
            "changes": [ln for ln in git("status", "--porcelain").splitlines() if ln]}


def write_config(folder: Path, strategy: dict[str, Any]) -> Path:
    """The default job for five workers, on free ports, writing into ``folder/out``."""
    raw = yaml.safe_load(DEFAULT_JOB.read_text())
    pub, rep = free_ports(2)
    raw["master"] = {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                     "rep_port": rep}
    raw["workers"] = [{"name": w} for w in WORKERS]
    raw["strategy"] = copy.deepcopy(strategy)
    raw["security"] = {"mode": "none"}
    raw["baselines"] = False
    raw["output_dir"] = str(folder / "out")
    # Relative paths are relative to the config file: this one lives elsewhere.
    raw["data"]["path"] = str((DEFAULT_JOB.parent / raw["data"]["path"]).resolve())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_job(folder: Path, cfg: Path, attack: str | None) -> dict[str, Any]:
    """One run: the master, w1..w4 honest, w5 honest (``attack`` None) or the poisoner."""
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = child_env(threads=1)  # the user's embedding cache
    commands = {"master": fedctl_command("master", "--config", str(cfg))}
    for w in WORKERS:
        if w == HOSTILE and attack:
            commands[w] = [sys.executable, "-m", "tests.poisoner", "--config", str(cfg),
                           "--id", w, "--attack", attack]
        else:
            commands[w] = fedctl_command("worker", "--config", str(cfg), "--id", w,
                                         "--threads", "1")
    procs: dict[str, subprocess.Popen] = {}
    t0 = time.monotonic()
    error = None
    try:
        for name, cmd in commands.items():
            with open(logs / f"{name}.log", "wb") as fh:
                procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh,
                                               stderr=subprocess.STDOUT)
        for name, p in procs.items():
            try:
                p.wait(timeout=max(0.1, RUN_TIMEOUT_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                error = f"{name} still running {RUN_TIMEOUT_S} s after the run's start"
                break
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    wall = time.monotonic() - t0
    out = folder / "out"
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    events = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    text = {n: (logs / f"{n}.log").read_text(errors="replace") for n in commands}
    f1 = {}
    if summary:
        f1 = {r["worker"]: r.get("federated_macro_f1") for r in summary.get("comparison", [])}
    honest = [f1.get(w) for w in HONEST]
    left_out = [{"round": e["round"], "worker": e["worker"], "reason": e["reason"]}
                for e in events if e["event"] == "left_out"]
    return {
        "attack": attack, "dir": str(folder), "error": error, "wall_s": wall,
        "exit_codes": {n: p.returncode for n, p in procs.items()},
        "rounds": sum(e["event"] == "round" for e in events),
        "score": float(np.mean(honest)) if honest and None not in honest else None,
        "macro_f1": f1,
        "left_out": left_out,
        "left_out_rounds": {w: sorted(e["round"] for e in left_out if e["worker"] == w)
                            for w in sorted({e["worker"] for e in left_out})},
        "refused": summary.get("refused") if summary else None,
        "excluded": summary.get("excluded") if summary else None,
        "master_lines": [ln.strip() for ln in text["master"].splitlines()
                         if re.search(r"left out|refused|excluded", ln)],
        "poisoned_rounds": len(re.findall(r"sent a \w+ update", text[HOSTILE])),
        "cache_hit": {n: "cache hit" in t for n, t in text.items() if n != "master"},
        "embedded": {n: bool(re.search(r"embedding \d+ texts", t)) for n, t in text.items()},
        "traceback": [n for n, t in text.items() if "Traceback" in t],
    }


def caught(r: dict[str, Any]) -> str:
    """What the master's screening removed: '' (nothing) or 'w5 in 20/20 rounds (distance)'."""
    parts = []
    for w, rounds in r["left_out_rounds"].items():
        reasons = {e["reason"] for e in r["left_out"] if e["worker"] == w}
        kinds = sorted({"aggregate norm" if "aggregate" in why else
                        "not finite" if "not finite" in why else "distance" for why in reasons})
        parts.append(f"{w} in {len(rounds)}/{r['rounds']} rounds ({', '.join(kinds)})")
    return "; ".join(parts)


def fmt(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def cell(r: dict[str, Any], clean: dict[str, Any] | None) -> str:
    if r["score"] is None:
        return f"— ({r['error'] or 'no summary'})"
    if clean is None or clean is r or clean["score"] is None:
        return fmt(r["score"])
    return f"{fmt(r['score'])} ({100 * (r['score'] - clean['score']):+.2f})"


def plot(results: dict[str, dict[str, Any]], attacks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["clean", *attacks]
    colors = {"clean": "#4c72b0", "signflip": "#dd8452", "noise": "#55a868", "shift": "#c44e52"}
    names = {"clean": "clean (5 honest)", "signflip": "w5 sign flip ×10",
             "noise": "w5 Gaussian noise", "shift": "w5 shift +1"}
    strategies = list(results)
    width = 0.8 / len(kinds)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    scores = []
    for i, kind in enumerate(kinds):
        xs = np.arange(len(strategies)) + (i - (len(kinds) - 1) / 2) * width
        ys = [results[s]["runs"].get(kind, {}).get("score") for s in strategies]
        ys = [np.nan if y is None else y for y in ys]
        scores += [y for y in ys if np.isfinite(y)]
        bars = ax.bar(xs, ys, width, label=names.get(kind, kind), color=colors.get(kind))
        for b, y in zip(bars, ys, strict=True):
            if np.isfinite(y):
                ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.3f}", ha="center",
                        va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(np.arange(len(strategies)), [LABELS.get(s, s) for s in strategies])
    ax.set_xlabel("aggregation strategy")
    ax.set_ylabel("final macro-F1 (mean over honest w1..w4)")
    lo = min(scores, default=0.0)
    ax.set_ylim(max(0.0, lo - 0.1) if lo > 0.5 else 0.0, 1.1)
    ax.set_title("Default job, 5 workers, w5 hostile: final macro-F1 by strategy and attack")
    ax.legend(loc="upper center", ncol=len(kinds), fontsize=8, framealpha=0.95)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the runs' configs, outputs and logs (default: a new one "
                         "under the temporary folder)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    command = command_line(ROOT)
    strategies = args.strategies.split(",")
    attacks = [a for a in args.attacks.split(",") if a]
    work = args.work or Path(tempfile.mkdtemp(prefix="robust_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder (configs, outputs, logs): {work}", flush=True)
    source = source_state()
    print(f"code: {ROOT} at {source['commit']}, changes {source['changes']}", flush=True)
    t_all = time.monotonic()
    results: dict[str, Any] = {}
    first = True
    for s in strategies:
        runs: dict[str, Any] = {}
        for kind in ["clean", *attacks]:
            folder = work / s / kind
            cfg = write_config(folder, STRATEGIES[s])
            r = run_job(folder, cfg, None if kind == "clean" else kind)
            if first and not r["cache_hit"].get("w1"):
                print("WARNING: the first run's w1 log has no 'cache hit': it embedded",
                      flush=True)
            first = False
            runs[kind] = r
            print(f"{s} {kind}: score {fmt(r['score'])}, {r['rounds']} rounds, "
                  f"{r['wall_s']:.1f} s, exit {r['exit_codes']}, left out "
                  f"{caught(r) or 'none'}, error {r['error']}", flush=True)
        results[s] = {"strategy": STRATEGIES[s], "runs": runs}
    wall = time.monotonic() - t_all

    kinds = ["clean", *attacks]
    rows = [f"| {LABELS.get(s, s)} | "
            + " | ".join(cell(sr["runs"][k], sr["runs"]["clean"]) for k in kinds) + " |"
            for s, sr in results.items()]
    screen_rows = [f"| {LABELS.get(s, s)} | "
                   + " | ".join(caught(sr["runs"][k]) or "—" for k in kinds) + " |"
                   for s, sr in results.items()]
    verdict = []
    for s, sr in results.items():
        clean = sr["runs"]["clean"]["score"]
        for a in attacks:
            x = sr["runs"][a]["score"]
            if clean is None or x is None:
                ok = None
            elif s == "fedavg":
                ok = x < clean
            else:
                ok = abs(x - clean) <= ROBUST_TOLERANCE
            sr["runs"][a]["acceptance"] = ok
            verdict.append((s, a, ok))
    fedavg_falls = [a for s, a, ok in verdict if s == "fedavg" and ok]
    robust_fail = [f"{LABELS.get(s, s)} / {a}" for s, a, ok in verdict
                   if s != "fedavg" and ok is not True]
    screened = sorted({(s, k) for s, sr in results.items() for k in kinds
                       if sr["runs"][k]["left_out"]})
    screen_note = ("The master's screening left no update out in any run: every poisoned "
                   "update reached the strategy."
                   if not screened else
                   "The master's own screening (before any strategy) left updates out in: "
                   + "; ".join(f"{LABELS.get(s, s)} / {k}: {caught(results[s]['runs'][k])}"
                               for s, k in screened)
                   + ". In those runs the screening, not the strategy, removed the poisoner "
                     "(for the rounds listed), so their rows say nothing about the strategy.")
    cache = results[strategies[0]]["runs"]["clean"]["cache_hit"]
    embedded = any(v for sr in results.values() for r in sr["runs"].values()
                   for v in r["embedded"].values())
    strategy_cfg = ", ".join(f"`{json.dumps(STRATEGIES[s])}`" for s in strategies)
    lines = [
        "# Robust aggregation: one hostile worker of five (issue 27's acceptance)",
        "",
        f"`{command}`",
        "",
        f"The default job (`cluster.yaml`: mlp, hidden 256, adam lr 0.001, 1 local epoch; "
        f"data/dbpedia_10k one-vs-rest MeanOfTransportation, Dirichlet α = 0.5 partition, "
        f"test fraction 0.2; 20 rounds, seed 0) split among 5 workers w1..w5, "
        f"`security: {{mode: none}}` (loopback only; CURVE is not what is measured here), "
        f"`baselines: false`, free ports, a master and 5 worker processes (`fedctl worker "
        f"--threads 1`) per run, {len(strategies) * len(kinds)} runs one after another. "
        f"Strategies: {strategy_cfg}. "
        f"Attacks: w5 is `python -m tests.poisoner --attack X` (trains honestly, then sends "
        f"signflip: global − 10·u; noise: global + Gaussian noise of |u|; shift: new + 1 on "
        f"every parameter). Score: final macro-F1 as the mean over the honest workers w1..w4 "
        f"of `summary.json`'s federated macro-F1 (each on its own held-out test documents, "
        f"the final global model), w5's documents left aside in every run including the "
        f"clean one; Δ in points (×100) against the same strategy's clean run. Embeddings "
        f"from the user's cache (first run's worker logs say 'cache hit': "
        f"{'all' if all(cache.values()) else cache}; any run embedding: "
        f"{'yes' if embedded else 'no'}). {os.cpu_count()} CPU cores shared with other work "
        f"(load average {os.getloadavg()[0]:.1f} at the end), {wall / 60:.1f} min in all. "
        f"Code: commit {source['commit']}"
        f"{' + ' + ', '.join(source['changes']) if source['changes'] else ''} "
        f"(a checkout of its own, so that edits made meanwhile in the working tree do not "
        f"reach the runs). Work folder: `{work}`.",
        "",
        "| strategy | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
        *rows,
        "",
        "Updates the master's screening left out (`left_out` events; the poisoner sent a "
        "poisoned update every round it trained):",
        "",
        "| strategy | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
        *screen_rows,
        "",
        screen_note,
        "",
        f"Acceptance: FedAvg falls under {', '.join(fedavg_falls) or 'no attack'}"
        f"{'' if len(fedavg_falls) == len(attacks) else ' only'}; robust rules within 1 "
        f"point of their clean run: "
        f"{'all' if not robust_fail else 'not ' + ', '.join(robust_fail)}.",
    ]
    md = "\n".join(lines)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "robust.md").write_text(md + "\n")
    plot(results, attacks, args.results / "robust.png")
    res = {"command": command, "work": str(work), "wall_s": wall, "cpu_count": os.cpu_count(),
           "load_average_at_end": os.getloadavg()[0], "source": source, "workers": list(WORKERS),
           "scored_workers": list(HONEST), "hostile": HOSTILE,
           "score": "mean over w1..w4 of summary.json federated_macro_f1",
           "strategies": results}
    (args.results / "robust.json").write_text(json.dumps(res, indent=2, default=str))
    print(md)


if __name__ == "__main__":
    main()
