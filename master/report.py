"""The closing comparison: local-only vs federated vs centralized, per worker.

Every family's workers report their own scores (a classifier's macro-F1 and accuracy, a
clustering's ACC and NMI, a topic model's NPMI, diversity and perplexity); the table shows the
ones in :data:`METRICS` that any report carries, in that order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

COLUMNS = ("local_only", "federated", "centralized")
#: Metrics of the closing table, in order, and their column labels.
#: Topic coherence: ``npmi_doc`` is NPMI over document co-occurrence
#: (:func:`common.eval.topics.npmi_coherence`); ``c_npmi`` and ``c_v`` are gensim's
#: sliding-window scores (:func:`common.eval.topics.gensim_coherence`), as papers report them.
METRICS = {"macro_f1": "F1", "accuracy": "acc", "nmi": "NMI", "npmi_doc": "NPMI (doc)",
           "c_npmi": "C_NPMI", "c_v": "C_V", "diversity": "diversity",
           "perplexity": "perplexity"}
#: Shown when no report carries any score at all (e.g. every worker failed).
DEFAULT_METRICS = ("macro_f1", "accuracy")
#: Most columns of a family's own scores (a plug-in's) when it reports none of METRICS.
MAX_OWN_METRICS = 4


def reported_metrics(scores: Iterable[Mapping[str, Any] | None]) -> list[str]:
    """The keys of :data:`METRICS` that any of ``scores`` carries, in table order; for a family
    that reports none of them (a plug-in), its own keys, sorted."""
    present = {k for s in scores if s for k in s}
    return ([m for m in METRICS if m in present] or sorted(present)[:MAX_OWN_METRICS]
            or list(DEFAULT_METRICS))


def comparison_rows(reports: Mapping[str, Mapping[str, Any] | None],
                    centralized: Mapping[str, Mapping[str, float]] | None
                    ) -> list[dict[str, Any]]:
    """One row per worker: each reported metric of each model on that worker's test split.

    Parameters
    ----------
    reports : mapping of worker id to its final report (``None`` if it sent none)
        A report carries ``federated``, ``local_only`` (metric dicts), ``n_train``, ``n_test``.
    centralized : mapping of worker id to metrics, optional
        The pooled model's scores, where the master could pool the data.

    Returns
    -------
    list of dict
        ``worker``, ``n_train``, ``n_test`` and ``<model>_<metric>`` (``None`` where
        missing) for every model of :data:`COLUMNS` and metric of :func:`reported_metrics`.
    """
    sources = {wid: {"local_only": (reports[wid] or {}).get("local_only"),
                     "federated": (reports[wid] or {}).get("federated"),
                     "centralized": (centralized or {}).get(wid)} for wid in reports}
    metrics = reported_metrics(s for by_model in sources.values() for s in by_model.values())
    rows = []
    for wid in sorted(reports):
        rep = reports[wid] or {}
        row: dict[str, Any] = {"worker": wid, "n_train": rep.get("n_train"),
                               "n_test": rep.get("n_test")}
        for col, scores in sources[wid].items():
            for m in metrics:
                row[f"{col}_{m}"] = (scores or {}).get(m)
        rows.append(row)
    return rows


def _fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 100 else f"{x:.4f}"


def format_table(rows: list[dict[str, Any]],
                 pooled: Mapping[str, Mapping[str, float]] | None = None) -> str:
    """A markdown table of :func:`comparison_rows` with a mean row and, where the data could
    be pooled, a second table scoring every model on all workers' test splits together."""
    metrics = [k[len("federated_"):] for k in (rows[0] if rows else {})
               if k.startswith("federated_")] or list(DEFAULT_METRICS)
    labels = [f"{c.replace('_', '-')} {METRICS.get(m, m)}" for m in metrics for c in COLUMNS]
    lines = ["| worker | train | test | " + " | ".join(labels) + " |",
             "|" + "---|" * (3 + len(labels))]
    for r in rows:
        cells = [r["worker"], str(r["n_train"] or "n/a"), str(r["n_test"] or "n/a")]
        cells += [_fmt(r.get(f"{c}_{m}")) for m in metrics for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        means = ["**mean**", "", ""]
        for m in metrics:
            for c in COLUMNS:
                vals = [r[f"{c}_{m}"] for r in rows if r.get(f"{c}_{m}") is not None]
                means.append(_fmt(sum(vals) / len(vals)) if vals else "n/a")
        lines.append("| " + " | ".join(means) + " |")
    if pooled:
        shown = reported_metrics(pooled.values())
        lines += ["", "All workers' test splits pooled:", "",
                  "| model | " + " | ".join(METRICS.get(m, m) for m in shown) + " |",
                  "|---|" + "---|" * len(shown)]
        lines += [f"| {name} | " + " | ".join(_fmt(s.get(m)) for m in shown) + " |"
                  for name, s in pooled.items()]
    return "\n".join(lines)
