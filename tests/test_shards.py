"""Cutting workers' shards out of a shared dataset (common.data.shards.write_shards, `fedctl data
shard`) and checking a cluster.yaml (`fedctl check`), the two commands a real cluster's
deployment runs before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from common.config import ConfigError, load_config, parse_config
from common.data.reading import DataError, read_jsonl
from common.data.shards import local_data, write_shards
from tests.conftest import DATA, MakeConfig, Procs, run_fedctl

WORKERS = ["w1", "w2", "w3"]


def _config(tmp_path: Path, **data: object) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "workers": WORKERS, "output_dir": str(tmp_path / "out"), "seed": 3,
        "data": {"path": str(DATA), "limit": 300, **data}}))
    return path


def _texts(shard) -> set[str]:
    return {shard.dataset.texts[i] for i in [*shard.train_index, *shard.test_index]}


def test_each_shard_holds_the_documents_its_worker_takes_in_fedctl_run(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path))
    report = write_shards(cfg, tmp_path / "shards")
    assert report.written == WORKERS and report.unchanged == []
    assert sum(report.sizes.values()) == 300
    for name in WORKERS:
        shared = local_data(cfg, name)
        path = tmp_path / "shards" / f"{name}.jsonl"
        own = read_jsonl(path)
        assert len(own.texts) == report.sizes[name] == shared.n_train + len(shared.test_index)
        assert set(own.texts) == _texts(shared)
        # the worker reading its file (workers[].data) holds the same documents and labels
        from_file = local_data(cfg, name, data_path=str(path))
        assert _texts(from_file) == _texts(shared)
        assert sorted(from_file.dataset.labels) == sorted(
            shared.dataset.labels[i] for i in [*shared.train_index, *shared.test_index])


def test_cutting_again_rewrites_nothing(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path))
    write_shards(cfg, tmp_path / "shards")
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "shards").iterdir()}
    again = write_shards(cfg, tmp_path / "shards")
    assert again.written == [] and again.unchanged == WORKERS
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "shards").iterdir()} == stamps


def test_a_users_own_file_is_never_replaced_without_force(tmp_path: Path) -> None:
    """`fedctl data shard -o DIR` replaced a user's own DIR/w1.jsonl without a word. Files it
    wrote itself are still rewritten when the cut changes; another is left alone (nothing
    written) unless --force."""
    cfg = load_config(_config(tmp_path))
    out = tmp_path / "shards"
    out.mkdir()
    mine = out / "w2.jsonl"
    mine.write_text('{"text": "my own documents", "label": "a"}\n')
    with pytest.raises(DataError, match=r"w2.jsonl: already there, and not as `fedctl data "
                                        r"shard` left it \(edited since, your own.* --force"):
        write_shards(cfg, out)
    assert mine.read_text().startswith('{"text": "my own') and not (out / "w1.jsonl").exists()
    proc = run_fedctl("data", "shard", "--config", str(tmp_path / "cluster.yaml"), "-o",
                      str(out))
    assert proc.returncode == 1 and "--force" in proc.stderr and "Traceback" not in proc.stderr
    mine.unlink()
    write_shards(cfg, out)
    cfg.data.limit = 200  # a cut of its own files again: rewritten without --force
    assert sorted(write_shards(cfg, out).written) == WORKERS
    # A cut made before the manifest was kept: its files are adopted where they are what
    # the cut writes, and rewritten when it changes.
    (out / ".fedctl-shards.json").unlink()
    assert write_shards(cfg, out).unchanged == WORKERS
    cfg.data.limit = 250
    assert sorted(write_shards(cfg, out).written) == WORKERS
    (out / "w1.jsonl").write_text("edited by hand\n")
    with pytest.raises(DataError, match="w1.jsonl: already there"):
        write_shards(cfg, out)
    assert write_shards(cfg, out, force=True).written == ["w1"]


def test_named_workers_split_the_data_among_themselves_without_a_worker_list(
        tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, partition="iid"))
    cfg.workers = []
    report = write_shards(cfg, tmp_path / "shards", ["a", "b"])
    assert sorted(report.sizes) == ["a", "b"] and sum(report.sizes.values()) == 300
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.jsonl")) == ["a.jsonl",
                                                                          "b.jsonl"]


def test_named_workers_of_a_list_get_their_own_shares(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, partition="iid"))
    every = write_shards(cfg, tmp_path / "all").sizes
    some = write_shards(cfg, tmp_path / "some", ["w3", "w1"]).sizes
    assert some == {"w3": every["w3"], "w1": every["w1"]}
    assert ((tmp_path / "some" / "w3.jsonl").read_bytes()
            == (tmp_path / "all" / "w3.jsonl").read_bytes())


@pytest.mark.parametrize("names", [["a", "a"], ["../outside"], [".."], []])
def test_bad_worker_names_are_refused(tmp_path: Path, names: list[str]) -> None:
    cfg = load_config(_config(tmp_path))
    cfg.workers = [] if not names else cfg.workers
    with pytest.raises(ConfigError, match="workers: "):
        write_shards(cfg, tmp_path / "shards", names or None)
    assert not (tmp_path / "shards").exists()


def test_an_unusable_shard_stops_the_cut_before_anything_is_written(tmp_path: Path) -> None:
    data = tmp_path / "tiny.jsonl"
    rows = [{"text": f"bus number {i}", "label": "MeanOfTransportation" if i == 0 else "Other"}
            for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config({"workers": WORKERS, "output_dir": str(tmp_path / "out"),
                        "data": {"path": str(data), "partition": "iid"}})
    with pytest.raises(DataError, match=r"the shard of worker w\d .*cannot be used"):
        write_shards(cfg, tmp_path / "shards")
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())


def test_fedctl_data_shard(tmp_path: Path) -> None:
    config = _config(tmp_path)
    out = tmp_path / "shards"
    first = run_fedctl("data", "shard", "--config", str(config), "--out", str(out), "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["written"] == WORKERS and sum(report["sizes"].values()) == 300
    second = run_fedctl("data", "shard", "--config", str(config), "--out", str(out))
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("(unchanged)") == 3
    bad = run_fedctl("data", "shard", "--config", str(config), "--out", str(out),
                     "--data", str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [f"Error: {tmp_path / 'missing.jsonl'}: no such file"]
    # One worker's file made again alone is its share, not the whole dataset (a name used to
    # replace the worker list: `shard w3` wrote every document to w3.jsonl).
    (out / "w3.jsonl").unlink()
    again = run_fedctl("data", "shard", "--config", str(config), "--out", str(out), "--json",
                       "w3")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["sizes"] == {"w3": report["sizes"]["w3"]}
    stranger = run_fedctl("data", "shard", "--config", str(config), "--out", str(out), "w7")
    assert stranger.returncode == 1 and "w7 is not among the cluster's workers" in stranger.stderr
    assert not (out / "w7.jsonl").exists()
    # The shards of `fedctl run --workers 5` (the README offers both; shard had no --workers)
    five = run_fedctl("data", "shard", "--config", str(config), "--out", str(tmp_path / "five"),
                      "--workers", "5", "--json")
    assert five.returncode == 0, five.stderr
    cut = load_config(config).with_workers(5)
    for w in ("w1", "w5"):
        share = local_data(cut, w)
        rows = sorted(int(i) for i in [*share.train_index, *share.test_index])
        texts = [json.loads(x)["text"] for x in
                 (tmp_path / "five" / f"{w}.jsonl").read_text().splitlines()]
        assert texts == [share.dataset.texts[i] for i in rows]


def test_fedctl_check_refuses_a_single_class_for_the_classifier(tmp_path: Path) -> None:
    """`check` said valid, and `fedctl run` started the cluster before the master failed on
    'need at least 2 classes'."""
    data = tmp_path / "one.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i}", "label": "X"}) + "\n"
                            for i in range(60)))
    config = _config(tmp_path, path=str(data), task="multiclass")
    result = run_fedctl("check", "--config", str(config))
    assert result.returncode == 1, result.stdout
    assert result.stderr.strip().splitlines() == [
        f"Error: {config}: data: the workers' training documents hold 1 class(es) (X) and the "
        "classifier needs at least 2: another data.path, or data.task one_vs_rest with "
        "data.positive"]


def test_check_of_the_union_waits_for_every_workers_documents(tmp_path: Path) -> None:
    """The master's node holds w1's file only (w2's and w3's are on their nodes): one class
    there says nothing of the union, so the class check is left to the master's setup."""
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({"text": f"document number {i}", "label": "X"}) + "\n"
                           for i in range(60)))
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "workers": [{"name": "w1", "data": str(one)},
                    {"name": "w2", "data": "/elsewhere/w2.jsonl"},
                    {"name": "w3", "data": "/elsewhere/w3.jsonl"}],
        "output_dir": str(tmp_path / "out"), "data": {"task": "multiclass"}}))
    result = run_fedctl("check", "--config", str(config), "--no-ports")
    assert result.returncode == 0, result.stderr
    assert "w2, w3: own file not on this host, not read" in result.stdout


