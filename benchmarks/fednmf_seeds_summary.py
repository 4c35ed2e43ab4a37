"""Benchmark summary: every ``fednmf_seeds.py`` result in one table, with a pooled test.

Each ``benchmarks/results/fednmf_seeds*.json`` holds paired runs (+MI and no MI with the same
seed) for four datasets and four strategies. This reads them all and gives, per setting, how
many of the 16 dataset/strategy pairs +MI leads on its mean, and the difference pooled over
every paired run: mean ± standard error, share above 0 and p-values of a t-test and a Wilcoxon
signed-rank test against no difference. A count of pairs won says little on its own when
most differences are smaller than the seeds' spread; the pooled test says whether the term
moves F1 at all. Nothing is retrained.

    python benchmarks/fednmf_seeds_summary.py

Prints the table and writes benchmarks/results/fednmf_seeds_summary.{json,md}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fednmf_seeds import paired_differences  # noqa: E402
from fednmf_tables import MI_WEIGHT, RESULTS  # noqa: E402

from common.atomic import atomic_write_bytes  # noqa: E402


def setting(path: Path) -> dict[str, Any]:
    """One result file's setting and figures (older files lack the newer keys)."""
    d = json.loads(path.read_text())
    f1 = d["macro_f1"]
    drift_plain, drift_mi = [], []
    for name, by in f1.items():
        for label in by:
            if label.endswith("+MI"):
                continue
            drift_plain += d["client_drift"][name][label]
            drift_mi += d["client_drift"][name][label + "+MI"]
    return {"file": path.stem, "alpha": d["alpha"], "epochs": d["epochs"],
            "mi_weight": d.get("mi_weight", MI_WEIGHT),
            "update": "keeps scale" if d.get("mi_keeps_scale") else "paper's",
            "critic": d.get("critic_aggregation", "fedavg"),
            "scored_on": "learned H" if d.get("learned_h") else "re-solved H",
            "seeds": len(d["seeds"]),
            "drift": (float(np.mean(drift_plain)), float(np.mean(drift_mi))),
            **paired_differences(f1)}


def main() -> None:
    rows = sorted((setting(p) for p in RESULTS.glob("fednmf_seeds*.json")
                   if p.stem != "fednmf_seeds_summary"),
                  key=lambda r: (-r["alpha"], r["scored_on"] != "re-solved H",
                                 r["critic"] != "fedavg", r["update"] != "paper's",
                                 r["mi_weight"]))
    lines = ["# FedNMF+MI across seeds: every setting, pooled", "",
             "From the result files of `benchmarks/fednmf_seeds.py` (k = 50, 3,000 titles, "
             "K = 10, C = 0.2, 50 rounds). *ahead*: dataset/strategy pairs (of 16) where +MI "
             "has the higher mean macro-F1. *pooled*: +MI minus no MI over every paired run "
             "(same seed), mean ± standard error; *> 0*: share of those runs above 0; p: "
             "two-sided, t-test and Wilcoxon signed-rank against no difference. Drift: mean "
             "relative change of the topics in one local update, no MI -> +MI.", "",
             "| file | alpha | epochs | lambda | MI update | critic | F1 on | seeds | ahead | "
             "pooled | > 0 | p (t) | p (Wilcoxon) | drift |",
             "|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| [{r['file']}]({r['file']}.md) | {r['alpha']:g} | {r['epochs']} | "
            f"{r['mi_weight']:g} | {r['update']} | {r['critic']} | {r['scored_on']} | "
            f"{r['seeds']} | {r['ahead']}/{r['pairs']} | {r['mean']:+.4f} ± {r['se']:.4f} | "
            f"{r['positive']:.0%} | {r['t_p']:.3f} | {r['wilcoxon_p']:.3f} | "
            f"{r['drift'][0]:.3f} -> {r['drift'][1]:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    atomic_write_bytes(RESULTS / "fednmf_seeds_summary.md", text.encode())
    atomic_write_bytes(RESULTS / "fednmf_seeds_summary.json",
                       json.dumps(rows, indent=2).encode())


if __name__ == "__main__":
    main()
