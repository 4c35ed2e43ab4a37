"""Robust aggregation against one hostile worker on a real cluster (issue 27's acceptance).

The default job (``cluster.yaml``: the mlp classifier on data/dbpedia_10k, one-vs-rest
MeanOfTransportation, Dirichlet α = 0.5 partition, 20 rounds) split among five workers
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

Every cell runs once per seed (``--seeds``, default 0, 1, 2: the job's ``seed``, which draws
the partition, the test split and the initial model; nothing else changes), seed by seed: all
runs of the first seed, then the next. The table gives per cell the mean score over the seeds
with its min–max, and Δ against the same strategy's clean run of the same seed, averaged over
the seeds, with the min–max of the per-seed Δ; the acceptance is judged on that seed-mean Δ
(one seed is too noisy for a 1-point comparison: a run whose screening removed the poisoner
entirely differed from its clean run by 1.4 points). The results are rewritten after every
finished seed, so that a run cut short leaves the seeds it finished.

Usage: ``python benchmarks/robust.py [--strategies fedavg,fedmedian,fedtrimmedavg,krum]
[--attacks signflip,noise,shift] [--seeds 0,1,2] [--work DIR]``. Writes
``benchmarks/results/robust.{md,json,png}`` (``--results`` elsewhere); the png shows per attack
the seed-mean Δ of each strategy as a bar, each seed's Δ as a dot, and the ±1 point band.
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
    # Not in the acceptance's list; run on its own (--strategies multikrum): Krum's choice
    # averaged over the 3 most central updates.
    "multikrum": {"name": "krum", "num_malicious_clients": 1, "num_clients_to_keep": 3},
    # The robust rules with nearest-neighbour mixing first (f = 1): --strategies
    # fedavg,fedmedian_mix,fedtrimmedavg_mix,krum_mix --name robust_mixing
    "fedmedian_mix": {"name": "fedmedian", "num_malicious_clients": 1, "mixing": True},
    "fedtrimmedavg_mix": {"name": "fedtrimmedavg", "beta": 0.2, "num_malicious_clients": 1,
                          "mixing": True},
    "krum_mix": {"name": "krum", "num_malicious_clients": 1, "mixing": True},
}
LABELS = {"fedavg": "FedAvg", "fedmedian": "FedMedian", "fedtrimmedavg": "trimmed mean (β 0.2)",
          "krum": "Krum (f = 1)", "multikrum": "Multi-Krum (f = 1, m = 3)",
          "fedmedian_mix": "FedMedian, mixed (f = 1)",
          "fedtrimmedavg_mix": "trimmed mean (β 0.2), mixed (f = 1)",
          "krum_mix": "Krum, mixed (f = 1)"}
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


def write_config(folder: Path, strategy: dict[str, Any], seed: int) -> Path:
    """The default job for five workers with ``seed``, on free ports, writing into
    ``folder/out``."""
    raw = yaml.safe_load(DEFAULT_JOB.read_text())
    pub, rep = free_ports(2)
    raw["master"] = {"host": "127.0.0.1", "bind": "127.0.0.1", "pub_port": pub,
                     "rep_port": rep}
    raw["workers"] = [{"name": w} for w in WORKERS]
    raw["strategy"] = copy.deepcopy(strategy)
    raw["security"] = {"mode": "none"}
    raw["baselines"] = False
    raw["seed"] = seed
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


def pooled_f1(out: Path) -> float | None:
    """Macro-F1 of the run's final model on the honest workers' test documents pooled (a
    steadier figure than the mean of per-worker scores: a worker's test split may hold a
    handful of positives, or none, where one document moves its macro-F1 by points)."""
    from common.config import load_config
    from common.data.shards import local_data, sentence_features
    from fedctl.inference import load_model

    if not (out / "model.npz").exists():
        return None
    model = load_model(out)
    cfg = load_config(out / "cluster.yaml")
    X, y = [], []
    for w in HONEST:
        d = local_data(cfg, w)
        to_model = np.array([model.classes_.index(c) for c in d.classes])
        X.append(sentence_features(cfg, d.dataset)[d.test_index])
        y.append(to_model[d.y_test])
    return float(model.model_.score(np.concatenate(X), np.concatenate(y))["macro_f1"])


def pooled_report(saved: Path, out: Path, name: str = "robust") -> str:
    """``{name}_pooled.md`` from a finished run's ``{name}.json`` (its run folders must still
    exist): each run's :func:`pooled_f1`, and per strategy and attack the seed-mean Δ in points
    against the same seed's clean run [min … max]."""
    res = json.loads(saved.read_text())
    strategies, seeds = res["strategies"], [str(x) for x in res["seeds_done"]]
    kinds = list(next(iter(strategies.values()))["runs"])
    score = {(s, k, seed): pooled_f1(Path(sr["runs"][k][seed]["dir"]) / "out")
             for s, sr in strategies.items() for k in kinds for seed in seeds}
    rows = []
    for s in strategies:
        cells = []
        for k in kinds:
            v = [score[s, k, seed] for seed in seeds if score[s, k, seed] is not None]
            text = f"{np.mean(v):.4f}" if v else "—"
            d = [100 * (score[s, k, seed] - score[s, "clean", seed]) for seed in seeds
                 if score[s, k, seed] is not None and score[s, "clean", seed] is not None]
            if k != "clean" and d:
                text += f", Δ **{np.mean(d):+.2f}** [{min(d):+.2f} … {max(d):+.2f}]"
            cells.append(text)
        rows.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    md = "\n".join([
        "# Robust aggregation, scored on the pooled test documents", "",
        f"`{command_line(ROOT)}`", "",
        f"The runs of [{name}.md]({name}.md) (`{res['command']}`, seeds {', '.join(seeds)}), "
        f"scored again: the final model's macro-F1 on the test documents of {', '.join(HONEST)} "
        f"pooled, where {name}.md averages each worker's own. Δ in points against the same "
        f"seed's clean run, mean [min … max] over the seeds.", "",
        "| strategy | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds), *rows, ""])
    (out / f"{name}_pooled.md").write_text(md + "\n")
    (out / f"{name}_pooled.json").write_text(json.dumps(
        {"|".join(k): v for k, v in score.items()}, indent=1))
    return md


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


def seed_list(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (no repeats, order kept)."""
    seeds: list[int] = []
    for part in text.split(","):
        if part.strip() and int(part) not in seeds:
            seeds.append(int(part))
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds: at least one seed")
    return seeds


def deltas(results: dict[str, Any], s: str, kind: str) -> dict[int, float]:
    """Per seed: Δ in points of ``kind`` against the same strategy's clean run of that seed
    (only seeds where both runs have a score)."""
    runs = results[s]["runs"]
    out = {}
    for seed, r in runs.get(kind, {}).items():
        c = runs.get("clean", {}).get(seed)
        if r["score"] is not None and c is not None and c["score"] is not None:
            out[seed] = 100 * (r["score"] - c["score"])
    return out


def scores(results: dict[str, Any], s: str, kind: str) -> dict[int, float]:
    return {seed: r["score"] for seed, r in results[s]["runs"].get(kind, {}).items()
            if r["score"] is not None}


def failures(results: dict[str, Any], s: str, kind: str) -> str:
    bad = [f"seed {seed}: {r['error'] or 'no summary'}"
           for seed, r in results[s]["runs"].get(kind, {}).items() if r["score"] is None]
    return "; ".join(bad)


def cell(results: dict[str, Any], s: str, kind: str, n_seeds: int) -> str:
    """``mean [min–max]`` of the score, and for an attack ``Δ mean [min…max]`` in points."""
    sc = scores(results, s, kind)
    if not sc:
        return f"— ({failures(results, s, kind) or 'no run'})"
    v = list(sc.values())
    text = fmt(float(np.mean(v)))
    if len(v) > 1:
        text += f" [{min(v):.4f}–{max(v):.4f}]"
    if kind != "clean":
        d = list(deltas(results, s, kind).values())
        if d:
            text += f", Δ **{np.mean(d):+.2f}**"
            if len(d) > 1:
                text += f" [{min(d):+.2f} … {max(d):+.2f}]"
    if len(v) < n_seeds:
        text += f" (n = {len(v)}: {failures(results, s, kind)})"
    return text


def caught_all(results: dict[str, Any], s: str, kind: str) -> str:
    """What the screening removed over the seeds: 'w5 60/60 rounds, 3/3 seeds (distance)'."""
    runs = list(results[s]["runs"].get(kind, {}).values())
    workers = sorted({w for r in runs for w in r["left_out_rounds"]})
    parts = []
    for w in workers:
        out = sum(len(r["left_out_rounds"].get(w, [])) for r in runs)
        total = sum(r["rounds"] for r in runs)
        hit = sum(bool(r["left_out_rounds"].get(w)) for r in runs)
        reasons = {e["reason"] for r in runs for e in r["left_out"] if e["worker"] == w}
        kinds = sorted({"aggregate norm" if "aggregate" in why else
                        "not finite" if "not finite" in why else "distance"
                        for why in reasons})
        parts.append(f"{w} in {out}/{total} rounds, {hit}/{len(runs)} seeds "
                     f"({', '.join(kinds)})")
    return "; ".join(parts)


def acceptance(results: dict[str, Any], attacks: list[str]) -> list[tuple[str, str, bool | None]]:
    """Per (strategy, attack), on the seed-mean Δ: FedAvg falls (more than 1 point under its
    clean run); a robust rule stays within 1 point of its clean run."""
    verdict = []
    for s in results:
        for a in attacks:
            d = list(deltas(results, s, a).values())
            if not d:
                ok = None
            elif s == "fedavg":
                ok = float(np.mean(d)) < -100 * ROBUST_TOLERANCE
            else:
                ok = abs(float(np.mean(d))) <= 100 * ROBUST_TOLERANCE
            verdict.append((s, a, ok))
    return verdict


def plot(results: dict[str, Any], attacks: list[str], seeds: list[int], path: Path) -> None:
    """Grouped bars: per attack, the seed-mean Δ of each strategy, each seed's Δ as a dot, the
    ±1 point band; hatched where the screening left w5 out in every round of every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    strategies = list(results)
    colors = {"fedavg": "#4c72b0", "fedmedian": "#dd8452", "fedtrimmedavg": "#55a868",
              "krum": "#c44e52", "multikrum": "#8172b3", "fedmedian_mix": "#dd8452",
              "fedtrimmedavg_mix": "#55a868", "krum_mix": "#c44e52"}
    names = {"signflip": "w5 sign flip ×10", "noise": "w5 Gaussian noise",
             "shift": "w5 shift +1"}
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(10, 6.2))
    ax.axhspan(-100 * ROBUST_TOLERANCE, 100 * ROBUST_TOLERANCE, color="0.85", zorder=0,
               label="±1 point (robust acceptance)")
    ax.axhline(0, color="0.3", lw=0.8, zorder=1)
    lows = [0.0]
    for i, s in enumerate(strategies):
        xs = np.arange(len(attacks)) + (i - (len(strategies) - 1) / 2) * width
        for x, a in zip(xs, attacks, strict=True):
            d = deltas(results, s, a)
            if not d:
                continue
            m = float(np.mean(list(d.values())))
            lows += list(d.values())
            runs = results[s]["runs"][a].values()
            screened = all(r["rounds"] and len(r["left_out_rounds"].get(HOSTILE, []))
                           == r["rounds"] for r in runs)
            ax.bar(x, m, width * 0.92, color=colors.get(s), zorder=2, edgecolor="0.2",
                   linewidth=0.6, hatch="///" if screened else None, alpha=0.9)
            ax.scatter([x] * len(d), list(d.values()), s=14, color="black", zorder=3)
            end = min(m, *d.values()) if m < 0 else max(m, *d.values())
            label = f"{m:+.2f}" if abs(m) < 10 else f"{m:+.1f}"
            ax.annotate(label, (x, end), xytext=(0, -4 if m < 0 else 4),
                        textcoords="offset points", ha="center",
                        va="top" if m < 0 else "bottom", fontsize=8, zorder=4,
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                              "alpha": 0.8})
    ax.set_yscale("symlog", linthresh=3, linscale=1.5)
    lo = min(lows)
    hi = max([0.0] + [v for s in strategies for a in attacks
                      for v in deltas(results, s, a).values()])
    bottom, top = min(-4.0, lo * 1.8), max(3.5, hi * 1.8)
    ax.set_ylim(bottom, top)
    ticks = [t for t in (-100, -50, -20, -10, -5, -2, -1, 0, 1, 2, 5, 10)
             if bottom <= t <= top]
    ax.set_yticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
    ax.set_xticks(np.arange(len(attacks)), [names.get(a, a) for a in attacks])
    ax.set_ylabel("Δ final macro-F1 vs the strategy's clean run (points)\n"
                  "linear within ±3, symmetric log beyond")
    ax.set_title(f"One hostile worker of five (default job, 20 rounds): Δ per strategy, "
                 f"bar = mean over seeds {', '.join(map(str, seeds))}, dot = one seed",
                 fontsize=10)
    handles = [Patch(color=colors.get(s), label=LABELS.get(s, s)) for s in strategies]
    handles += [Patch(facecolor="white", edgecolor="0.2", hatch="///",
                      label="screening left w5 out every round"),
                Patch(color="0.85", label="±1 point band"),
                plt.Line2D([], [], marker="o", ls="", color="black", markersize=4,
                           label="one seed")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize=8,
              ncol=4, frameon=False)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def report(results: dict[str, Any], *, strategies: list[str], attacks: list[str],
           seeds: list[int], done: list[int], command: str, source: dict[str, Any],
           work: Path, wall: float, out: Path, name: str = "robust",
           load: float | None = None) -> str:
    """Write ``{name}.{md,json,png}`` in ``out`` from the seeds in ``done``; returns the md."""
    kinds = ["clean", *attacks]
    n = len(done)
    load = os.getloadavg()[0] if load is None else load  # a rewritten report keeps the run's
    rows = [f"| {LABELS.get(s, s)} | "
            + " | ".join(cell(results, s, k, n) for k in kinds) + " |" for s in results]
    seed_rows = [f"| {LABELS.get(s, s)} | {seed} | "
                 + " | ".join(fmt(results[s]["runs"][k][seed]["score"]) for k in kinds)
                 + " | " + " | ".join(
                     f"{deltas(results, s, a)[seed]:+.2f}" if seed in deltas(results, s, a)
                     else "—" for a in attacks) + " |"
                 for s in results for seed in done]
    screen_rows = [f"| {LABELS.get(s, s)} | "
                   + " | ".join(caught_all(results, s, k) or "—" for k in kinds) + " |"
                   for s in results]
    verdict = acceptance(results, attacks)
    fedavg_falls = [a for s, a, ok in verdict if s == "fedavg" and ok]
    fedavg_holds = [f"{a} ({np.mean(list(deltas(results, s, a).values())):+.2f})"
                    for s, a, ok in verdict if s == "fedavg" and ok is False]
    robust_ok = [(s, a) for s, a, ok in verdict if s != "fedavg" and ok]
    robust_fail = [f"{LABELS.get(s, s)} / {a} "
                   f"({np.mean(list(deltas(results, s, a).values())):+.2f})"
                   if deltas(results, s, a) else f"{LABELS.get(s, s)} / {a} (no score)"
                   for s, a, ok in verdict if s != "fedavg" and ok is not True]
    held = ", ".join(f"{LABELS.get(s, s)} / {a}" for s, a in robust_ok)
    screened = [(s, k) for s in results for k in kinds if caught_all(results, s, k)]
    screen_note = ("The master's screening left no update out in any run: every poisoned "
                   "update reached the strategy."
                   if not screened else
                   "The master's own screening (before any strategy) left updates out in: "
                   + "; ".join(f"{LABELS.get(s, s)} / {k}: {caught_all(results, s, k)}"
                               for s, k in screened)
                   + ". Where it left w5 out in every round, the screening, not the "
                     "strategy, removed the poisoner, so that cell says nothing about the "
                     "strategy (its Δ is that of training on 4 workers instead of 5: a run "
                     "is deterministic for its seed).")
    first = results[strategies[0]]["runs"]["clean"][done[0]]["cache_hit"]
    embedded = any(v for sr in results.values() for by_seed in sr["runs"].values()
                   for r in by_seed.values() for v in r["embedded"].values())
    strategy_cfg = ", ".join(f"`{json.dumps(STRATEGIES[s])}`" for s in strategies)
    progress = ("all requested seeds finished" if done == seeds else
                f"written after seed {done[-1]}: seeds {', '.join(map(str, done))} of the "
                f"requested {', '.join(map(str, seeds))} finished, the others are not in "
                f"this file")
    lines = [
        "# Robust aggregation: one hostile worker of five (issue 27's acceptance)",
        "",
        f"`{command}`",
        "",
        f"The default job (`cluster.yaml`: mlp, hidden 256, adam lr 0.001, 1 local epoch; "
        f"data/dbpedia_10k one-vs-rest MeanOfTransportation, Dirichlet α = 0.5 partition, "
        f"test fraction 0.2; 20 rounds) split among 5 workers w1..w5, run once per seed "
        f"(the job's `seed`: {', '.join(map(str, done))}; it draws the partition, the "
        f"test split and the model's initialisation), `security: {{mode: none}}` (loopback "
        f"only; CURVE is not what is measured here), `baselines: false`, free ports, a "
        f"master and 5 worker processes (`fedctl worker --threads 1`) per run, "
        f"{len(strategies) * len(kinds)} runs per seed one after another, seed by seed "
        f"({progress}). Strategies: {strategy_cfg}. "
        f"Attacks: w5 is `python -m tests.poisoner --attack X` (trains honestly, then sends "
        f"signflip: global − 10·u; noise: global + Gaussian noise of |u|; shift: new + 1 on "
        f"every parameter). Score: final macro-F1 as the mean over the honest workers w1..w4 "
        f"of `summary.json`'s federated macro-F1 (each on its own held-out test documents, "
        f"the final global model), w5's documents left aside in every run including the "
        f"clean one. Embeddings from the user's cache (first run's worker logs say 'cache "
        f"hit': {'all' if all(first.values()) else first}; any run embedding: "
        f"{'yes' if embedded else 'no'}). {os.cpu_count()} CPU cores shared with other work "
        f"(load average {load:.1f} at this writing), {wall / 60:.1f} min in "
        f"all. Code: commit {source['commit']}"
        f"{' + ' + ', '.join(source['changes']) if source['changes'] else ''} in `{ROOT}`. "
        f"Work folder: `{work}` (`seed<N>/<strategy>/<attack>/`).",
        "",
        f"Each cell: {f'the mean over the {n} seeds' if n > 1 else 'that seed'} of the score"
        f"{' [min–max over seeds]' if n > 1 else ''}; for an attack, Δ in points (×100) "
        f"against the same strategy's clean run, taken seed by seed (same seed's clean run) "
        f"and then averaged{' [min … max of the per-seed Δ]' if n > 1 else ''}.",
        "",
        "| strategy | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
        *rows,
        "",
        f"![Δ per strategy and attack, mean and per seed]({name}.png)",
        "",
        "Per seed (score per run; Δ in points against that seed's clean run):",
        "",
        "| strategy | seed | " + " | ".join(kinds) + " | "
        + " | ".join(f"Δ {a}" for a in attacks) + " |",
        "|---|---|" + "---|" * (len(kinds) + len(attacks)),
        *seed_rows,
        "",
        "Updates the master's screening left out over all seeds (`left_out` events; the "
        "poisoner sent a poisoned update every round it trained):",
        "",
        "| strategy | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
        *screen_rows,
        "",
        screen_note,
        "",
        f"Acceptance, on the seed-mean Δ ({n} seed{'s' if n > 1 else ''}): "
        + ("FedAvg was not run here (robust.md has it)" if "fedavg" not in results else
           f"FedAvg falls (more than 1 point under its clean run) under "
           f"{', '.join(fedavg_falls) or 'no attack'}"
           f"{'' if len(fedavg_falls) == len(attacks) else ' only'}"
           f"{'; not under ' + ', '.join(fedavg_holds) if fedavg_holds else ''}")
        + "; robust rules within 1 point of their clean run: "
        + f"{(held and 'all') or 'none measured' if not robust_fail else held or 'none'}"
        f"{'' if not robust_fail else '; not ' + ', '.join(robust_fail)}.",
    ]
    md = "\n".join(ln for i, ln in enumerate(lines)
                   if ln or not (i and not lines[i - 1]))  # no doubled blank lines
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(md + "\n")
    plot(results, attacks, done, out / f"{name}.png")
    res = {"command": command, "work": str(work), "wall_s": wall, "cpu_count": os.cpu_count(),
           "load_average_at_writing": load, "source": source,
           "seeds_requested": seeds, "seeds_done": done, "workers": list(WORKERS),
           "scored_workers": list(HONEST), "hostile": HOSTILE,
           "score": "mean over w1..w4 of summary.json federated_macro_f1",
           "delta": "points, per seed against that seed's clean run",
           "acceptance": [{"strategy": s, "attack": a, "ok": ok} for s, a, ok in verdict],
           "strategies": results}
    (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str))
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="fedavg,fedmedian,fedtrimmedavg,krum",
                    help=f"comma-separated, among {', '.join(STRATEGIES)}")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2],
                    help="the job's seed, one full set of runs each, in this order "
                         "(default 0,1,2)")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the runs' configs, outputs and logs (default: a new one "
                         "under the temporary folder)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--name", default="robust",
                    help="stem of the files written in RESULTS (default robust: robust.md, "
                         ".json, .png)")
    ap.add_argument("--pooled", action="store_true",
                    help="run nothing: score the runs of RESULTS/robust.json again on the "
                         "honest workers' test documents pooled (robust_pooled.md)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: write RESULTS/NAME.{md,png} again from NAME.json")
    args = ap.parse_args()
    if args.report_only:
        saved = json.loads((args.results / f"{args.name}.json").read_text())
        results = {s: {"strategy": sr["strategy"],
                       "runs": {k: {int(seed): r for seed, r in by_seed.items()}
                                for k, by_seed in sr["runs"].items()}}
                   for s, sr in saved["strategies"].items()}
        kinds = list(next(iter(results.values()))["runs"])
        print(report(results, strategies=list(results), attacks=kinds[1:],
                     seeds=saved["seeds_requested"], done=saved["seeds_done"],
                     command=saved["command"], source=saved["source"], work=Path(saved["work"]),
                     wall=saved["wall_s"], out=args.results, name=args.name,
                     load=saved["load_average_at_writing"]))
        return
    if args.pooled:
        print(pooled_report(args.results / f"{args.name}.json", args.results, args.name))
        return
    command = command_line(ROOT)
    strategies = args.strategies.split(",")
    attacks = [a for a in args.attacks.split(",") if a]
    seeds = args.seeds
    work = args.work or Path(tempfile.mkdtemp(prefix="robust_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder (configs, outputs, logs): {work}", flush=True)
    source = source_state()
    print(f"code: {ROOT} at {source['commit']}, changes {source['changes']}", flush=True)
    t_all = time.monotonic()
    results: dict[str, Any] = {s: {"strategy": STRATEGIES[s],
                                   "runs": {k: {} for k in ["clean", *attacks]}}
                               for s in strategies}
    done: list[int] = []
    first = True
    for seed in seeds:
        t_seed = time.monotonic()
        for s in strategies:
            for kind in ["clean", *attacks]:
                folder = work / f"seed{seed}" / s / kind
                cfg = write_config(folder, STRATEGIES[s], seed)
                r = run_job(folder, cfg, None if kind == "clean" else kind)
                if first and not r["cache_hit"].get("w1"):
                    print("WARNING: the first run's w1 log has no 'cache hit': it embedded",
                          flush=True)
                first = False
                results[s]["runs"][kind][seed] = r
                print(f"seed {seed} {s} {kind}: score {fmt(r['score'])}, {r['rounds']} "
                      f"rounds, {r['wall_s']:.1f} s, exit {r['exit_codes']}, left out "
                      f"{caught(r) or 'none'}, error {r['error']}", flush=True)
        done.append(seed)
        md = report(results, strategies=strategies, attacks=attacks, seeds=seeds, done=done,
                    command=command, source=source, work=work,
                    wall=time.monotonic() - t_all, out=args.results, name=args.name)
        print(f"seed {seed} done in {(time.monotonic() - t_seed) / 60:.1f} min; "
              f"{args.results / (args.name + '.md')} written", flush=True)
    print(md)


if __name__ == "__main__":
    main()
