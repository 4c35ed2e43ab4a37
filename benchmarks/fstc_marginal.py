"""FSTC's ``marginal: auto``: does the compactness rule pick the better of the two runs?

``marginal: auto`` trains the learned-marginal and the equal-marginal run side by side and
keeps the learned one unless its clusters are less compact than the equal one's by more than
``AUTO_MAX_DROP`` (:func:`common.models.fstc.choose_marginal`). The two runs are each exactly
what that marginal trains alone (same seeds; ``tests/test_fstc.py`` checks it), so each cell
here trains them once apiece and reads off what ``auto`` keeps.

Cells follow :mod:`fstc_unequal`'s protocol: m = 4 clients split IID or by a Dirichlet over
clusters (α = 0.5), 40 rounds × 100 local iterations, frozen all-MiniLM-L6-v2 embeddings, the
k-FED start shared by both runs and FSBERT, ACC of the global model on all documents. The
threshold was set on the development sets (StackOverflow and AG News, power-law and equal)
before any held-out cell (DBpedia, TagMyNews, the 45 pooled clusters) was run.

Run from the repository root:

    .venv/bin/python benchmarks/fstc_marginal.py [--seeds 5] [--dirichlet-seeds 3]
        [--sets ...] [--jobs 2] [--out DIR]

Writes ``fstc_marginal.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fstc_sets import EQUAL_SETS, SETS, TITLES  # noqa: E402
from fstc_table2 import N_INIT, RESULTS, _scores, load  # noqa: E402
from fstc_unequal import ALIGN, ALPHA, DEV  # noqa: E402

from common.data.partitions import partition  # noqa: E402
from common.models.fstc import AUTO_MAX_DROP, FederatedFSTC, FSTCParams, choose_marginal  # noqa: E402
from common.models.kfed import KFed  # noqa: E402

ORDER = (*DEV, *(s for s in SETS if s not in DEV))


def run_cell(task: dict[str, Any]) -> dict[str, Any]:
    """FSBERT and both marginals' runs on one set, split and seed; what auto keeps."""
    import torch
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    texts, X, y = load(task["set"])
    k = int(y.max()) + 1
    parts = partition(y, 4, scheme=task["scheme"], alpha=ALPHA, seed=task["seed"])
    order = np.concatenate(parts)
    feats = [X[p] for p in parts]
    client_texts = [[texts[i] for i in p] for p in parts]
    fsbert = KFed(k, n_init=N_INIT, random_state=task["seed"]).fit(feats)
    out: dict[str, Any] = {k2: task[k2] for k2 in ("set", "scheme", "seed")}
    out["FSBERT"] = _scores(y[order], fsbert.predict(X[order]))
    params = FSTCParams(iterations=task["iterations"], align_weight=ALIGN.get(task["set"], 1.0))
    compact = {}
    for marginal in ("learned", "equal"):
        fed = FederatedFSTC(replace(params, marginal=marginal), k, rounds=task["rounds"],
                            random_state=task["seed"])
        fed.fit(feats, init_centers=fsbert.cluster_centers_, texts=client_texts)
        out[marginal] = _scores(y[order], fed.predict(X[order]))
        compact[marginal] = fed.compactness_[marginal]
    out["compactness"] = compact
    out["drop"] = 1 - compact["learned"] / compact["equal"]
    out["kept"] = choose_marginal(compact["learned"], compact["equal"])
    out["auto"] = out[out["kept"]]
    out["seconds"] = time.perf_counter() - t0
    print(f"  {task['set']:16s} {task['scheme']:9s} seed {task['seed']}: FSBERT "
          f"{out['FSBERT']['acc']:.1f}, learned {out['learned']['acc']:.1f}, equal "
          f"{out['equal']['acc']:.1f}, drop {100 * out['drop']:.2f} % -> {out['kept']} "
          f"({out['seconds']:.0f} s)", flush=True)
    return out


def _ms(v: list[float]) -> str:
    return f"{np.mean(v):.1f} ± {np.std(v):.1f}"


