"""Run history for `fedctl master` as for `fedctl run`: an output folder named `latest` gives
each run a folder of its own, `--resume` finds the newest unfinished one, `fedctl runs` lists
them. Folders made by hand here; the cluster runs that fill them are tested elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from common import constants as C
from common.atomic import hold_lock
from common.config import ConfigError
from fedctl.run import output_folder, point_history_link, resume_folder
from fedctl.runs import list_runs


def _run_dir(root: Path, name: str, finished: bool, checkpoint: bool = True,
             start: float = 1.0) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"event": "start", "time": start}) + "\n"
                                     + json.dumps({"event": "done", "time": start + 3.5})
                                     + "\n")
    if checkpoint:
        (d / "checkpoint.npz").write_bytes(b"x")
    if finished:
        (d / "model.npz").write_bytes(b"x")
        (d / "model.json").write_text(json.dumps({"family": "mlp"}))
        (d / "summary.json").write_text(json.dumps({
            "rounds": 3, "workers": ["w1", "w2"],
            "comparison": [{"worker": "w1", "federated_macro_f1": 0.8},
                           {"worker": "w2", "federated_macro_f1": 0.6}]}))
    time.sleep(0.01)  # distinct modification times, oldest first
    return d


def test_resume_finds_the_newest_unfinished_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    old = _run_dir(runs, "20260101T000000Z-aaaaaa", finished=False)
    _run_dir(runs, "20260102T000000Z-bbbbbb", finished=True)
    newer = _run_dir(runs, "20260103T000000Z-cccccc", finished=False)
    assert resume_folder(runs / "latest") == newer
    os.utime(old, None)  # the one touched last is the one to continue
    assert resume_folder(runs / "latest") == old
    with pytest.raises(ConfigError, match="no unfinished run"):
        resume_folder(tmp_path / "elsewhere" / "latest")


def test_new_runs_get_new_folders_and_latest_follows_the_finished(tmp_path: Path) -> None:
    from common.config import parse_config

    runs = tmp_path / "runs"
    cfg = parse_config({"output_dir": str(runs / "latest")})
    a, b = output_folder(cfg), output_folder(cfg)
    assert a != b and a.parent == b.parent == runs
    done = _run_dir(runs, "20260102T000000Z-bbbbbb", finished=True)
    point_history_link(runs / "latest", done)
    assert (runs / "latest").resolve() == done.resolve()


def test_a_stopped_run_that_can_be_resumed_is_not_replaced_without_overwrite(
        tmp_path: Path) -> None:
    """Ctrl-C leaves <output>.failed with its checkpoint and the command to resume it; a
    `fedctl run -o` into it replaced it, checkpoint and all."""
    from common.config import parse_config

    stopped = _run_dir(tmp_path, "out.failed", finished=False)
    cfg = parse_config({"output_dir": str(stopped)})
    with pytest.raises(ConfigError, match="holds a stopped run that can be resumed"):
        output_folder(cfg)
    assert output_folder(cfg, overwrite=True) == stopped
    # A name the file system takes, but not with what fedctl puts after it for the folders
    # beside it: said, not Errno 36 (after all the training, when it was .old-<id>).
    long = parse_config({"output_dir": str(tmp_path / ("a" * 240))})
    with pytest.raises(ConfigError, match="its name is 240 bytes long, and fedctl names folders "
                                          r"beside it after it .*: at most 234 here"):
        output_folder(long)
    # A stopped run beside: its <out>.failed, which the next failure there would replace.
    beside = parse_config({"output_dir": str(tmp_path / "out")})
    with pytest.raises(ConfigError, match=r"out.failed holds a stopped run that can be resumed"):
        output_folder(beside)


def test_a_run_stopped_before_its_cluster_started_does_not_point_at_empty_logs(
        tmp_path: Path) -> None:
    """Ctrl-C while the documents are embedded: the FAILED note said "see logs/" of a folder
    with no log in it."""
    from fedctl.run import _keep_failed

    for name, logged in (("early", False), ("late", True)):
        staging = tmp_path / f"{name}.partial"
        (staging / "logs").mkdir(parents=True)
        if logged:
            (staging / "logs" / "master.log").write_text("...\n")
        _keep_failed(staging, tmp_path / name, 130)
        note = (tmp_path / f"{name}.failed" / "FAILED").read_text().strip()
        assert note == ("exit code 130: see logs/ (interrupted)" if logged else
                        "exit code 130: interrupted before the cluster started (no process "
                        "logs)")
    # A later failure beside a resumable one keeps it (it was replaced, checkpoint and all).
    (tmp_path / "late.failed" / "checkpoint.npz").write_bytes(b"x")
    (tmp_path / "late.partial" / "logs").mkdir(parents=True)
    _keep_failed(tmp_path / "late.partial", tmp_path / "late", 1)
    assert (tmp_path / "late.failed" / "checkpoint.npz").is_file()
    assert len(list(tmp_path.glob("late.failed-*"))) == 1


def test_fedctl_runs_lists_each_run_once_with_its_state(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _run_dir(runs, "20260101T000000Z-aaaaaa", finished=False)
    done = _run_dir(runs, "20260102T000000Z-bbbbbb", finished=True)
    failed = _run_dir(runs, "20260103T000000Z-cccccc.failed", finished=False)
    (failed / "FAILED").write_text("exit code 1\n")
    # Stopped by Ctrl-C with its checkpoint: failed, and still resumable.
    stopped = _run_dir(runs, "20260104T000000Z-dddddd.failed", finished=False, checkpoint=True)
    (stopped / "FAILED").write_text("interrupted\n")
    (failed / "checkpoint.npz").unlink()
    point_history_link(runs / "latest", done)
    listed = list_runs(runs)
    assert [e["path"].name for e in listed] == ["20260101T000000Z-aaaaaa",
                                                "20260102T000000Z-bbbbbb",
                                                "20260103T000000Z-cccccc.failed",
                                                "20260104T000000Z-dddddd.failed"]
    assert [e["state"] for e in listed] == ["stopped, resumable", "finished", "failed",
                                            "failed, resumable"]
    assert listed[1]["score"] == "macro-F1 0.7000" and listed[1]["wall_s"] == 3.5
    assert listed[0]["wall_s"] is None  # its events say nothing of how long its master lived
    # A failed run lasted until its FAILED note, not its last event (4 minutes showed 18 s).
    began = listed[2]["started"]
    os.utime(failed / "FAILED", (began + 240, began + 240))
    assert list_runs(runs)[2]["wall_s"] == pytest.approx(240)
    # A master alive in it holds its lock: running, its wall the time since it began.
    fd = hold_lock(runs / "20260101T000000Z-aaaaaa" / C.MASTER_LOCK)
    try:
        running = list_runs(runs)[0]
    finally:
        os.close(fd)
    assert running["state"] == "running" and running["wall_s"] > 1e9
    assert listed[1]["started"] == 1.0
    # A project's copy holds a cluster.yaml too: it is no run (it was listed as one, running).
    (runs / "project").mkdir()
    (runs / "project" / "cluster.yaml").write_text("workers: [w1]\n")
    assert "project" not in [e["path"].name for e in list_runs(runs)]


def test_fedctl_runs_says_when_and_refuses_a_missing_folder(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedctl.cli import main

    runs = tmp_path / "runs"
    _run_dir(runs, "20260102T000000Z-bbbbbb", finished=True)
    shown = CliRunner().invoke(main, ["runs", str(runs)], prog_name="fedctl")
    assert shown.exit_code == 0, shown.output
    header, row = shown.stdout.splitlines()
    assert header.split()[:3] == ["run", "started", "family"]
    assert time.strftime("%Y-%m-%d %H:%M", time.localtime(1.0)) in row
    missing = CliRunner().invoke(main, ["runs", str(tmp_path / "nope")], prog_name="fedctl")
    assert missing.exit_code == 1 and "no such folder" in missing.stderr


def test_fedctl_runs_lists_runs_by_when_they_began(tmp_path: Path) -> None:
    """Newest last by start, not by the folder's time: a prediction saved in an old run's
    folder moved it to the end."""
    runs = tmp_path / "runs"
    first = _run_dir(runs, "zz-first", finished=True, start=100.0)
    _run_dir(runs, "aa-second", finished=True, start=200.0)
    (first / "predictions.jsonl").write_text("{}\n")  # touches the folder last
    assert [e["path"].name for e in list_runs(runs)] == ["zz-first", "aa-second"]


def test_a_runs_label_names_what_aggregated_and_copies_are_not_seeds(tmp_path: Path) -> None:
    """lda and fstc aggregate by their own rule: their config's fedavg is an unused default
    (show and plot said fedavg). A run and its copy share a seed: two runs, not two seeds."""
    from common.config import load_config
    from fedctl.plots import _label, _seed
    from fedctl.runs import strategy_name

    lda, copy, mlp = (tmp_path / n for n in ("lda", "copy", "mlp"))
    for d, family, seed in ((lda, "lda", 0), (copy, "lda", 0), (mlp, "mlp", 3)):
        d.mkdir()
        (d / "cluster.yaml").write_text(f"workers: [w1]\nmodel: {{family: {family}}}\n"
                                        f"seed: {seed}\n")
    assert strategy_name(load_config(lda / "cluster.yaml")) == "its own rule"
    assert _label(lda) == "lda (its own rule)" and _label(mlp) == "mlp fedavg"
    assert _seed(lda) == _seed(copy) != _seed(mlp)
    # prodlda's default mode sums gradients and steps Adam at the master: no strategy either.
    ntm = tmp_path / "ntm"
    ntm.mkdir()
    (ntm / "cluster.yaml").write_text("workers: [w1]\nmodel: {family: prodlda}\n")
    assert _label(ntm) == "prodlda synchronous steps"


def test_a_failed_run_resumed_to_its_end_is_listed_finished(tmp_path: Path) -> None:
    """Resumed in its <output>.failed folder, the master removes the FAILED note when it ends
    with something trained; the folder's name alone does not make it failed."""
    runs = tmp_path / "runs"
    resumed = _run_dir(runs, "out.failed", finished=True)
    still = _run_dir(runs, "other.failed", finished=False)
    (still / "FAILED").write_text("exit code 143\n")
    states = {e["path"].name: e["state"] for e in list_runs(runs)}
    assert states == {"out.failed": "finished", "other.failed": "failed, resumable"}
    assert resumed.is_dir()


