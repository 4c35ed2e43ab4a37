"""Every family through ``fedctl run`` with its baselines on, as a new user runs it, on the
bundled text with its labels removed (on labelled text, every family runs with its example
config and baselines on in test_examples.py).

A crash at the end of a run is as bad as one at the start: each run must exit 0, write its
model and its comparison table, and leave no traceback in any log. The unsupervised families
train on unlabelled text and say once, in the table, which scores they skipped; the classifier
refuses it in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fedctl.launch import child_env
from master.families import SERVER_FAMILIES
from tests.conftest import DATA, MakeConfig, run_fedctl

#: Each family at a small size: two workers, two rounds (five for prodlda: one synchronized
#: step).
SMALL: dict[str, dict[str, Any]] = {
    "mlp": {"hidden": 16},
    "nmf": {"n_topics": 4, "vocab_size": 300},
    "prodlda": {"n_topics": 4, "vocab_size": 300, "batch_size": 32},
    "combinedtm": {"n_topics": 4, "vocab_size": 300, "mode": "fedavg"},
    "fstc": {"n_clusters": 4, "iterations": 5, "batch_size": 64},
    "lda": {"n_topics": 4, "sweeps": 2, "vocab_size": 300, "eval_iter": 5},
    "sentencelda": {"n_topics": 4, "sweeps": 2, "vocab_size": 300, "eval_iter": 5},
}
UNSUPERVISED = sorted(set(SMALL) - {"mlp"})


def test_every_registered_family_is_covered() -> None:
    assert set(SMALL) == set(SERVER_FAMILIES)


@pytest.fixture(scope="module")
def unlabelled_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled file with every label removed (same texts, same order)."""
    path = tmp_path_factory.mktemp("unlabelled") / "dbpedia_unlabelled.jsonl"
    with open(DATA) as src, open(path, "w") as dst:
        for line in src:
            if line.strip():
                dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    return path


def _run(make_config: MakeConfig, tmp_path: Path, family: str, data: Path,
         timeout: float = 600) -> subprocess.CompletedProcess:
    """``fedctl run`` of ``family`` on ``data`` to its end (conftest.run_fedctl)."""
    config = make_config(tmp_path, workers=2, rounds=5 if family == "prodlda" else 2,
                         baselines=True, data={"path": str(data)},
                         model={"family": family, **SMALL[family]})
    return run_fedctl("run", "--config", str(config), "--no-progress", timeout=timeout)


def _assert_finished(proc: subprocess.CompletedProcess, out: Path, family: str) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads((out / "model.json").read_text())["family"] == family
    assert (out / "model.npz").stat().st_size > 0
    rows = json.loads((out / "summary.json").read_text())["comparison"]
    assert [r["worker"] for r in rows] == ["w1", "w2"]
    for name in ("master", "w1", "w2"):
        log = (out / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in log and " done: federated " in log or name == "master", log
    return (out / "comparison.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("family", UNSUPERVISED)
def test_unsupervised_family_runs_on_unlabelled_text(make_config: MakeConfig, tmp_path: Path,
                                                     unlabelled_data: Path, family: str
                                                     ) -> None:
    proc = _run(make_config, tmp_path, family, unlabelled_data)
    table = _assert_finished(proc, tmp_path / "out", family)
    assert table.count("No labels on w1, w2: the scores that need them") == 1


def test_classifier_refuses_unlabelled_text_in_one_line(make_config: MakeConfig,
                                                         tmp_path: Path,
                                                         unlabelled_data: Path) -> None:
    proc = _run(make_config, tmp_path, "mlp", unlabelled_data)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (f"Error: {unlabelled_data}: no 'label' on any row, but family mlp "
                        f"learns from labels (the unsupervised families nmf, prodlda, "
                        f"combinedtm, fstc, lda and sentencelda train on text alone)")
    assert not (tmp_path / "out" / "logs").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.parametrize("family", ["prodlda", "lda"])
def test_topic_family_finishes_on_a_node_without_gensim(make_config: MakeConfig,
                                                        tmp_path: Path, family: str) -> None:
    """A node built without gensim (the GPU image of issue 31 was): the run used to fail at
    its very end, in the closing report's sliding-window coherence; now it finishes, says
    once what it left out, and every other score is there."""
    shadow = tmp_path / "site"
    (shadow / "gensim").mkdir(parents=True)
    (shadow / "gensim" / "__init__.py").write_text(  # what importing an absent package raises
        "raise ModuleNotFoundError(\"No module named 'gensim'\", name='gensim')\n")
    config = make_config(tmp_path, workers=2, rounds=5 if family == "prodlda" else 2,
                         baselines=True, model={"family": family, **SMALL[family]})
    env = child_env(extra={"PYTHONPATH": os.pathsep.join(
        p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p)})
    proc = run_fedctl("run", "--config", str(config), "--no-progress", timeout=600, env=env)
    _assert_finished(proc, tmp_path / "out", family)
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["comparison"]
    assert all(r.get("federated_npmi_doc") is not None for r in rows), rows
    assert not any("c_v" in key or "c_npmi" in key for r in rows for key in r), rows
    said = (tmp_path / "out" / "logs" / "w1.log").read_text()
    assert said.count("gensim cannot be imported here") == 1, said
