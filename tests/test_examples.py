"""Every example of examples/ through ``fedctl run`` as a user runs it (baselines on, as the
file says), made small with ``--set``; then what was trained, used: ``fedctl predict`` writes a
line per document, ``fedctl topics`` prints the topics, and the model read back agrees with
what the cluster measured.

* The MLP's predictions on a worker's test split give exactly that worker's federated
  macro-F1 in comparison.json.
* A topic model's ``transform`` through ``fedctl.load_model`` equals the topic weights the
  worker scored the final model with (FedNMF: the weights solved with the topics fixed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common import constants as C
from master.families import SERVER_FAMILIES
from tests.conftest import ROOT, free_ports, run_fedctl

pytestmark = pytest.mark.slow

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

#: What makes each example small enough for CI: 2 workers, 2 rounds (5 for prodlda's
#: synchronized step), 600 documents, small models. Everything else is the example's own.
SMALL: dict[str, list[str]] = {
    "mlp": ["model.hidden=16"],
    "nmf": ["model.n_topics=4", "model.vocab_size=300"],
    "prodlda": ["model.n_topics=4", "model.vocab_size=300", "model.batch_size=32"],
    "combinedtm": ["model.n_topics=4", "model.vocab_size=300"],
    "fstc": ["model.n_clusters=4", "model.iterations=5", "model.batch_size=64"],
    "lda": ["model.n_topics=4", "model.sweeps=2", "model.vocab_size=300", "model.eval_iter=5"],
    "sentencelda": ["model.n_topics=4", "model.sweeps=2", "model.vocab_size=300",
                    "model.eval_iter=5"],
}




def _family(example: Path) -> str:
    import yaml

    return yaml.safe_load(example.read_text())["model"]["family"]


def _fedctl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_fedctl(*args, timeout=timeout)


OWN_PROCESS = ("mlp_multiclass", "nmf_mi_fedadam")


def _use(example: Path, *args: str) -> subprocess.CompletedProcess:
    """``fedctl ARGS`` for a command that uses a trained model (predict, topics)."""
    if example.stem in OWN_PROCESS:
        return _fedctl(*args)
    from click.testing import CliRunner

    from fedctl.cli import main

    result = CliRunner().invoke(main, list(args), prog_name="fedctl")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, stderr)


def test_every_registered_family_has_an_example() -> None:
    assert {_family(e) for e in EXAMPLES} == set(SERVER_FAMILIES)
    assert set(SMALL) == set(SERVER_FAMILIES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_its_model_is_usable(example: Path, tmp_path: Path) -> None:
    family = _family(example)
    out = tmp_path / "out"
    tracked = example.stem == "mlp_multiclass"  # one run tracks to TensorBoard and MLflow
    # Ports of its own rather than the examples' 5555 / 5556, which another test (or another
    # program on this machine) may be using meanwhile.
    pub, rep = free_ports(2)
    sets = [f"--set={s}" for s in ["workers=[w1, w2]", "min_workers=2", "data.limit=600",
                                   f"master.pub_port={pub}", f"master.rep_port={rep}",
                                   *SMALL[family]]]
    if tracked:
        sets += ["--set=tracking.tensorboard=true", "--set=tracking.mlflow=true"]
    rounds = "5" if family == "prodlda" else "2"
    proc = _fedctl("run", "--config", str(example), "--rounds", rounds, "-o", str(out),
                   "--no-progress", *sets)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trained"][next(iter(summary["trained"]))] > 0
    # The master's log names the folder the results are in, not the staging one it wrote.
    assert f"results in {out} (" in (out / "logs" / "master.log").read_text()
    assert (out / "curves.png").stat().st_size > 10_000
    model_json = json.loads((out / "model.json").read_text())
    assert model_json["family"] == family and model_json["fedctl_version"]
    if example.stem == "mlp_multiclass":  # it named the config's unused positive class
        assert model_json["task"] == {"task": "multiclass"}, model_json["task"]
    # baselines on: the centralized column is filled (iFTM's since its baseline was added)
    assert all(any(v is not None for k, v in row.items() if k.startswith("centralized_"))
               for row in summary["comparison"]), summary["comparison"]
    assert "Centralized: n/a" not in (out / "comparison.md").read_text()
    if family not in ("lda", "sentencelda"):  # (composed per party: no one pooled model)
        assert summary["pooled"]["centralized"]

    from common.config import load_config
    from common.data.shards import local_data

    cfg = load_config(out / "cluster.yaml")
    data = local_data(cfg, "w1")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in data.dataset.texts[:50]))
    pred = _use(example, "predict", str(out), str(docs), "-o", str(tmp_path / "p.jsonl"),
                "--no-progress")
    assert pred.returncode == 0, pred.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(lines) == 50
    assert [line["line"] for line in lines] == list(range(1, 51))  # each matched to its input
    key = {"mlp": "label", "fstc": "cluster"}.get(family, "topic")
    assert all(key in line for line in lines)
    if key == "topic":
        topics = _use(example, "topics", str(out), "-n", "5")
        assert topics.returncode == 0, topics.stderr
        assert len(topics.stdout.splitlines()) == len(lines[0]["mixture"])
    _agrees_with_the_cluster(family, out, summary)
    if family in ("lda", "sentencelda"):  # the noise the topics were made under, said
        from common.privacy.laplace import laplace_epsilon

        eps = laplace_epsilon(family, load_config(out / "cluster.yaml").family_params)
        assert eps and summary["laplace_epsilon"] == eps
        assert f"Laplace noise of ε {eps:g} (iFTM)" in (out / "comparison.md").read_text()
    if family == "fstc":  # no text, no cluster
        from fedctl import load_model

        assert load_model(out).records([""]) == [{"cluster": None, "proba": None, "empty": True}]
    if summary.get("privacy") or summary.get("laplace_epsilon"):  # what it spent, shown
        from click.testing import CliRunner

        from fedctl.cli import main

        shown = CliRunner().invoke(main, ["show", str(out)], prog_name="fedctl").stdout
        assert re.search(r"^privacy: .*ε \d", shown, re.MULTILINE), shown
    if family == "combinedtm":  # it read the embedding of nothing and gave a topic
        from fedctl import load_model

        assert load_model(out).records([" "]) == [{"topic": None, "mixture": None,
                                                   "top_topics": [], "known_words": 0,
                                                   "empty": True}]
    if family in ("mlp", "nmf"):
        _misused(out, docs, tmp_path)
    if tracked:
        _tracked(out, summary)


def _misused(out: Path, docs: Path, tmp_path: Path) -> None:
    """What a careless user does with a trained model gets one line, never a traceback or a
    silent wrong answer."""
    from click.testing import CliRunner

    import fedctl as fedctl_module
    from fedctl import load_model
    from fedctl.cli import main
    from fedctl.inference import ModelError, TopicModel

    model = load_model(out)
    use = model.transform if isinstance(model, TopicModel) else model.predict
    with pytest.raises(ModelError, match="got one string: wrap it in a list"):
        use("one document")  # used to be one document a character
    with pytest.raises(ModelError, match=r"texts\[1\]: expected a string, got int"):
        use(["a document", 7])
    with pytest.raises(ModelError, match=r"texts\[1\]: not valid text: half of a character"):
        use(["a document", "bad \ud800"])  # (a JSON escape: the embedding's cache key broke)
    assert len(use([])) == 0
    assert len(use(np.array(["a document", "another"]))) == 2  # texts, not "features"
    if isinstance(model, TopicModel):
        with pytest.raises(ModelError, match="n: expected an integer >= 1"):
            model.get_topics(-1)
        # No word it knows: no topic (it was topic 0, at weight 0).
        known = json.loads(docs.read_text().splitlines()[0])["text"]
        unknown = model.predict(["", "日本語のテキスト", known]).tolist()
        assert unknown[:2] == [-1, -1] and unknown[2] >= 0
        (record,) = model.records([" "])  # CombinedTM gave it the embedding of nothing's
        assert record == {"topic": None, "mixture": None, "top_topics": [], "known_words": 0,
                          "empty": True}, record
        return
    # New texts are embedded, not kept: a model called in a loop left two cache files a call.
    cache = tmp_path / "own_cache"
    model.run.config.data.cache_dir = str(cache)
    new = ["a text this test made up", "and another one"]
    model.predict(new)
    assert not list(cache.glob("*.npy*")), list(cache.iterdir())
    model.keep_embeddings = True  # (what `fedctl predict FILE` asks)
    model.predict(new)
    assert len(list(cache.glob("*.npy"))) == 1
    # No text: no label (it was the label of the embedding of nothing, at full confidence).
    blank, real = model.records(t for t in ["  ", "a document about a bus"])  # (a generator)
    assert blank == {"label": None, "proba": None, "empty": True} and real["label"]

    def fedctl(*args: str) -> str:
        result = CliRunner().invoke(main, list(args), prog_name="fedctl")
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            "".join(traceback.format_exception(result.exception))
        (line,) = result.stderr.strip().splitlines()
        return line

    with pytest.raises(ModelError, match="got a dict"):
        model.predict({"a document": 1})  # was its keys, predicted
    features = np.zeros((2, model.input_dim), dtype=np.float32)
    features[1, 3] = np.nan
    with pytest.raises(ModelError, match="1 row.s. hold NaN or infinity .the first: row 1"):
        model.predict(features)  # was a NaN probability, in silence
    with pytest.raises(ModelError, match="device: unknown device 'gpu'"):
        load_model(out, device="gpu")  # was torch's RuntimeError, and "cuda" its AssertionError
    assert "load_model" in dir(fedctl_module)
    ids = tmp_path / "ids.jsonl"
    ids.write_text('\ufeff{"text": "a ship", "id": "doc-7"}\n\n{"text": "a band"}\n')  # BOM
    shown = CliRunner().invoke(main, ["predict", str(out), str(ids), "--no-progress"],
                               prog_name="fedctl")
    assert shown.exit_code == 0, shown.output
    rows = [json.loads(x) for x in shown.stdout.splitlines()]
    assert [(r["line"], r.get("id")) for r in rows] == [(1, "doc-7"), (3, None)]
    # JSONL by any other name, or piped in, is JSONL: read as plain text, every whole JSON
    # line (a label too) was embedded, and the ids were dropped, in silence.
    piped = CliRunner().invoke(main, ["predict", str(out), "-", "--no-progress", "-o", "-"],
                               input=ids.read_bytes(), prog_name="fedctl")
    assert piped.exit_code == 0, piped.output
    assert piped.stdout == shown.stdout
    # Objects without a "text", piped in, were read as plain text: each whole JSON line
    # embedded, the ids dropped, in silence.
    untexted = CliRunner().invoke(main, ["predict", str(out), "-", "--no-progress"],
                                  input=b'{"body": "a ship", "id": 1}\n', prog_name="fedctl")
    assert untexted.exit_code == 1
    assert untexted.stderr.strip() == 'Error: -:1: expected an object with a "text" string'
    named = tmp_path / "ids.TXT"
    named.write_bytes(ids.read_bytes())
    again = CliRunner().invoke(main, ["predict", str(out), str(named), "--no-progress"],
                               prog_name="fedctl")
    assert again.stdout == shown.stdout, again.output
    # A table: its "text" column (quoted commas and line breaks), its "id", and the line each
    # row begins on; it was read as plain text, its header and every column embedded.
    table = tmp_path / "docs.csv"
    table.write_text('id,text,label\ndoc-7,a ship,x\n\n8,"a band, from\nOhio",y\n')
    rows = [json.loads(x) for x in CliRunner().invoke(
        main, ["predict", str(out), str(table), "--no-progress"], prog_name="fedctl"
    ).stdout.splitlines()]
    assert [(r["line"], r["id"]) for r in rows] == [(2, "doc-7"), (4, "8")], rows
    assert {k: v for k, v in rows[0].items() if k not in ("line", "id")} == {
        k: v for k, v in json.loads(shown.stdout.splitlines()[0]).items()
        if k not in ("line", "id")}
    # A TSV is not quoted (a review may begin with "), a CSV's open quote is an error, not
    # the rows after it swallowed into one document; blank lines before the header, an empty
    # id, a document longer than the csv module's default field.
    (tmp_path / "q.tsv").write_text('\n\nid\ttext\n1\tgood\n\t"Terrible film\n3\t' + "ok " * 50_000
                                    + "\n")
    rows = [json.loads(x) for x in CliRunner().invoke(
        main, ["predict", str(out), str(tmp_path / "q.tsv"), "--no-progress"],
        prog_name="fedctl").stdout.splitlines()]
    assert [(r["line"], r.get("id")) for r in rows] == [(4, "1"), (5, None), (6, "3")], rows
    (tmp_path / "open.csv").write_text('text\n"a, b\nc\n')
    assert "open.csv:3: not readable as a table (unexpected end of data)" in fedctl(
        "predict", str(out), str(tmp_path / "open.csv"))
    (tmp_path / "no_text.tsv").write_text("a\tb\n1\t2\n")
    assert 'no_text.tsv:1: expected a header naming a "text" column (found: a, b)' in fedctl(
        "predict", str(out), str(tmp_path / "no_text.tsv"))
    late = tmp_path / "late.txt"
    late.write_bytes(b"a ship\n" * 999 + b"caf\xe9\n")
    assert f"{late}:1000: not UTF-8 text" in fedctl("predict", str(out), str(late))
    half = tmp_path / "half.jsonl"
    half.write_text('{"text": "a ship"}\n{"text": "bad \\ud800"}\n')
    assert f"{half}:2: field 'text' is not valid text: half of a character" in fedctl(
        "predict", str(out), str(half))

    before = docs.read_bytes()
    assert "that is INPUT" in fedctl("predict", str(out), str(docs), "-o", str(docs))
    model_before = (out / "model.json").read_bytes()
    assert f"that is {out}'s own file (model.json)" in fedctl(
        "predict", str(out), str(docs), "-o", str(out / "model.json"))
    assert (out / "model.json").read_bytes() == model_before  # it was the predictions
    assert docs.read_bytes() == before
    assert "a picture's name ends in one of" in fedctl("plot", str(out), "-o",
                                                        str(tmp_path / "c.txt"))
    assert "no folder" in fedctl("plot", str(out), "-o", str(tmp_path / "nope" / "c.png"))
    assert f"that is the run {out.resolve()}'s own curves.png" in fedctl(
        "plot", str(out), str(out), "-o", str(out / "curves.png"))
    early = tmp_path / "early.failed"  # a run that failed while its data was embedded
    early.mkdir()
    (early / C.FAILED_NOTE).write_text("exit code 130: interrupted before the cluster started\n")
    assert (f"{early}: a run that failed before it recorded anything, nothing to draw (exit "
            f"code 130: interrupted") in fedctl("plot", str(early), "-o", str(tmp_path / "e.png"))
    runs = tmp_path / "runs"
    damaged = runs / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "model.json").write_text("{")
    assert f"{damaged / 'model.json'}: not readable JSON" in fedctl("show", str(damaged))
    listed = CliRunner().invoke(main, ["runs", str(runs)], prog_name="fedctl")
    assert listed.exit_code == 0, listed.output
    assert "damaged: model.json unreadable" in listed.stdout
    # A model copied in part, a run that failed, files of two runs: each said in one line.
    (damaged / "model.json").unlink()
    assert f"{damaged / 'model.json'}: missing" in fedctl("predict", str(damaged), str(docs))
    listed = CliRunner().invoke(main, ["runs", str(runs)], prog_name="fedctl")
    assert "damaged: model.json missing" in listed.stdout  # it was listed finished
    shutil.copy(out / "model.json", damaged / "model.json")
    (damaged / "model.npz").write_bytes(b"")  # used to be a bare "Aborted!"
    assert "model.npz: not a readable model" in fedctl("predict", str(damaged), str(docs))
    (damaged / "model.npz").unlink()
    (damaged / "FAILED").write_text("exit code 143: see logs/ (interrupted)\n")
    assert "its run failed: exit code 143" in fedctl("predict", str(damaged), str(docs))
    shutil.copy(out / "model.npz", damaged / "model.npz")
    shown = CliRunner().invoke(main, ["show", str(damaged)], prog_name="fedctl")
    assert "FAILED: exit code 143: see logs/ (interrupted)" in shown.stdout, shown.output
    used = CliRunner().invoke(main, ["predict", str(damaged), str(docs), "--no-progress"],
                              prog_name="fedctl")
    assert used.exit_code == 0 and "its run failed (exit code 143" in used.stderr, used.output
    spec = json.loads((out / "model.json").read_text())
    spec["setup"]["classes"] = spec["setup"]["classes"][:1]
    (damaged / "model.json").write_text(json.dumps(spec))
    assert "do not make one mlp model" in fedctl("predict", str(damaged), str(docs))
    assert "is a file, not a folder" in fedctl("predict", str(out), str(docs), "-o",
                                               str(docs / "p.jsonl"))


def _tracked(out: Path, summary: dict[str, Any]) -> None:
    """The per-round numbers of metrics.jsonl, read back with each library's own reader."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from common.runlog import read_metrics

    rounds = [e for e in read_metrics(out / "metrics.jsonl") if e["event"] == "round"]
    f1 = {e["round"]: e["macro_f1"] for e in read_metrics(out / "metrics.jsonl")
          if e["event"] == "worker_round" and e["worker"] == "w2"}
    acc = EventAccumulator(str(out / "tensorboard")).Reload()
    durations = acc.Scalars("round/duration_s")
    assert [s.step for s in durations] == [e["round"] for e in rounds]
    assert [s.value for s in durations] == pytest.approx([e["duration_s"] for e in rounds],
                                                          rel=1e-6)
    assert {s.step: s.value for s in acc.Scalars("w2/macro_f1")} == pytest.approx(f1, rel=1e-6)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: folder stores opt in
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("fedctl")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == summary["run_id"]
    assert run.data.params["family"] == "mlp"
    history = client.get_metric_history(run.info.run_id, "w2/macro_f1")
    assert {m.step: m.value for m in history} == pytest.approx(f1, rel=1e-6)


def _agrees_with_the_cluster(family: str, out: Path, summary: dict[str, Any]) -> None:
    from common.config import load_config
    from common.data.shards import local_data, sentence_features
    from common.eval.classification import classification_metrics
    from fedctl import load_model

    model = load_model(out)
    cfg = model.run.config
    if family == "mlp":
        for row in summary["comparison"]:
            data = local_data(cfg, row["worker"])
            X = sentence_features(cfg, data.dataset)[data.test_index]
            y_true = np.asarray(data.classes)[data.y_test]
            f1 = classification_metrics(y_true, model.predict(X))  # by class name
            assert f1["macro_f1"] == pytest.approx(row["federated_macro_f1"], abs=1e-12)
    elif family == "nmf":
        # The worker's own final scoring: its test documents over the agreed vocabulary, the
        # topic weights solved with the final topics fixed.
        from worker.families import make_client_family

        client = make_client_family(load_config(out / "cluster.yaml"), local_data(cfg, "w1"),
                                     "cpu", 0)
        client.setup(model.setup)
        client.model.set_arrays(model.run.arrays)
        theirs = client.model.transform(client.x_test)
        ours = model.transform(client.test_texts)
        assert np.allclose(ours, theirs, atol=1e-6)