def test_only_a_resumed_run_of_a_history_moves_its_latest_link(tmp_path: Path) -> None:
    """`fedctl master --config <run>/cluster.yaml --resume` finishes under the history's
    link; a new run in a folder of its own (`fedctl run --output`, whose master writes into
    a .partial folder) and a folder beside some other `latest` link move nothing."""
    from fedctl.run import history_link

    runs = tmp_path / "runs"
    older = _run_dir(runs, "20260101T000000Z-aaaaaa", finished=True)
    run = _run_dir(runs, "20260102T000000Z-bbbbbb", finished=False)
    assert history_link(runs / "latest") == runs / "latest"
    assert history_link(run, resume=True) is None  # no link yet: no history here
    point_history_link(runs / "latest", older)
    assert history_link(run, resume=True) == runs / "latest"
    assert history_link(run) is None  # a new run of its own
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "latest").symlink_to(tmp_path)  # a user's link to anything
    mine = _run_dir(tmp_path / "home", "20260103T000000Z-cccccc", finished=False)
    assert history_link(mine, resume=True) is None
    # `fedctl run`'s own folders beside a history: its .partial one, an --output one.
    for name in ("20260104T000000Z-dddddd.partial", "exp1"):
        assert history_link(_run_dir(runs, name, finished=False), resume=True) is None
    # A link at a run deleted since is still the history's.
    gone = _run_dir(runs, "20260105T000000Z-eeeeee", finished=True)
    point_history_link(runs / "latest", gone)
    shutil.rmtree(gone)
    assert history_link(run, resume=True) == runs / "latest"