def test_fedctl_check_refuses_more_min_workers_than_workers(tmp_path: Path) -> None:
    """The master would wait out join_timeout for workers nobody lists."""
    config = _config(tmp_path)
    result = run_fedctl("check", "--config", str(config), "--set", "min_workers=5")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {config}: min_workers: 5, more than the 3 worker(s) listed"]
    more = run_fedctl("check", "--config", str(config), "--set", "min_workers=5",
                      "--workers", "6", "--no-ports")
    assert "min_workers" not in more.stderr  # --workers 6 lists enough


def test_fedctl_check_accepts_a_good_file(tmp_path: Path) -> None:
    config = _config(tmp_path)
    result = run_fedctl("check", "--config", str(config), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["workers"] == WORKERS and summary["family"] == "mlp"
    human = run_fedctl("check", "--config", str(config), "--no-family")
    assert human.returncode == 0 and "valid" in human.stdout


@pytest.mark.parametrize(("model", "field"), [
    ({"family": "nosuch"}, "model.family: unknown family 'nosuch'"),
    ({"family": "nmf", "n_topics": 0}, "model.n_topics: expected an integer >= 1"),
])
def test_fedctl_check_names_the_bad_field_in_one_line(tmp_path: Path, model: dict,
                                                      field: str) -> None:
    config = _config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    new = tmp_path / "cluster.yaml.new"
    new.write_text(yaml.safe_dump({**raw, "model": model}))
    result = run_fedctl("check", "--config", str(new), "--as", "/opt/fedctl/etc/cluster.yaml")
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: /opt/fedctl/etc/cluster.yaml: {field}"), line


def test_a_run_on_the_workers_own_files_says_why_it_has_no_centralized_baseline(
        tmp_path: Path) -> None:
    """Each worker reads its own file (a real deployment's layout): nobody can pool the data,
    and the table's centralized columns, all n/a, say so under the table."""
    cfg = load_config(_config(tmp_path))
    write_shards(cfg, tmp_path / "shards")
    config = tmp_path / "own.yaml"
    config.write_text(yaml.safe_dump({
        "workers": [{"name": w, "data": str(tmp_path / "shards" / f"{w}.jsonl")}
                    for w in WORKERS],
        "model": {"family": "nmf", "n_topics": 5, "vocab_size": 300},
        "rounds": 1, "output_dir": str(tmp_path / "out"), "baselines": True,
        "security": {"mode": "none"}, "data": {"task": "multiclass"}}))
    result = run_fedctl("run", "--config", str(config), "--no-progress", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "Centralized: n/a: the workers' documents are not all on this machine." in table


def test_baselines_pool_only_what_the_workers_trained_on(tmp_path: Path) -> None:
    """The master pools data.path's split for its centralized baseline: a configured worker
    that never joined had its share pooled, and one started with `--data` of its own was
    scored on its share of data.path, as if it had trained on it."""
    from master.baselines import simulation_mismatch

    cfg = load_config(_config(tmp_path))
    shards = {w: local_data(cfg, w) for w in WORKERS}
    reports = {w: {"n_train": s.n_train, "n_test": len(s.test_index)} for w, s in shards.items()}
    assert simulation_mismatch(cfg, reports) is None
    assert simulation_mismatch(cfg, {w: reports[w] for w in ("w1", "w2")}) == (
        "w3 never joined, and the pooled data would hold its share")
    assert simulation_mismatch(cfg, {**reports, "w3": None}) is None  # no report: no word
    own = {**reports, "w2": {"n_train": 40, "n_test": 10}}
    said = simulation_mismatch(cfg, own)
    share = shards["w2"].n_train
    assert said is not None and said.startswith(
        f"w2 trained on 40 documents and tested on 10, not its share of data.path ({share}")


@pytest.mark.slow
def test_a_worker_on_data_of_its_own_leaves_the_centralized_columns_empty(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """w3 started with `fedctl worker --data` (a file of 80 documents): the table says why
    there is no centralized baseline instead of scoring one on data w3 never had."""
    own = tmp_path / "own.jsonl"
    own.write_text("".join(DATA.read_text().splitlines(keepends=True)[:80]))
    cfg = make_config(tmp_path, workers=3, rounds=1, baselines=True,
                      model={"family": "mlp", "hidden": 8})
    procs.master(cfg)
    procs.worker(cfg, "w1")
    procs.worker(cfg, "w2")
    procs.worker(cfg, "w3", "--data", str(own))
    assert set(procs.wait_all(timeout=240).values()) == {0}, procs.logs_tail()
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "Centralized: n/a: w3 trained on 64 documents and tested on 16" in table, table
    assert "All workers' test splits pooled" not in table


def test_a_file_too_small_to_split_is_named_with_its_worker(tmp_path: Path) -> None:
    """`fedctl check --id w1 --data one_line.jsonl` said 'a shard of 1 row(s) cannot be split
    into train and test', naming neither the file nor the worker."""
    one = tmp_path / "one.jsonl"
    one.write_text(DATA.read_text().splitlines()[0] + "\n")
    cfg = load_config(_config(tmp_path, task="multiclass"))
    with pytest.raises(DataError, match=rf"^{one} \(w1's data\): a shard of 1 row\(s\) cannot"):
        local_data(cfg, "w1", str(one))
