"""Tests of master/report.py: the closing table shows what each family reports."""

from __future__ import annotations

import json
from pathlib import Path

from master.report import comparison_rows, format_table, reported_metrics


def _report(local: dict | None, federated: dict | None) -> dict:
    return {"local_only": local, "federated": federated, "n_train": 80, "n_test": 20}


def test_classifier_table_keeps_its_columns_and_means():
    reports = {"w2": _report({"macro_f1": 0.5, "accuracy": 0.6},
                             {"macro_f1": 0.7, "accuracy": 0.8}),
               "w1": _report({"macro_f1": 0.9, "accuracy": 0.9},
                             {"macro_f1": 0.9, "accuracy": 1.0})}
    rows = comparison_rows(reports, {"w1": {"macro_f1": 0.95, "accuracy": 0.97}})
    assert [r["worker"] for r in rows] == ["w1", "w2"]
    assert rows[0]["centralized_macro_f1"] == 0.95 and rows[1]["centralized_macro_f1"] is None
    table = format_table(rows)
    assert table.splitlines()[0].startswith(
        "| worker | train | test | local-only F1 | federated F1 | centralized F1 | local-only acc")
    assert "| **mean** |  |  | 0.7000 | 0.8000 | 0.9500 | 0.7500 | 0.9000 | 0.9700 |" in table


def test_clustering_table_shows_acc_and_nmi():
    reports = {"w1": _report({"accuracy": 0.7, "nmi": 0.6}, {"accuracy": 0.8, "nmi": 0.65})}
    table = format_table(comparison_rows(reports, None))
    head = table.splitlines()[0]
    assert "federated acc" in head and "federated NMI" in head and "F1" not in head
    assert "| w1 | 80 | 20 | 0.7000 | 0.8000 | n/a | 0.6000 | 0.6500 | n/a |" in table


def test_topic_model_table_shows_coherences_diversity_perplexity_and_pools():
    scores = {"npmi_doc": -0.1, "c_npmi": 0.05, "c_v": 0.5, "diversity": 0.9,
              "perplexity": 1234.56, "heldout_ll": -7.0}
    rows = comparison_rows({"w1": _report(scores, scores)}, None)
    assert reported_metrics([scores]) == ["npmi_doc", "c_npmi", "c_v", "diversity",
                                          "perplexity"]
    assert "federated_heldout_ll" not in rows[0]
    table = format_table(rows, {"federated": scores, "centralized": dict(scores, npmi_doc=0.2)})
    head = table.splitlines()[0]
    assert "federated perplexity" in head
    # document co-occurrence NPMI and gensim's sliding-window scores, each named for what it is
    assert "| local-only NPMI (doc) | federated NPMI (doc) | centralized NPMI (doc) |" in head
    assert "federated C_NPMI" in head and "federated C_V" in head
    assert "| model | NPMI (doc) | C_NPMI | C_V | diversity | perplexity |" in table
    assert "| centralized | 0.2000 | 0.0500 | 0.5000 | 0.9000 | 1234.6 |" in table


def test_no_reports_still_gives_a_table():
    rows = comparison_rows({"w1": None}, None)
    assert rows[0]["federated_macro_f1"] is None
    assert "| w1 | n/a | n/a | n/a |" in format_table(rows)


def test_scores_that_are_not_finite_are_written_as_null(tmp_path: Path) -> None:
    """A centralized perplexity on a few documents came out NaN: comparison.json and
    summary.json held a bare NaN, which strict JSON readers refuse."""
    from master.outputs import _write_json

    _write_json(tmp_path / "s.json", {"rows": [{"centralized_perplexity": float("nan"),
                                                "federated_perplexity": 12.5}],
                                      "pooled": {"m": (float("inf"), 1.0)}})

    def refuse(name: str) -> None:
        raise ValueError(name)

    back = json.loads((tmp_path / "s.json").read_text(), parse_constant=refuse)
    assert back == {"rows": [{"centralized_perplexity": None, "federated_perplexity": 12.5}],
                    "pooled": {"m": [None, 1.0]}}