def test_a_failed_start_is_removed_and_a_run_that_trained_is_kept(tmp_path: Path) -> None:
    """A new history folder whose master stopped before its first round is taken away (it
    was listed as a run); one that trained a round stays, checkpoint or not (its log says
    why it failed), and so does a folder holding anything of the user's."""
    from fedctl.cli import _drop_if_nothing_trained

    runs = tmp_path / "runs"
    started = runs / "started"
    started.mkdir(parents=True)
    (started / "metrics.jsonl").write_text(json.dumps({"event": "start", "time": 1}) + "\n")
    (started / C.MASTER_LOCK).write_text("")
    trained = runs / "trained"
    trained.mkdir()
    (trained / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        {"event": "start"}, {"event": "round", "round": 1}, {"event": "failed"})))
    users = runs / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    for folder in (started, trained, users):
        _drop_if_nothing_trained(folder)
    assert not started.exists() and trained.is_dir() and users.is_dir()


def test_a_run_that_scored_no_round_is_drawn_with_its_final_scores(tmp_path: Path) -> None:
    """With eval_every: 0 no round is scored: the curves panel was bare axes with no word of
    why. The final model's scores (summary.json) are drawn at the last round, and the panel
    says that no round was scored."""
    import json

    from fedctl.plots import _curves, plot_runs

    run = tmp_path / "run"
    run.mkdir()
    (run / "cluster.yaml").write_text("workers: [w1, w2]\neval_every: 0\n")
    events = [{"event": "round", "round": r, "duration_s": 0.2, "overhead_s": 0.05}
              for r in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {"comparison": [{"worker": "w1", "federated_macro_f1": 0.9},
                              {"worker": "w2", "federated_macro_f1": 0.7}]}
    (run / "summary.json").write_text(json.dumps(summary))
    curves = _curves(events, summary)
    assert curves["score"][0] == "macro_f1"
    assert curves["per_worker"] == {"w1": {2: 0.9}, "w2": {2: 0.7}}
    png = plot_runs([run], tmp_path / "curves.png")
    assert png.stat().st_size > 10_000


def test_runs_of_one_family_and_strategy_are_told_apart_by_what_differs(tmp_path: Path
                                                                         ) -> None:
    """Compared runs of one family and strategy were labelled by their run ids alone (and
    drawn alike: the same curve hid the other): the legend names what differs."""
    from fedctl.plots import _differences, _label, _seedless, plot_runs

    runs = []
    for name, lr, seed in (("a", 0.01, 0), ("b", 0.1, 0), ("c", 0.1, 1)):
        run = tmp_path / name
        run.mkdir()
        (run / "cluster.yaml").write_text(
            f"workers: [w1]\nmodel: {{family: mlp, lr: {lr}}}\nseed: {seed}\n"
            f"data: {{path: {tmp_path / 'docs.jsonl'}}}\n")
        events = [{"event": "round", "round": r, "duration_s": 0.2, "overhead_s": 0.05,
                   "mean_macro_f1": 0.5} for r in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        runs.append(run)
    assert {_label(r) for r in runs} == {"mlp fedavg"}
    groups = sorted({_seedless(r) for r in runs})  # b and c: two seeds of one setting
    assert sorted(_differences(groups) or []) == ["model.lr=0.01", "model.lr=0.1"]
    assert plot_runs(runs, tmp_path / "compared.png").stat().st_size > 10_000


def test_show_tells_a_failed_runs_story_without_a_model(tmp_path: Path) -> None:
    """`fedctl show` of a failed run said only "no model.npz": its job, the rounds it did,
    why it failed and how to go on were all in the folder."""
    from click.testing import CliRunner

    from fedctl.cli import main

    run = _run_dir(tmp_path / "runs", "out.failed", finished=False)
    (run / "cluster.yaml").write_text("workers: [w1, w2]\nrounds: 10\n")
    with (run / "metrics.jsonl").open("a") as f:
        for r in (1, 2, 3):
            f.write(json.dumps({"event": "round", "round": r, "duration_s": 0.1}) + "\n")
    (run / "FAILED").write_text("exit code 130: see logs/ (interrupted)\n")
    shown = CliRunner().invoke(main, ["show", str(run)], prog_name="fedctl")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0] == f"run in {run.resolve()}: failed, resumable, no model"
    assert lines[1] == "FAILED: exit code 130: see logs/ (interrupted)"
    assert lines[2].startswith("family mlp (") and lines[2].endswith("2 worker(s): w1, w2")
    assert lines[3].startswith("rounds done 3 of 10, data ")
    assert lines[4].startswith(f"continue with: fedctl master --config {run / 'cluster.yaml'} "
                               f"--resume")
    (run / "checkpoint.npz").unlink()
    again = CliRunner().invoke(main, ["show", str(run)], prog_name="fedctl").stdout
    assert "failed, no model" in again and "continue with" not in again
    # A master started alone leaves no note: its own `failed` event says why.
    (run / "FAILED").unlink()
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"event": "failed", "reason": "1 worker(s) left", "round": 4}) + "\n")
    alone = CliRunner().invoke(main, ["show", str(run)], prog_name="fedctl").stdout
    assert "FAILED: 1 worker(s) left" in alone, alone
    nothing = CliRunner().invoke(main, ["show", str(tmp_path)], prog_name="fedctl")
    assert nothing.exit_code == 1 and "not a finished fedctl run" in nothing.stderr


