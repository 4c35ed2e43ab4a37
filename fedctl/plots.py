"""Learning curves from a run's ``metrics.jsonl``: ``curves.png`` at the end of every run, and
``fedctl plot RUN [RUN ...]`` to lay runs over each other (two strategies, several seeds).

Two panels per picture: the global model's score after each round of training (what every
worker measured on its own test split before training on it, and the final model's score from
the closing report: one thin line per worker and their mean), and
the time each round took beside the part of it that was not the slowest worker's training (the
cluster's overhead). Runs given together that differ only by seed are drawn as their mean with
a band from the lowest to the highest.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.constants import STAGING_SUFFIX
from common.runlog import read_metrics

#: The score a curve follows: the first of these the workers measured each round. Higher is
#: better unless said.
SCORES = (("macro_f1", "macro-F1", True), ("accuracy", "accuracy", True),
          ("nmi", "NMI", True), ("npmi_doc", "NPMI (documents)", True),
          ("heldout_ll_per_token", "held-out log-likelihood per token", True),
          ("perplexity", "perplexity (lower is better)", False),
          ("loss", "test loss (lower is better)", False))


def _curves(events: list[dict[str, Any]], summary: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Each worker's score after 0, 1, ... rounds of training (a round's ``worker_round``
    scores the model it started from; the final model's scores come from ``summary``), and the
    rounds' durations and overheads."""
    rounds = [e for e in events if e.get("event") == "round"]
    workers = [e for e in events if e.get("event") == "worker_round"]
    rows = (summary or {}).get("comparison") or []
    # A run that scored no round (eval_every: 0) still has its final model's scores.
    score = next(((k, label) for k, label, _ in SCORES
                  if any(isinstance(e.get(k), (int, float)) for e in workers)), None) or next(
        ((k, label) for k, label, _ in SCORES
         if any(isinstance(r.get(f"federated_{k}"), (int, float)) for r in rows)), None)
    per_worker: dict[str, dict[int, float]] = defaultdict(dict)
    if score is not None:
        for e in workers:
            if isinstance(e.get(score[0]), (int, float)):
                per_worker[e["worker"]][int(e["round"]) - 1] = float(e[score[0]])
        trained = len(rounds)
        scored = set(per_worker) or {r.get("worker") for r in rows}
        for row in rows:
            value = row.get(f"federated_{score[0]}")
            if isinstance(value, (int, float)) and row.get("worker") in scored:
                per_worker[str(row["worker"])][trained] = float(value)
    return {"score": score, "per_worker": dict(per_worker),
            "round": [int(e["round"]) for e in rounds],
            "duration": [float(e["duration_s"]) for e in rounds],
            "overhead": [float(e.get("overhead_s") or 0.0) for e in rounds]}


def _mean_curve(per_worker: dict[str, dict[int, float]]) -> tuple[list[int], list[float]]:
    rounds = sorted({r for curve in per_worker.values() for r in curve})
    return rounds, [float(np.mean([c[r] for c in per_worker.values() if r in c]))
                    for r in rounds]


def _summary(run_dir: Path) -> dict[str, Any] | None:
    from fedctl.runs import read_json

    return read_json(run_dir / "summary.json")


@functools.cache
def _config(run_dir: Path) -> Any:
    """The run's cluster.yaml, read once however many labels and groups ask (None: none)."""
    from common.config import load_config

    try:
        return load_config(run_dir / "cluster.yaml")
    except Exception:  # a folder without its config
        return None


def _label(run_dir: Path) -> str:
    """What tells runs apart in a legend: family, strategy, and the folder's name."""
    cfg = _config(run_dir)
    if cfg is None:  # its name will do
        return run_dir.resolve().name
    from fedctl.runs import strategy_name

    name = strategy_name(cfg)
    return f"{cfg.family} {'(its own rule)' if name == 'its own rule' else name}"


#: Line styles of the runs compared in one figure, in turn with their colours.
STYLES = ("-", "--", ":", "-.")


def _differences(groups: list[str]) -> list[str] | None:
    """For groups of runs (each its :func:`_seedless` configuration), the settings in which
    they differ, as ``key=value`` per group; None where they are too many to read (over 3)
    or a configuration is unknown."""
    import json

    flats: list[dict[str, str]] = []
    for text in groups:
        try:
            raw = json.loads(text)
        except ValueError:  # (a run without its config: its path)
            return None
        flat: dict[str, str] = {}

        def walk(value: object, key: str, flat: dict[str, str] = flat) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(v, f"{key}.{k}" if key else str(k))
            else:
                flat[key] = json.dumps(value, default=str)
        walk(raw, "")
        flats.append(flat)
    keys = sorted({k for f in flats for k in f if len({g.get(k) for g in flats}) > 1})
    if not keys or len(keys) > 3:
        return None
    return [", ".join(f"{k}={f.get(k, '-')}" for k in keys) for f in flats]


def _seed(run_dir: Path) -> object:
    cfg = _config(run_dir)
    return run_dir if cfg is None else cfg.seed  # unknown: counted apart


def _seedless(run_dir: Path) -> str:
    """The run's configuration with its seed and folders left out: runs that share it are
    repetitions (seeds) of one experiment."""
    import json

    from common.config import config_to_dict

    cfg = _config(run_dir)
    if cfg is None:
        return str(run_dir)
    raw = config_to_dict(cfg)
    for key in ("seed", "output_dir", "master", "source"):
        raw.pop(key, None)
    return json.dumps(raw, sort_keys=True, default=str)


