"""The closing comparison: local-only vs federated vs centralized, per worker."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

COLUMNS = ("local_only", "federated", "centralized")


def comparison_rows(reports: Mapping[str, Mapping[str, Any] | None],
                    centralized: Mapping[str, Mapping[str, float]] | None
                    ) -> list[dict[str, Any]]:
    """One row per worker: macro-F1 and accuracy of each model on that worker's test split.

    Parameters
    ----------
    reports : mapping of worker id to its final report (``None`` if it sent none)
        A report carries ``federated``, ``local_only`` (metric dicts), ``n_train``, ``n_test``.
    centralized : mapping of worker id to metrics, optional
        The pooled model's scores, where the master could pool the data.
    """
    rows = []
    for wid in sorted(reports):
        rep = reports[wid] or {}
        row: dict[str, Any] = {"worker": wid, "n_train": rep.get("n_train"),
                               "n_test": rep.get("n_test")}
        sources = {"local_only": rep.get("local_only"), "federated": rep.get("federated"),
                   "centralized": (centralized or {}).get(wid)}
        for col, scores in sources.items():
            row[f"{col}_macro_f1"] = (scores or {}).get("macro_f1")
            row[f"{col}_accuracy"] = (scores or {}).get("accuracy")
        rows.append(row)
    return rows


def _fmt(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def format_table(rows: list[dict[str, Any]],
                 pooled: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """A markdown table of :func:`comparison_rows` with a mean row and, where the data could
    be pooled, a second table scoring every model on all workers' test splits together."""
    head = ("| worker | train | test | local-only F1 | federated F1 | centralized F1 "
            "| local-only acc | federated acc | centralized acc |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        cells = [r["worker"], str(r["n_train"] or "n/a"), str(r["n_test"] or "n/a")]
        cells += [_fmt(r[f"{c}_macro_f1"]) for c in COLUMNS]
        cells += [_fmt(r[f"{c}_accuracy"]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        means = ["**mean**", "", ""]
        for metric in ("macro_f1", "accuracy"):
            for c in COLUMNS:
                vals = [r[f"{c}_{metric}"] for r in rows if r[f"{c}_{metric}"] is not None]
                means.append(_fmt(sum(vals) / len(vals)) if vals else "n/a")
        lines.append("| " + " | ".join(means) + " |")
    if pooled:
        lines += ["", "All workers' test splits pooled:", "",
                  "| model | macro-F1 | accuracy |", "|---|---|---|"]
        lines += [f"| {name} | {_fmt(m.get('macro_f1'))} | {_fmt(m.get('accuracy'))} |"
                  for name, m in pooled.items()]
    return "\n".join(lines)
