"""Does FSTC's label-free warning find the workers it made worse? (issue 29, item 3)

Every worker of every cell of ``fstc_unequal.py`` (5 sets, IID and Dirichlet α = 0.5, seeds
0–4, 4 workers: 200 workers), the family's defaults: each worker's ACC under the k-FED start
(FSBERT) and under the final model, on its own documents, and the two signals a worker can
compute without labels: NMI between its final clusters and its start
(``summary.json``'s ``fstc_start_nmi``; the warning fires under
``common.constants.FAR_FROM_START_NMI``), and a candidate that was not adopted, the clusters
that held ≥ 5 % of the worker's documents at the start and under a tenth of that at the end.

Run from the repository root (about 20 min on the 2-core CPU; ``--from-json`` re-scores a
saved run):

    .venv/bin/python benchmarks/fstc_guard.py [--jobs 2] [--from-json]

Writes ``fstc_guard.{json,md}`` to ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fstc_sets import SETS  # noqa: E402
from fstc_table2 import RESULTS  # noqa: E402

from common.constants import FAR_FROM_START_NMI  # noqa: E402


def cell(task: tuple[str, str, int]) -> list[dict[str, Any]]:
    """One set, split and seed: per worker, ACC at the start and the end, and the signals."""
    from fstc_table2 import N_INIT, FederatedFSTC, KFed, _scores, load, partition
    from sklearn.metrics import normalized_mutual_info_score
    from threadpoolctl import threadpool_limits

    from common.models.fstc import FSTCParams

    threadpool_limits(1)
    dataset, scheme, seed = task
    texts, X, y = load(dataset)
    k = int(y.max()) + 1
    parts = partition(y, 4, scheme=scheme, alpha=0.5, proportions=None, seed=seed)
    start = KFed(k, n_init=N_INIT, random_state=seed).fit([X[p] for p in parts])
    fed = FederatedFSTC(FSTCParams(iterations=100), k, rounds=40, random_state=seed)
    fed.fit([X[p] for p in parts], init_centers=start.cluster_centers_,
            texts=[[texts[i] for i in p] for p in parts])
    out = []
    for m, p in enumerate(parts):
        s, f = start.predict(X[p]), fed.predict(X[p])
        out.append({"dataset": dataset, "scheme": scheme, "seed": seed, "worker": m,
                    "documents": len(p), "start_nmi": float(normalized_mutual_info_score(s, f)),
                    "start_sizes": np.bincount(s, minlength=k).tolist(),
                    "final_sizes": np.bincount(f, minlength=k).tolist(),
                    "acc_start": _scores(y[p], s)["acc"], "acc_final": _scores(y[p], f)["acc"]})
    print(f"  {dataset:16s} {scheme:9s} seed {seed}: ACC change per worker "
          + ", ".join(f"{o['acc_final'] - o['acc_start']:+.1f}" for o in out), flush=True)
    return out


def vanished(w: dict[str, Any], share: float = 0.05, left: float = 0.1) -> int:
    """Clusters that held at least ``share`` of the worker's documents at the start and under
    ``left`` of that at the end."""
    s, f = np.asarray(w["start_sizes"]), np.asarray(w["final_sizes"])
    return int(((s >= share * s.sum()) & (f < left * s)).sum())


def report(workers: list[dict[str, Any]]) -> str:
    rules = {f"start NMI < {FAR_FROM_START_NMI:g} (the warning)":
             lambda w: w["start_nmi"] < FAR_FROM_START_NMI,
             "a cluster vanished (not adopted)": lambda w: vanished(w) >= 1}
    improved = [w for w in workers if w["acc_final"] >= w["acc_start"]]
    lines = ["# FSTC's label-free warning against the workers it made worse", "",
             "`python benchmarks/fstc_guard.py`: the defaults on every worker of "
             "`fstc_unequal.py`'s cells (5 sets × IID and Dirichlet α = 0.5 × seeds 0–4 × 4 "
             f"workers = {len(workers)}); ACC on the worker's own documents, of the k-FED start "
             "and of the final model.", "",
             "| signal | workers ≥ 5 points worse: flagged | ≥ 10 points worse: flagged | "
             "workers not worse: flagged (false alarms) |", "|---|---|---|---|"]
    for name, rule in rules.items():
        row = [name]
        for drop in (5, 10):
            bad = [w for w in workers if w["acc_final"] - w["acc_start"] <= -drop]
            row.append(f"{sum(map(rule, bad))} of {len(bad)}")
        row.append(f"{sum(map(rule, improved))} of {len(improved)}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Workers ≥ 10 points worse:", "",
              "| set | split | seed | worker | ACC change | start NMI | clusters vanished |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {w['dataset']} | {w['scheme']} | {w['seed']} | {w['worker']} | "
              f"{w['acc_final'] - w['acc_start']:+.1f} | {w['start_nmi']:.2f} | {vanished(w)} |"
              for w in workers if w["acc_final"] - w["acc_start"] <= -10]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--from-json", action="store_true", help="re-score fstc_guard.json")
    args = ap.parse_args()
    path = RESULTS / "fstc_guard.json"
    if args.from_json:
        workers = json.loads(path.read_text())["workers"]
    else:
        tasks = [(s, scheme, seed) for scheme in ("iid", "dirichlet")
                 for seed in range(args.seeds) for s in SETS]
        with ProcessPoolExecutor(args.jobs) as pool:
            workers = [w for ws in pool.map(cell, tasks) for w in ws]
        path.write_text(json.dumps({"workers": workers}, indent=1), encoding="utf-8")
    text = report(workers)
    (RESULTS / "fstc_guard.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