def plot_runs(runs: Sequence[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Draw the learning curves of ``runs`` into ``out`` (a PNG) and return its path.

    One run: a line per worker and their mean. Several: each run's mean, runs that differ
    only by seed drawn as their mean and a min-max band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _config.cache_clear()  # each picture reads the folders as they are now
    dirs = [Path(r) for r in runs]
    data = {d: _curves(read_metrics(d / "metrics.jsonl"), _summary(d)) for d in dirs}
    empty = [str(d) for d, c in data.items() if not c["round"]]
    if empty:  # a picture of empty axes says nothing; say why instead
        raise ValueError(f"{', '.join(empty)}: no round done yet (nothing to draw)")
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = {c["score"][1] for c in data.values() if c["score"]}
    # Runs scored differently (an MLP's macro-F1, LDA's NPMI) share the axis only with each
    # score named in the legend: one axis title would pass one for the other.
    mixed = len(labels) > 1
    score_label = "score (each run's: see the legend)" if mixed else next(iter(labels), None)
    if len(dirs) == 1:
        c = data[dirs[0]]
        for i, (w, curve) in enumerate(sorted(c["per_worker"].items())):
            xs = sorted(curve)
            ax_s.plot(xs, [curve[x] for x in xs], lw=1, alpha=0.6, marker=".", color=f"C{i}",
                      label=w)
        if c["per_worker"]:
            xs, ys = _mean_curve(c["per_worker"])
            ax_s.plot(xs, ys, lw=2.5, color="black", label="mean of the workers",
                      marker="o" if len(xs) == 1 else None)
        ax_t.plot(c["round"], c["duration"], marker=".", label="round")
        ax_t.plot(c["round"], c["overhead"], marker=".",
                  label="overhead (round - slowest training)")
    else:
        groups: dict[str, list[Path]] = defaultdict(list)
        for d in dirs:
            groups[_seedless(d)].append(d)
        # Runs of one family and strategy told apart by what differs in their configs
        # (model.lr=0.01), not by run ids alone.
        alike = len(groups) > 1 and len({_label(m) for g in groups.values() for m in g}) == 1
        differ = _differences(list(groups)) if alike else None
        for i, members in enumerate(groups.values()):
            # Copies of one run (the same seed) are runs, not seeds.
            seeds = len({_seed(m) for m in members})
            name = _label(members[0]) + ("" if len(members) == 1 else
                                         f" ({len(members)} seeds)" if seeds == len(members)
                                         else f" ({len(members)} runs, {seeds} seed(s))")
            if alike and differ is not None:
                name = differ[i] + name[len(_label(members[0])):]
            elif alike:
                # same family and strategy; a history link (runs/latest) by its run's name
                name = ", ".join(m.resolve().name for m in members)
            means = [_mean_curve(data[m]["per_worker"]) for m in members
                     if data[m]["per_worker"]]
            if means:
                xs = sorted(set.intersection(*(set(x) for x, _ in means)))
                ys = np.array([[dict(zip(x, y, strict=True))[r] for r in xs] for x, y in means])
                score = data[members[0]]["score"]
                # (a line style each: runs that give the same curve hid each other)
                ax_s.plot(xs, ys.mean(0), lw=2, color=f"C{i}", linestyle=STYLES[i % len(STYLES)],
                          label=f"{name}: {score[1]}" if mixed and score else name,
                          marker="o" if len(xs) == 1 else None)
                if len(means) > 1:
                    ax_s.fill_between(xs, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.2)
            durs = [data[m] for m in members]
            n = min(len(c["round"]) for c in durs)
            if n:
                d = np.array([c["duration"][:n] for c in durs])
                xs = durs[0]["round"][:n]
                ax_t.plot(xs, d.mean(0), color=f"C{i}", linestyle=STYLES[i % len(STYLES)],
                          marker=".", label=name)
                if len(durs) > 1:
                    ax_t.fill_between(xs, d.min(0), d.max(0), color=f"C{i}", alpha=0.2)
    ax_s.set_title("Global model on each worker's test split")
    ax_s.set_xlabel("rounds of training")
    ax_s.set_ylabel(score_label or "no score measured")
    ax_t.set_title("Time per round")
    ax_t.set_xlabel("round")
    ax_t.set_ylabel("seconds")
    ax_t.set_ylim(bottom=0)
    for ax in (ax_s, ax_t):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if all(getattr(_config(d), "eval_every", None) == 0 for d in dirs):
        # Say why the curve is a point (or the panel empty) rather than leave it unexplained,
        # and show the rounds from 0, not a fraction of a round around the point.
        ax_s.set_xlim(-0.1, max(1.0, *(max(c["round"], default=0) for c in data.values()))
                      + 0.1)
        ax_s.text(0.5, 0.5, "eval_every: 0: no round was scored during training,\nonly the "
                  "final model", ha="center", va="center", transform=ax_s.transAxes,
                  color="0.35")
    # (drawn at the end of `fedctl run`, the folder still has its staging name)
    name = dirs[0].resolve().name.removesuffix(STAGING_SUFFIX)
    fig.suptitle(title or (f"{name}: {_label(dirs[0])}" if len(dirs) == 1
                           else f"{len(dirs)} runs"))
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