def test_hand_edited_run_files_are_one_line_errors_and_hide_no_other_run(
        tmp_path: Path) -> None:
    """Files written by someone else (a hand edit, a damaged copy): a metrics line that is
    not an event, JSON nested past Python's stack, summary fields of another type. Each was a
    traceback, and one such folder ended `fedctl runs` for every other."""
    from click.testing import CliRunner

    from fedctl.cli import main
    from fedctl.runs import read_json

    runs = tmp_path / "runs"
    good = _run_dir(runs, "good", finished=True)
    odd = _run_dir(runs, "odd", finished=True)
    with (odd / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n42\n" + "[" * 200_000 + "\n")
    (odd / "summary.json").write_text(json.dumps({"rounds": 3, "workers": 5, "comparison": 7}))
    listed = CliRunner().invoke(main, ["runs", str(runs)], prog_name="fedctl")
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:] if line.strip()}
    assert rows["good"].rstrip().endswith("finished") and "damaged: " in rows["odd"]
    (odd / "model.json").write_text("[" * 200_000)
    with pytest.raises(ValueError, match="not readable JSON .nested too deep."):
        read_json(odd / "model.json")
    assert good.is_dir()


def test_fedctl_runs_says_how_far_an_unfinished_run_got(tmp_path: Path) -> None:
    """A run stopped at round 40 of 50 was listed with `-` rounds: now `40/50`, from the
    rounds its log holds (those a resume does not run again) and its config's."""
    from click.testing import CliRunner

    from fedctl.cli import main

    runs = tmp_path / "runs"
    stopped = _run_dir(runs, "20260101T000000Z-aaaaaa", finished=False)
    (stopped / "cluster.yaml").write_text("workers: [w1, w2]\nrounds: 50\n")
    with (stopped / "metrics.jsonl").open("a") as fh:
        for r in range(1, 41):
            fh.write(json.dumps({"event": "round", "round": r, "time": 2.0 + r}) + "\n")
    _run_dir(runs, "20260102T000000Z-bbbbbb", finished=True)
    listed = list_runs(runs)
    assert [e["rounds"] for e in listed] == ["40/50", 3]
    shown = CliRunner().invoke(main, ["runs", str(runs)], prog_name="fedctl")
    assert shown.exit_code == 0 and " 40/50 " in shown.stdout, shown.output