def table(cells: list[dict[str, Any]], scheme: str, sets: tuple[str, ...]) -> list[str]:
    lines = ["| set | FSBERT | learned | equal | **auto** | auto − FSBERT, mean (worst) | "
             "kept equal | kept the better run |", "|---|---|---|---|---|---|---|---|"]
    for s in sets:
        mine = [c for c in cells if c["set"] == s and c["scheme"] == scheme]
        if not mine:
            continue
        acc = {m: [c[m]["acc"] for c in mine] for m in ("FSBERT", "learned", "equal", "auto")}
        gain = np.subtract(acc["auto"], acc["FSBERT"])
        better = sum(c["auto"]["acc"] >= max(c["learned"]["acc"], c["equal"]["acc"])
                     for c in mine)
        dev = " (dev)" if s in DEV else ""
        lines.append(f"| {TITLES[s]}{dev} | {_ms(acc['FSBERT'])} | {_ms(acc['learned'])} | "
                     f"{_ms(acc['equal'])} | **{_ms(acc['auto'])}** | "
                     f"{gain.mean():+.1f} ({gain.min():+.1f}) | "
                     f"{sum(c['kept'] == 'equal' for c in mine)} of {len(mine)} | "
                     f"{better} of {len(mine)} |")
    return lines


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for group, marker, label in ((DEV, "o", "development sets"),
                                 (tuple(s for s in ORDER if s not in DEV), "^",
                                  "held-out sets")):
        for scheme, color in (("iid", "tab:blue"), ("dirichlet", "tab:orange")):
            mine = [c for c in cells if c["set"] in group and c["scheme"] == scheme]
            if mine:
                ax.scatter([100 * c["drop"] for c in mine],
                           [c["learned"]["acc"] - c["equal"]["acc"] for c in mine],
                           marker=marker, color=color, alpha=0.75,
                           label=f"{label}, {'IID' if scheme == 'iid' else 'Dirichlet'}")
    ax.axvline(100 * AUTO_MAX_DROP, color="black", linestyle="--", linewidth=1)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.text(100 * AUTO_MAX_DROP, ax.get_ylim()[1], "  keeps equal →", va="top", fontsize=9)
    ax.set_xlabel("compactness lost by learning the sizes (learned vs equal run), %")
    ax.set_ylabel("ACC of the learned run − ACC of the equal run, points")
    ax.set_title("marginal: auto keeps the learned sizes left of the line, the equal right")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds of the IID split")
    ap.add_argument("--dirichlet-seeds", type=int, default=3, help="seeds of the Dirichlet split")
    ap.add_argument("--sets", nargs="+", default=list(ORDER), choices=SETS + EQUAL_SETS)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--name", default="fstc_marginal", help="stem of the output files")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sets = tuple(s for s in ORDER if s in args.sets)
    for s in sets:  # embeds each source once (cached), before the processes want it
        load(s)
    tasks = [{"set": s, "scheme": scheme, "seed": seed, "rounds": args.rounds,
              "iterations": args.iterations}
             for scheme, n in (("iid", args.seeds), ("dirichlet", args.dirichlet_seeds))
             for seed in range(n) for s in sets]
    print(f"{len(tasks)} cells on {args.jobs} process(es)", flush=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        cells = list(pool.map(run_cell, tasks))
    wall = time.perf_counter() - started
    command = (f"python benchmarks/fstc_marginal.py --seeds {args.seeds} --dirichlet-seeds "
               f"{args.dirichlet_seeds} --rounds {args.rounds} --iterations {args.iterations} "
               f"--jobs {args.jobs}" + ("" if sets == ORDER else f" --sets {' '.join(sets)}"))
    lines = ["# FSTC's marginal: auto", "",
             f"`{command}`; {wall / 60:.1f} min on {args.jobs} process(es) of a shared 2-core "
             f"CPU. ACC (Hungarian) in %, of the global model on all documents, mean ± std over "
             f"seeds. m = 4 clients, {args.rounds} rounds × {args.iterations} local iterations, "
             "frozen encoder, one k-FED start per cell shared by FSBERT and both runs. "
             "*learned* and *equal* are the two marginals' runs; *auto* is the one "
             f"`marginal: auto` keeps: the learned run unless its clusters are more than "
             f"{100 * AUTO_MAX_DROP:.1f} % less compact than the equal run's (the threshold set "
             "on the sets marked dev before the others were run). *Kept the better run*: "
             "auto's ACC is the higher of the two.", ""]
    for scheme, title in (("iid", f"IID clients ({args.seeds} seeds)"),
                          ("dirichlet", f"Dirichlet over clusters, α = {ALPHA} "
                                        f"({args.dirichlet_seeds} seeds)")):
        if any(c["scheme"] == scheme for c in cells):
            lines += [f"## {title}", "", *table(cells, scheme, sets), ""]
    lines += ["## Each cell", "", "![compactness against ACC](" + args.name + ".png)", "",
              "| set | split | seed | FSBERT | learned | equal | compactness lost | kept |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {TITLES[c['set']]} | {c['scheme']} | {c['seed']} | {c['FSBERT']['acc']:.1f} | "
              f"{c['learned']['acc']:.1f} | {c['equal']['acc']:.1f} | {100 * c['drop']:.2f} % | "
              f"{c['kept']} |" for c in cells]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot(cells, out / f"{args.name}.png")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "wall_seconds": wall, "max_drop": AUTO_MAX_DROP, "cells": cells},
        indent=1), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
