"""A new user's first hour: bad input gets one line naming the problem before anything starts,
runs never mix, a run says what it trained, quiet means quiet, workers share the machine.

Every case runs the real ``fedctl`` command on real files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from common import constants as C
from fedctl.cli import _runs_fedctl
from fedctl.launch import child_env, fedctl_command
from tests.conftest import (
    DATA,
    ROOT,
    MakeConfig,
    Procs,
    descendants,
    kill_tree,
    run_fedctl,
    wait_for,
)


def _interruptible() -> None:
    """In the child, before exec: Ctrl-C's default action. A test run from a background shell
    (`pytest &`, some CI runners) hands its children SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler, so the stop below would go unheard (it did: exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _fedctl(*args: str, timeout: float = 300, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    return run_fedctl(*args, timeout=timeout, env=env)


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _rows(n: int, labelled: bool = True) -> list[str]:
    with open(DATA) as fh:
        rows = [json.loads(line) for _, line in zip(range(n), fh, strict=False)]
    return [json.dumps(r if labelled else {"text": r["text"]}) for r in rows]


# ---------------------------------------------------------------- bad input -> one line
def _bad_case(tmp: Path, case: str) -> tuple[dict[str, Any], str]:
    """A config change (and the files it points to) and the message it must produce."""
    data = tmp / "data.jsonl"
    rows = _rows(200)
    if case == "missing data file":
        return {"data": {"path": str(tmp / "nope.jsonl")}}, f"{tmp / 'nope.jsonl'}: no such file"
    if case == "malformed line":
        data.write_text("\n".join(rows[:5] + ["{not json"] + rows[5:]) + "\n")
        return {"data": {"path": str(data)}}, f"{data}:6: not valid JSON"
    if case == "empty file":
        data.write_text("")
        return {"data": {"path": str(data)}}, f"{data}: empty file (no rows)"
    if case == "classifier without labels":
        data.write_text("\n".join(_rows(200, labelled=False)) + "\n")
        return {"data": {"path": str(data)}}, (
            f"{data}: no 'label' on any row, but family mlp learns from labels")
    if case == "data path is a folder":
        return {"data": {"path": str(tmp)}}, f"data.path: {tmp}: a folder; expected a JSONL file"
    if case == "data not UTF-8":
        data.write_text("\n".join(rows[:5]) + "\n")
        with data.open("ab") as fh:
            fh.write(b'{"text": "caf\xe9", "label": "a"}\n')
        return {"data": {"path": str(data)}}, f"{data}:6: not UTF-8 text (invalid continuation byte"
    if case == "half a character":  # a JSON escape of a lone surrogate: UTF-8 cannot hold it
        data.write_text("\n".join(rows[:5] + ['{"text": "bad \\ud800 here", "label": "a"}'])
                        + "\n")
        return {"data": {"path": str(data)}}, (
            f"{data}:6: field 'text' is not valid text: half of a character (\\ud800")
    if case == "a share without the positive class":  # it read as the file's fault
        return {"workers": 12, "data": {"partition": "dirichlet", "alpha": 0.05}}, (
            "cannot be used: positive class 'MeanOfTransportation' not in the data")
    if case == "sentence model by name":  # a name would be looked up on the Hub
        return {"data": {"embedding_model": "all-MiniLM-L6-v2"}}, (
            f"data.embedding_model: {tmp / 'all-MiniLM-L6-v2'}: not a sentence model's folder")
    if case == "task typo":
        return {"data": {"task": "multiclas"}}, (
            "data.task: expected one of multiclass, one_vs_rest, got 'multiclas'")
    if case == "sync NTM without a whole step":
        return {"rounds": 3, "model": {"family": "prodlda", "n_topics": 4}}, (
            "rounds: 3 round(s) cannot complete one synchronized step of prodlda, which takes "
            "5 rounds")
    if case == "no word survives min_df":
        return {"model": {"family": "nmf", "n_topics": 4, "min_df": 10_000}}, (
            "model.min_df: no word is in 10000 or more of the workers' training documents")
    if case == "strategy option it does not take":
        return {"strategy": {"name": "fedavg", "eta": 0.1}}, (
            "strategy.eta: fedavg takes no option 'eta' (its options: none)")
    if case == "strategy option not a number":
        return {"strategy": {"name": "fedadam", "eta": "x"}}, (
            "strategy.eta: expected a number, got 'x'")
    if case == "seed out of range":
        return {"seed": 2**40}, "seed: expected an integer in [0, 2**32), got 1099511627776"
    if case == "bind not of this host":
        return {"master": {"bind": "999.1.1.1"}}, "master.bind: cannot bind '999.1.1.1'"
    if case == "output_dir a file":
        (tmp / "a_file").write_text("")
        return {"output_dir": str(tmp / "a_file")}, (
            f"output_dir: {tmp / 'a_file'} is a file; expected a folder")
    if case == "output_dir where nothing can be written":  # the run said only "[Errno 2]"
        return {"output_dir": "/proc/fedctl_out"}, (
            "output_dir: /proc/fedctl_out: nothing can be written in /proc")
    if case == "cache_dir under a file":
        (tmp / "a_file").write_text("")
        return {"data": {"cache_dir": str(tmp / "a_file" / "cache")}}, (
            f"data.cache_dir: {tmp / 'a_file' / 'cache'} lies under {tmp / 'a_file'}, a file")
    if case == "a network no memory holds":
        return {"model": {"family": "mlp", "hidden": 10**9}}, (
            "model.hidden: 1000000000 makes a network of 387,000,000,002 parameters")
    if case == "too many clusters":
        return {"model": {"family": "fstc", "n_clusters": 20_000}}, (
            "model.n_clusters: expected 0 (the number of classes) or 2 to 10,000")
    if case == "more clusters than a worker's documents":  # ran past every deadline, silent
        return {"model": {"family": "fstc", "n_clusters": 5_000}}, (
            "model.n_clusters: 5000, more than any worker's documents (the most: ")
    if case == "a privacy budget the first round spends":  # said after the cluster started
        return {"privacy": {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0},
                            "target_epsilon": 0.01}}, (
            "privacy: the first round would take ")
    raise AssertionError(case)


RUN_TOO = ("malformed line", "sync NTM without a whole step")
BAD = ["missing data file", "data path is a folder", "data not UTF-8", "half a character",
       "malformed line", "a share without the positive class",
       "empty file", "classifier without labels", "sentence model by name", "task typo",
       "sync NTM without a whole step", "no word survives min_df",
       # check passed these, and the run failed, or they read as Python's internals
       "strategy option it does not take", "strategy option not a number", "seed out of range",
       "bind not of this host", "output_dir a file", "output_dir where nothing can be written",
       "cache_dir under a file",
       "too many clusters", "more clusters than a worker's documents",
       "a privacy budget the first round spends", "a network no memory holds"]


def test_a_history_link_to_a_deleted_run_is_no_file(make_config: MakeConfig,
                                                    tmp_path: Path) -> None:
    """`runs/latest` may point at a run deleted since: the folder check took the dangling
    link for a file and refused the default job."""
    from common.config import load_config
    from master.preflight import preflight

    (tmp_path / "runs").mkdir()
    os.symlink("20260101T000000Z-abcdef", tmp_path / "runs" / "latest")
    preflight(load_config(make_config(tmp_path, output_dir=str(tmp_path / "runs" / "latest"))),
              ports=False)


@pytest.mark.parametrize("case", BAD)
def test_preflight_refuses_bad_input_in_one_line(make_config: MakeConfig, tmp_path: Path,
                                                 case: str) -> None:
    """The checks `fedctl check` and `fedctl run` make, called as they call them."""
    from common.config import load_config
    from master.preflight import preflight

    change, message = _bad_case(tmp_path, case)
    config = make_config(tmp_path, **change)
    with pytest.raises(ValueError) as info:
        preflight(load_config(config))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_checking_the_default_job_does_not_import_torch() -> None:
    """``fedctl check`` of an mlp job reads its hyperparameters, data and ports, never the
    network: importing torch would cost 1-2 s of every check (common/models/mlp_params.py)."""
    code = ("import sys; from common.config import load_config; "
            "from master.preflight import preflight; "
            "preflight(load_config('cluster.yaml'), ports=False); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("case", RUN_TOO)
def test_check_and_run_refuse_bad_input_in_one_line(make_config: MakeConfig, tmp_path: Path,
                                                    case: str) -> None:
    change, message = _bad_case(tmp_path, case)
    config = make_config(tmp_path, **change)
    line = _one_line_error(_fedctl("check", "--config", str(config)))
    assert message in line, line
    run = _one_line_error(_fedctl("run", "--config", str(config), "--no-progress"))
    assert run == line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.*"))  # nothing ran


def test_key_written_twice_names_both_lines(make_config: MakeConfig, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config.write_text(config.read_text() + "rounds: 7\n")
    first = next(i for i, line in enumerate(config.read_text().splitlines(), 1)
                 if line.startswith("rounds:"))
    last = len(config.read_text().splitlines())
    line = _one_line_error(_fedctl("check", "--config", str(config), "--no-family"))
    assert line == f"Error: {config}: key 'rounds' written twice (lines {first} and {last})"


def test_port_in_use_is_found_before_anything_starts(make_config: MakeConfig,
                                                     tmp_path: Path) -> None:
    config = make_config(tmp_path)
    port = yaml.safe_load(config.read_text())["master"]["rep_port"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        t0 = time.monotonic()
        line = _one_line_error(_fedctl("run", "--config", str(config), "--no-progress"))
        assert f"master.rep_port: port {port} is in use on this host" in line
        assert _one_line_error(_fedctl("check", "--config", str(config))) == line
    assert time.monotonic() - t0 < 60 and not (tmp_path / "out").exists()


def test_good_check_says_what_it_read(make_config: MakeConfig, tmp_path: Path) -> None:
    proc = _fedctl("check", "--config", str(make_config(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert "valid. Family mlp" in proc.stdout
    assert "Data: 600 labelled document(s) read for 3 worker(s); ports free." in proc.stdout


def test_check_says_which_curve_keys_are_missing_and_a_failed_start_leaves_no_run(
        make_config: MakeConfig, tmp_path: Path) -> None:
    """CURVE without keys: `check` passed it in silence, then `fedctl master` failed and left
    an empty folder that `fedctl runs` listed as running. Now check names the missing files,
    and the master's failed start takes its new folder away again."""
    keys = tmp_path / "keys"
    config = make_config(tmp_path, workers=2, output_dir=str(tmp_path / "runs" / "latest"),
                         security={"mode": "curve", "keys_dir": str(keys)})
    checked = _fedctl("check", "--config", str(config), "--no-family")
    assert checked.returncode == 0, checked.stderr
    assert (f"Note: CURVE key files not on this host: {keys / 'master.key_secret'}, "
            f"{keys / 'admitted' / 'w1.key'}, {keys / 'admitted' / 'w2.key'}; `fedctl run` "
            f"makes them, `fedctl master` needs them") in checked.stdout, checked.stdout
    checked = _fedctl("check", "--config", str(config), "--no-family", "--id", "w2")
    assert (f"not on this host: {keys / 'master.key'}, {keys / 'workers' / 'w2.key_secret'}; "
            f"`fedctl worker --id w2` needs them") in checked.stdout, checked.stdout
    line = _one_line_error(_fedctl("master", "--config", str(config)))
    assert line == f"Error: {keys / 'master.key_secret'}: no such key file (run `fedctl keygen`)"
    assert not any((tmp_path / "runs").iterdir())
    made = _fedctl("keygen", "--config", str(config))
    assert made.returncode == 0, made.stderr
    assert (f"Copy to the master's node: {keys / 'master.key_secret'} and {keys / 'admitted'}/;"
            f" to each worker's node: {keys / 'master.key'}") in made.stdout, made.stdout
    checked = _fedctl("check", "--config", str(config), "--no-family", "--json")
    assert json.loads(checked.stdout)["keys_missing"] == []


def test_check_on_a_workers_node_reads_its_own_documents(make_config: MakeConfig,
                                                         tmp_path: Path) -> None:
    """`fedctl check --id w2 --data mine.jsonl`: what `fedctl worker` will read on its node,
    that worker alone (check had no way to name a worker's own file)."""
    config = make_config(tmp_path, workers=2)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("\n".join(_rows(40)) + "\n")
    checked = _fedctl("check", "--config", str(config), "--id", "w2", "--data", str(mine),
                      "--no-ports")
    assert checked.returncode == 0, checked.stderr
    assert "Data: 40 labelled document(s) read for w2." in checked.stdout, checked.stdout
    unlabelled = tmp_path / "unlabelled.jsonl"
    unlabelled.write_text('{"text": "a document"}\n' * 10)
    line = _one_line_error(_fedctl("check", "--config", str(config), "--id", "w2", "--data",
                                   str(unlabelled), "--no-ports"))
    assert str(unlabelled) in line and "label" in line, line
    line = _one_line_error(_fedctl("check", "--config", str(config), "--id", "w9"))
    assert "'w9' is not a worker of this cluster" in line


# ---------------------------------------------------------------- runs never mix, quiet
BARS = ("Batches", "Loading weights", "rounds:", "it/s")


def _quiet(proc: subprocess.CompletedProcess) -> None:
    """Nothing of a progress bar in the output of a ``--no-progress`` run."""
    for bar in BARS:
        assert bar not in proc.stderr and bar not in proc.stdout, bar


def _run_in_background(config: Path, tmp_path: Path, *args: str,
                       **popen: Any) -> subprocess.Popen:
    """``fedctl run --config CONFIG ARGS`` started (output to DEVNULL unless ``popen`` says
    otherwise), returned once its first round is done; killed if it never gets there."""
    popen = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": child_env(),
             **popen}
    run = subprocess.Popen(fedctl_command("run", "--config", str(config), *args), cwd=ROOT,
                           **popen)
    # The master's log, not metrics.jsonl: round events wait there for a checkpoint.
    master_log = tmp_path / "out.partial" / "logs" / "master.log"
    try:
        wait_for(lambda: master_log.exists() and "round 1/" in master_log.read_text(), 120,
                 "a round")
    except BaseException:
        kill_tree(run)
        raise
    return run


@pytest.mark.slow
def test_runs_never_mix(make_config: MakeConfig, tmp_path: Path) -> None:
    """Also --no-progress silences every bar: the first run embeds its 60 texts into a fresh
    cache (the sentence-transformer loads, with its bars) and its log still says so."""
    data = tmp_path / "small.jsonl"
    data.write_text("\n".join(_rows(60)) + "\n")
    config = make_config(tmp_path, workers=2, rounds=2,
                         data={"path": str(data), "cache_dir": str(tmp_path / "fresh_cache"),
                               "limit": None},
                         model={"family": "mlp", "hidden": 8})
    out = tmp_path / "out"
    first = _fedctl("run", "--config", str(config), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "trained: 2 rounds;" in first.stdout
    assert "embedding 60 texts" in first.stderr  # the log still says what happened
    _quiet(first)
    run_id = json.loads((out / "model.json").read_text())["run_id"]
    again = _one_line_error(_fedctl("run", "--config", str(config), "--no-progress"))
    assert again == (f"Error: {config}: output_dir: {out} holds a finished run; pass "
                     f"--overwrite to replace it, or choose another --output")
    assert json.loads((out / "model.json").read_text())["run_id"] == run_id  # untouched
    checked = _fedctl("check", "--config", str(config), "--no-family")
    assert "Note: output_dir holds a finished run; `fedctl run` needs --overwrite" in (
        checked.stdout), checked.stdout

    # A run stopped half-way leaves its logs in out.failed and the finished run as it was.
    stopped = _run_in_background(config, tmp_path, "--no-progress", "--overwrite", "--rounds",
                                 "5000", preexec_fn=_interruptible)
    try:
        stopped.send_signal(signal.SIGINT)
        assert stopped.wait(timeout=60) == 130
    finally:
        kill_tree(stopped)
    assert (tmp_path / "out.failed" / "FAILED").read_text().startswith("exit code 130")
    assert (tmp_path / "out.failed" / "logs" / "master.log").exists()
    assert not (tmp_path / "out.failed" / "model.npz").exists()
    # Its cluster.yaml names where it is now: a resume from it looked in out.partial.
    saved = (tmp_path / "out.failed" / "cluster.yaml").read_text()
    assert f"output_dir: {tmp_path / 'out.failed'}" in saved and "out.partial" not in saved
    assert json.loads((out / "model.json").read_text())["run_id"] == run_id

    replaced = _fedctl("run", "--config", str(config), "--no-progress", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    _quiet(replaced)
    assert json.loads((out / "model.json").read_text())["run_id"] != run_id
    assert not list(tmp_path.glob("out.partial*")) and not list(tmp_path.glob("out.old"))


def test_a_users_folder_is_never_replaced(make_config: MakeConfig, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`--output` at a folder of the user's own (the current one, `..`, a project) is refused,
    `--overwrite` or not: a run used to replace whatever it found there that held no model."""
    from common.config import ConfigError, load_config
    from fedctl.run import output_folder

    config = load_config(make_config(tmp_path))
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "notes.txt").write_text("precious")
    # A file named as a run's does not make a project a run (a checkpoint of the user's own).
    (project / "checkpoint.npz").write_bytes(b"theirs")
    monkeypatch.chdir(project)
    for out, said in ((str(project), "holds files that are not a fedctl run's"),
                      (".", "holds files that are not a fedctl run's"),
                      ("src/..", "holds files that are not a fedctl run's"),
                      ("/", "is the root folder"),
                      (str(project / "src" / "notes.txt"), "is a file, not a folder")):
        config.output_dir = out
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match=said):
                output_folder(config, overwrite)
    assert (project / "src" / "notes.txt").read_text() == "precious"
    assert (project / "checkpoint.npz").read_bytes() == b"theirs"
    empty = tmp_path / "empty"
    empty.mkdir()
    config.output_dir = str(empty)
    assert output_folder(config) == empty  # an empty folder is taken, as a new one is


def test_a_second_run_into_the_same_folder_is_refused(make_config: MakeConfig,
                                                      tmp_path: Path) -> None:
    """Two runs into one output folder would each clear the other's `.partial`: the second is
    refused while the first holds it (a lock the system drops with the process)."""
    from common.config import ConfigError, load_config
    from fedctl.run import _claimed

    config = load_config(make_config(tmp_path))
    staging = tmp_path / "out.partial"
    with _claimed(staging, config):
        (staging / "cluster.yaml").write_text("the first run's\n")
        with pytest.raises(ConfigError, match="another fedctl run is writing into"), \
                _claimed(staging, config):
            pass
        assert (staging / "cluster.yaml").read_text() == "the first run's\n"
    with _claimed(staging, config):  # free again: an earlier attempt's files are cleared
        assert not any(staging.iterdir())
    # A `fedctl run` killed with -9 leaves its master running (a session of its own), and a
    # second run deleted the files it was still writing: its lock in the folder says so.
    import multiprocessing

    from common.atomic import hold_lock
    from common.constants import MASTER_LOCK

    (staging / "metrics.jsonl").write_text("the orphan's\n")
    held, release = multiprocessing.Event(), multiprocessing.Event()

    def orphan() -> None:
        hold_lock(staging / MASTER_LOCK)
        held.set()
        release.wait(30)

    proc = multiprocessing.get_context("fork").Process(target=orphan, daemon=True)
    proc.start()
    try:
        assert held.wait(10)
        with pytest.raises(ConfigError, match="a master is still writing into"), \
                _claimed(staging, config):
            pass
        assert (staging / "metrics.jsonl").read_text() == "the orphan's\n"
    finally:
        release.set()
        proc.join(10)
    with _claimed(staging, config):  # the orphan has ended: its files are leftovers
        assert not any(staging.iterdir())
    theirs = tmp_path / "theirs.partial"
    (theirs / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is in the way"), _claimed(theirs, config):
        pass
    assert (theirs / "a").is_dir()


def test_publishing_keeps_a_users_folder_named_like_the_old_run(tmp_path: Path) -> None:
    from common.config import parse_config
    from fedctl.run import _keep_failed, _publish

    final, staging = tmp_path / "x", tmp_path / "x.partial"
    for d in (final, staging, tmp_path / "x.old", tmp_path / "x.failed"):
        d.mkdir()
        (d / "mine").write_text(d.name)
    (final / "model.json").write_text("{}")  # the finished run being replaced
    _publish(parse_config({"output_dir": str(final)}), staging, final, None)
    assert (final / "mine").read_text() == "x.partial"
    staging.mkdir()
    _keep_failed(staging, final, 1, "why")
    assert (tmp_path / "x.old" / "mine").read_text() == "x.old"
    assert (tmp_path / "x.failed" / "mine").read_text() == "x.failed"  # the user's, kept
    (kept,) = tmp_path.glob("x.failed-*")
    assert (kept / "FAILED").read_text() == "exit code 1: why\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_run_that_fails_before_training_is_kept_as_failed(make_config: MakeConfig,
                                                            tmp_path: Path) -> None:
    """A failure while preparing (here the sentence model's folder holds a config.json that
    is not one: `check` looks for the file, the embedding reads it) ends as a failed run,
    `<output>.failed` with its note, not a `.partial` left behind. (An embedding cache under
    a file, the case this used, is now refused before anything starts.)"""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("not json")
    config = make_config(tmp_path, data={"embedding_model": str(model),
                                         "cache_dir": str(tmp_path / "cache")})
    run = _fedctl("run", "--config", str(config), "--no-progress")
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith("Error: ")
    assert not (tmp_path / "out.partial").exists() and not (tmp_path / "out").exists()
    assert (tmp_path / "out.failed" / "FAILED").read_text().startswith("exit code 1: ")


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [2, 3])
def test_a_diverging_model_ends_at_once_saying_why(make_config: MakeConfig, tmp_path: Path,
                                                  rounds: int) -> None:
    """`lr: 1e30`: every update is NaN and refused. Each round used to wait its whole
    deadline for workers that would not send again, then the run ended "nothing was trained"
    with a resume advice that could not help. Now the rounds close when every update is in or
    refused, the worker says its training diverged and names the learning rate, and the run
    says what was refused and to change the config."""
    config = make_config(tmp_path, workers=2, rounds=rounds, round_deadline=300,
                         model={"family": "mlp", "lr": 1e30})
    started = time.monotonic()
    run = _fedctl("run", "--config", str(config), "--no-progress", timeout=400)
    assert run.returncode == 1, run.stderr[-3000:]
    assert time.monotonic() - started < 200  # not one deadline of 300 s, let alone all
    failed = tmp_path / "out.failed"
    assert "holds NaN or Inf" in run.stderr
    assert "--resume" not in run.stderr and "change the config" in run.stderr, run.stderr
    worker_log = (failed / "logs" / "w1.log").read_text()
    assert "training diverged (loss nan in round 1): lower the learning rate (model.lr is " \
           "1e+30)" in worker_log, worker_log
    if rounds < C.ABSTAIN_LIMIT:  # the job ran to its end: the master says what it refused
        summary = json.loads((failed / "summary.json").read_text())
        assert summary["failed"].startswith("nothing was trained: 0 rounds in 2 round(s); "
                                            "the last update refused was w"), summary
        assert "ran to its end" in run.stderr
    else:  # a worker excluded for it ends the run, saying why in its one line
        assert re.search(r"Error: w\d's training diverged \(loss nan in round 1\).*; the "
                         r"master refused it: .*excluded", run.stderr), run.stderr[-3000:]


def test_run_needs_its_workers_listed(make_config: MakeConfig, tmp_path: Path) -> None:
    """No worker listed: `check` says the master would admit any; `fedctl run` refuses (its
    master alone used to wait for ever)."""
    config = make_config(tmp_path, workers=[], min_workers=1)
    checked = _fedctl("check", "--config", str(config), "--no-family")
    assert checked.returncode == 0, checked.stderr
    assert "0 worker(s) (none listed: the master admits any worker" in checked.stdout
    line = _one_line_error(_fedctl("run", "--config", str(config), "--no-progress"))
    assert line.endswith("workers: none listed; `fedctl run` starts one process per listed "
                         "worker: list them, or pass --workers N")


def _hangup_heard() -> None:
    """In the child, before exec: SIGHUP's default action. A suite run under `nohup` hands
    its children SIGHUP ignored, which fedctl run rightly keeps (nohup's meaning), and the
    SIGHUP below went unheard: the run trained on until killed."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_run_stopped_by_a_signal_stops_its_processes(make_config: MakeConfig, tmp_path: Path,
                                                     sig: signal.Signals) -> None:
    """`kill`, `timeout`, a scheduler or a closed terminal stop `fedctl run` as Ctrl-C does.
    The master and workers have sessions of their own: before, SIGTERM ended the launcher
    alone and left them training, orphaned."""
    config = make_config(tmp_path, workers=2, rounds=5000, model={"family": "mlp", "hidden": 8})
    # With its progress bar writing to a pipe: the terminal closed, or the parent killed first,
    # the last writes fail; the stop must not be cut short by them (it was: the launcher
    # then waited for ever on its still-running children).
    run = _run_in_background(config, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=_hangup_heard)
    try:
        started = descendants(run.pid)
        assert len(started) >= 3  # the master and two workers (and a fork server)
        assert run.stdout is not None and run.stderr is not None
        run.stdout.close()
        run.stderr.close()
        run.send_signal(sig)
        assert run.wait(timeout=60) == 128 + sig
        # The fork server leaves once it sees its parent gone: a moment later.
        wait_for(lambda: not any(_alive(pid) for pid in started), 10,
                 "the run's processes to end")
    finally:
        kill_tree(run)
    assert (tmp_path / "out.failed" / "FAILED").read_text().startswith(
        f"exit code {128 + sig}: see logs/ (interrupted)")


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "spawned"])
def test_a_run_killed_outright_leaves_no_process_and_its_run_is_kept(
        make_config: MakeConfig, tmp_path: Path, fork: str) -> None:
    """SIGKILL cannot be caught: the launcher used to leave its master and workers training
    as orphans, and the next run of the same output cleared the `.partial` their master had
    checkpointed (or even finished) into. Now they end with it (a parent-death signal: the
    master stops as on SIGTERM, keeping its checkpoint), and the next run keeps the folder as
    a failed, resumable run before it starts its own."""
    # (Rounds enough not to end by themselves meanwhile: 5000 took under a minute.)
    config = make_config(tmp_path, workers=2, rounds=10**6, model={"family": "mlp", "hidden": 8})
    # (FEDCTL_FORK=0: each a fresh interpreter, a child of the launcher itself.)
    run = _run_in_background(config, tmp_path, env={**child_env(), "FEDCTL_FORK": fork})
    try:
        started = descendants(run.pid)
        assert len(started) >= 3
        run.kill()
        run.wait(timeout=30)
        wait_for(lambda: not any(_alive(pid) for pid in started), 20,
                 "the killed run's processes to end")
    finally:
        kill_tree(run)
    partial = tmp_path / "out.partial"
    assert (partial / "checkpoint.npz").is_file(), sorted(p.name for p in partial.iterdir())
    again = _fedctl("run", "--config", str(config), "--rounds", "2", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "left by a `fedctl run` that was killed; kept as" in again.stderr
    assert f"resumable: fedctl master --config {tmp_path / 'out.failed'}/cluster.yaml" \
           in again.stderr, again.stderr[-3000:]
    kept = tmp_path / "out.failed"
    assert (kept / "checkpoint.npz").is_file() and (kept / "FAILED").read_text().startswith(
        "exit code -9: its `fedctl run` was killed before it ended")
    assert (tmp_path / "out" / "summary.json").is_file() and not partial.exists()


def _own_terminal_group() -> None:
    """In the child, before exec: a process group of its own (as a shell's foreground job),
    Ctrl-C's default action."""
    os.setsid()
    _interruptible()


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.0, 0.8, 1.6, 2.4])
def test_ctrl_c_while_a_run_starts_prints_no_traceback(make_config: MakeConfig, tmp_path: Path,
                                                       after: float) -> None:
    """A terminal's Ctrl-C reaches the whole foreground group: in the first seconds of a run
    the fork server, still importing torch, printed a KeyboardInterrupt traceback under the
    launcher's one line; a worker forked while the launcher was being interrupted was never
    stopped and printed one of its own when its folder had moved. Now each delay ends in the
    launcher's lines alone, and leaves no process behind."""
    config = make_config(tmp_path, workers=2, rounds=10**6, model={"family": "mlp", "hidden": 8})
    run = subprocess.Popen(fedctl_command("run", "--config", str(config), "--no-progress"),
                           cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, preexec_fn=_own_terminal_group)
    try:
        # (from the launcher's start, not the process's: a Ctrl-C while Python still imports
        # the command line, 0.8 s in on this machine under load, is Python's own traceback)
        wait_for(lambda: (tmp_path / "out.partial").exists(), 60, "the launcher to start")
        time.sleep(after)
        started = descendants(run.pid)
        os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
        wait_for(lambda: not any(_alive(pid) for pid in started), 20, "the processes to end")
    finally:
        kill_tree(run)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Process fedctl" not in err, err[-3000:]


@pytest.mark.slow
def test_ctrl_c_in_any_command_is_one_line_and_status_130(tmp_path: Path) -> None:
    """Where a command does not handle Ctrl-C itself (predict, data embed...), click printed
    "Aborted!" and exited 1, which a script cannot tell from a failure."""
    rows = [json.dumps({"text": f"document {i} on the cost of {i % 97} kinds of trains"})
            for i in range(20_000)]
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    embed = subprocess.Popen(
        fedctl_command("data", "embed", str(tmp_path / "docs.jsonl"), "-o",
                       str(tmp_path / "features"), "--cache-dir", str(tmp_path / "cache"),
                       "--no-progress"),
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_own_terminal_group)
    try:
        time.sleep(4)  # importing, then embedding 20,000 texts: tens of seconds here
        os.killpg(embed.pid, signal.SIGINT)
        _, err = embed.communicate(timeout=60)
    finally:
        kill_tree(embed)
    assert embed.returncode == 130 and err.strip().endswith("Error: interrupted"), err
    assert "Aborted!" not in err and "Traceback" not in err


def _as_nohup() -> None:
    """In the child, before exec: what `nohup` does (SIGHUP ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _cmdline(pid: int) -> bytes:
    """A process's command line; empty once it has ended (a short-lived child of a library
    listed a moment before: the test failed reading its /proc entry)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_run_under_nohup_outlives_its_terminal(make_config: MakeConfig,
                                                 tmp_path: Path) -> None:
    """`nohup fedctl run &`: the SIGHUP of a closed terminal stops nothing (a handler of its
    own must not override the ignore nohup asked for); SIGTERM still stops it all."""
    config = make_config(tmp_path, workers=2, rounds=5000, model={"family": "mlp", "hidden": 8})
    run = _run_in_background(config, tmp_path, "--no-progress", preexec_fn=_as_nohup)
    try:
        # The master, the workers and their fork server (its cmdline names what it preloads);
        # a fork server of a library's own may come and go meanwhile.
        started = [p for p in descendants(run.pid) if b"'torch'" in _cmdline(p)]
        assert len(started) >= 3
        run.send_signal(signal.SIGHUP)
        time.sleep(2)
        assert run.poll() is None and all(_alive(pid) for pid in started)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        wait_for(lambda: not any(_alive(pid) for pid in started), 10,
                 "the run's processes to end")
    finally:
        kill_tree(run)


@pytest.mark.slow
def test_latest_keeps_a_history(make_config: MakeConfig, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # The folders are the subject, not the training: the smallest job (one worker, one round).
    config = make_config(tmp_path, workers=1, rounds=1, output_dir=str(runs / "latest"),
                         model={"family": "mlp", "hidden": 16})
    ids = []
    for _ in range(2):
        proc = _fedctl("run", "--config", str(config), "--no-progress")
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids.append(json.loads((runs / "latest" / "model.json").read_text())["run_id"])
    folders = sorted(p for p in runs.iterdir() if p.is_dir() and not p.is_symlink())
    assert len(folders) == 2 and ids[0] != ids[1]
    assert (runs / "latest").is_symlink() and (runs / "latest").resolve() == folders[-1]
    assert yaml.safe_load((folders[-1] / "cluster.yaml").read_text())["output_dir"] == str(
        folders[-1])


# ---------------------------------------------------------------- threads
def _other_fedctl_workers(own: set[int]) -> int:
    """The ``fedctl worker`` processes on this host that are not in ``own``, recognized as a
    worker recognizes them when it counts its neighbours (fedctl.cli._workers_on_this_host)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if int(cmdline.parent.name) in own:
                continue
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in args and _runs_fedctl(args):
            count += 1
    return count


def test_a_wrapper_of_a_worker_is_not_a_worker() -> None:
    """`timeout 600 fedctl worker ...` counted twice (the wrapper and the worker), and each
    worker took half the threads it should have."""
    assert _runs_fedctl([b"/usr/bin/fedctl", b"worker"])
    assert _runs_fedctl([b"/venv/bin/python3.11", b"-m", b"fedctl.cli", b"worker"])
    assert _runs_fedctl([b"python", b"-m", b"cProfile", b"-o", b"p", b"-m", b"fedctl.cli"])
    assert _runs_fedctl([b"python3", b"/venv/bin/fedctl", b"worker"])
    assert not _runs_fedctl([b"timeout", b"600", b"fedctl", b"worker"])
    assert not _runs_fedctl([b"bash", b"-c", b"fedctl worker"])
    assert not _runs_fedctl([b""])


@pytest.mark.parametrize("given", [None, "2"])
def test_a_master_beside_its_workers_takes_its_share_of_the_cores(
        make_config: MakeConfig, tmp_path: Path, given: str | None) -> None:
    """master.host on loopback: every worker runs on this host too. The master took every
    core, and its OpenMP threads spinning beside three workers on two cores made
    synchronized steps 20-25 % slower; now it takes its share, or what --threads says."""
    config = make_config(tmp_path, workers=3)
    log = tmp_path / "master.log"
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    with open(log, "wb") as fh:
        master = subprocess.Popen(fedctl_command("master", "--config", str(config),
                                                 "--log-level", "debug",
                                                 *(("--threads", given) if given else ())),
                                  cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        want = given or str(max(1, (os.cpu_count() or 1) // 4))
        wait_for(lambda: "waiting for w1" in log.read_text(), 60, "the master to serve")
        assert f"CPU threads: {want} (--threads to choose)" in log.read_text()
    finally:
        kill_tree(master)


def test_workers_started_by_hand_share_the_cores(make_config: MakeConfig,
                                                 tmp_path: Path) -> None:
    """w2 counts itself and w1, and whatever other clusters run workers on this host meanwhile
    (another test run, a user's job): those are counted here too, every 0.1 s while w2 starts,
    so that only this test's own two workers are taken for granted. With the master on
    loopback the cluster's own processes count too, started or not."""
    config = make_config(tmp_path, workers=2)
    env = child_env()
    procs = []
    others: list[int] = []
    pattern = re.compile(r"(\d+) fedctl workers on this host(?:, a cluster of (\d+) "
                         r"processes on loopback)?: (\d+) CPU thread")
    try:
        for wid in ("w1", "w2"):
            if wid == "w2":
                time.sleep(1.0)  # w2 starts while w1 runs
                others.append(_other_fedctl_workers({p.pid for p, _ in procs}))
            log = open(tmp_path / f"{wid}.log", "wb")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(fedctl_command("worker", "--config", str(config),
                                                          "--id", wid),
                                           cwd=ROOT, env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + 60
        while not (found := pattern.search((tmp_path / "w2.log").read_text())):
            others.append(_other_fedctl_workers({p.pid for p, _ in procs}))
            assert time.monotonic() < deadline, (tmp_path / "w2.log").read_text()
            time.sleep(0.1)
        others.append(_other_fedctl_workers({p.pid for p, _ in procs}))
    finally:
        for proc, log in procs:
            kill_tree(proc)
            log.close()
    here, threads = int(found[1]), int(found[3])
    # Alone on the host (others all 0): exactly "2 fedctl workers on this host".
    assert 2 + min(others) <= here <= 2 + max(others), (found[0], others)
    # The master is on loopback: the cluster's three processes (two workers and the master)
    # share the cores whichever of them has started.
    assert (found[2] is not None) == (here < 3), found[0]
    assert threads == max(1, (os.cpu_count() or 1) // max(here, 3)), found[0]


def _worker_meets_master(tmp_path: Path, master_cfg: Path, worker_cfg: Path
                         ) -> tuple[str, str]:
    """``fedctl master`` of one config and ``fedctl worker`` w1 of another: the worker's
    one-line error and the master's log."""
    log = tmp_path / "master.log"
    with open(log, "w") as fh:
        master = subprocess.Popen(fedctl_command("master", "--config", str(master_cfg)),
                                  cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
    try:
        proc = _fedctl("worker", "--config", str(worker_cfg), "--id", "w1", "--threads", "1",
                       "--log-level", "warning", timeout=120)
        return _one_line_error(proc), log.read_text()
    finally:
        kill_tree(master)


def test_a_worker_of_another_job_leaves_before_it_registers(make_config: MakeConfig,
                                                            tmp_path: Path) -> None:
    """Two jobs on one pair of ports: a topic model's worker meets a classifier's master. It
    ends in one line naming both families, and the master never hears from it (its
    registration would carry its vocabulary)."""
    classifier = make_config(tmp_path, workers=2, name="classifier.yaml")
    ports = yaml.safe_load(classifier.read_text())["master"]
    topics = make_config(tmp_path, workers=2, name="topics.yaml", master=ports,
                         model={"family": "nmf", "n_topics": 4})
    line, master_log = _worker_meets_master(tmp_path, classifier, topics)
    assert line == (
        f"Error: the master at tcp://127.0.0.1:{ports['pub_port']} runs a mlp job, and "
        f"{topics} says model.family nmf: is another job's master on these ports? "
        f"(nothing was sent)")
    assert "registered w1" not in master_log and "refused" not in master_log


def test_a_worker_whose_config_differs_is_refused_naming_each_difference(
        make_config: MakeConfig, tmp_path: Path) -> None:
    """Each node reads its own cluster.yaml. A worker with another positive class used to
    make the master build a three-class model, and one with another width to fail mid-round
    with its message cut short: now it is refused at registration, in one line naming each
    difference; a difference only of paths or rounds is not one."""
    master_cfg = make_config(tmp_path, workers=2, name="master.yaml",
                             model={"family": "mlp", "hidden": 16})
    ports = yaml.safe_load(master_cfg.read_text())["master"]
    drifted = make_config(tmp_path, workers=2, name="drifted.yaml", master=ports,
                          model={"family": "mlp", "hidden": 32},
                          data={"positive": "Athlete"})
    line, master_log = _worker_meets_master(tmp_path, master_cfg, drifted)
    assert line == (
        "Error: the master refused w1: rejected: w1's configuration differs from the "
        "master's: data.positive: 'Athlete' on w1, 'MeanOfTransportation' at the master; "
        "model.hidden: 32 on w1, 16 at the master")
    assert "registered w1" not in master_log

    from common.config import job_terms, load_config
    from master.agreement import job_differences
    from master.families import make_server_family

    ours = load_config(master_cfg, ("strategy.name=fedadam", "strategy.eta=0.05",
                                    "privacy.target_epsilon=null"))
    # Paths, rounds, a server-side option written on the master's side only, a later
    # version's term: none is a difference.
    elsewhere = job_terms(load_config(master_cfg, (
        "rounds=7", "output_dir=/elsewhere", "data.cache_dir=/elsewhere", "strategy=fedadam")))
    elsewhere["a_later_term"] = 1
    assert job_differences(ours, make_server_family(ours), elsewhere) == []
    # A worker reading its share of the shared file also says how the shares are cut: one
    # given another cap (`--set data.limit=300`) would train on other documents.
    from common.config import share_terms

    capped = load_config(master_cfg, ("data.limit=300", "strategy.name=fedadam"))
    share = job_terms(capped)
    share["data"] |= share_terms(capped)
    assert job_differences(ours, make_server_family(ours), share) == [
        "data.limit: 300 there, 600 here"]
    share["data"] |= share_terms(ours)
    assert job_differences(ours, make_server_family(ours), share) == []
    # What the iid split does not read is no difference (alpha); whose share is whose is.
    iid = load_config(master_cfg, ("strategy.name=fedadam", "privacy.target_epsilon=null",
                                   "data.partition=iid"))
    for change, named in ((("data.alpha=9",), []),
                          (("workers=[w2, w1]",), ["data.workers"])):
        other = load_config(master_cfg, ("strategy.name=fedadam", "data.partition=iid",
                                          *change))
        share = job_terms(other)
        share["data"] |= share_terms(other)
        found = job_differences(iid, make_server_family(iid), share)
        assert [d.split(":")[0] for d in found] == named, found
        assert all(d.endswith(": not the same there and here") for d in found), found


def test_a_worker_trains_the_masters_number_of_rounds(make_config: MakeConfig, tmp_path: Path,
                                                      procs: Procs) -> None:
    """Rounds are the master's (`--rounds` given to it alone): a worker whose config says
    otherwise follows it, its local-only baseline too (nmf's trained for the worker's count,
    a baseline of 0.30 macro-F1 against 0.21)."""
    master_cfg = make_config(tmp_path, workers=1, rounds=2, name="master.yaml",
                             baselines=True, model={"family": "nmf", "n_topics": 4})
    ports = yaml.safe_load(master_cfg.read_text())["master"]
    worker_cfg = make_config(tmp_path, workers=1, rounds=9, name="worker.yaml", master=ports,
                             baselines=True, model={"family": "nmf", "n_topics": 4})
    procs.master(master_cfg)
    procs.worker(worker_cfg, "w1")
    codes = procs.wait_all(timeout=240)
    assert set(codes.values()) == {0}, procs.logs_tail()
    assert f"the master's job has 2 rounds ({worker_cfg} says 9): this worker follows it" in (
        procs.log("w1"))


def test_refused_worker_ends_with_one_line(make_config: MakeConfig, tmp_path: Path) -> None:
    config = make_config(tmp_path, workers=2, model={"family": "nmf", "n_topics": 4})
    own = tmp_path / "own.jsonl"
    own.write_text("\n".join(_rows(100)) + "\n")
    master = subprocess.Popen(fedctl_command("master", "--config", str(config)), cwd=ROOT,
                              env=child_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        proc = _fedctl("worker", "--config", str(config), "--id", "intruder", "--data",
                       str(own), "--threads", "1", "--log-level", "warning", timeout=120)
        assert _one_line_error(proc) == ("Error: the master refused intruder: unknown_worker: "
                                         "worker 'intruder' is not in this cluster's worker "
                                         "list")
    finally:
        kill_tree(master)


def test_a_worker_id_that_names_another_folder_is_refused(make_config: MakeConfig,
                                                          tmp_path: Path) -> None:
    """A worker's id is its snapshots' folder too: `--id ..` would have named the run's own
    output folder, which the worker deletes at its end."""
    from click.testing import CliRunner

    from fedctl.cli import main

    config = make_config(tmp_path, workers=[], min_workers=1)
    result = CliRunner().invoke(main, ["worker", "--config", str(config), "--id", ".."],
                                prog_name="fedctl")
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == ("Error: --id: expected 1-64 characters, without '/', '\\' "
                                     "or control characters, not starting with '.', got '..'")


def test_an_error_of_several_lines_is_joined_not_cut() -> None:
    """torch's first line is a heading only: a worker of another width ended with "Error(s)
    in loading state_dict for Sequential:", the sizes that differ cut off."""
    from fedctl.errors import MAX_CHARS, one_line

    exc = RuntimeError("Error(s) in loading state_dict for Sequential:\n\tsize mismatch for "
                       "0.weight: copying a param with shape [16, 384], the model has [32, 384].")
    assert one_line(exc) == ("Error(s) in loading state_dict for Sequential: size mismatch for "
                             "0.weight: copying a param with shape [16, 384], the model has "
                             "[32, 384].")
    assert one_line(ValueError()) == "ValueError"
    assert len(one_line(ValueError("x" * 5000))) == MAX_CHARS


def test_a_failed_runs_config_names_its_folder_path_by_path(tmp_path: Path) -> None:
    """The staging path is replaced where a value is it or lies in it, read as YAML: a plain
    text replace missed a path YAML had escaped (José) and rewrote a sibling's (out.partial-old)."""
    import yaml

    from fedctl.run import _moved_to

    root = tmp_path / "José"
    staging, failed = root / "out.partial", root / "out.failed"
    failed.mkdir(parents=True)
    (failed / "cluster.yaml").write_text(yaml.safe_dump({
        "output_dir": str(staging), "data": {"path": str(root / "out.partial-old" / "d.jsonl"),
                                             "cache_dir": str(staging / "cache")}}))
    assert "Jos\\" in (failed / "cluster.yaml").read_text()  # escaped by YAML
    _moved_to(staging, failed)
    raw = yaml.safe_load((failed / "cluster.yaml").read_text())
    assert raw["output_dir"] == str(failed)
    assert raw["data"]["cache_dir"] == str(failed / "cache")
    assert raw["data"]["path"] == str(root / "out.partial-old" / "d.jsonl")  # not its own
    # The master's own stop hint, the last line of its log, named the staging folder, gone.
    (failed / "logs").mkdir()
    (failed / "logs" / "master.log").write_text(
        f"... continue with `fedctl master --config {staging}/cluster.yaml --resume`\n")
    (failed / "checkpoint.npz").write_bytes(b"")
    _moved_to(staging, failed, quiet=True)
    last = (failed / "logs" / "master.log").read_text().splitlines()[-1]
    assert last.endswith(f"continue with `fedctl master --config {failed / 'cluster.yaml'} "
                         f"--resume`"), last


@pytest.mark.slow
def test_a_run_whose_output_reader_left_trains_to_its_end(make_config: MakeConfig,
                                                          tmp_path: Path) -> None:
    """`fedctl run | head`, or a window closed under nohup: the progress bar's writes fail.
    The run went down with exit 1 at the next round (and, racing a stop signal, said 1 where
    the signal's code was due); it now goes on without its bar."""
    config = make_config(tmp_path, workers=2, rounds=40, model={"family": "mlp", "hidden": 8})
    run = _run_in_background(config, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert run.stdout is not None and run.stderr is not None
        run.stdout.close()
        run.stderr.close()
        assert run.wait(timeout=300) == 0
    finally:
        kill_tree(run)
    assert (tmp_path / "out" / "model.npz").is_file()


def test_check_takes_run_s_workers_and_rounds_and_says_what_a_sync_budget_drops(
        tmp_path: Path) -> None:
    """prodlda's rounds not a multiple of a synchronized step's: said in master.log only, and
    `check` had no --rounds to try it with."""
    checked = _fedctl("check", "--config", str(ROOT / "examples" / "prodlda_sync.yaml"),
                      "--rounds", "7", "--workers", "2", "--no-ports")
    assert checked.returncode == 0, checked.stderr
    assert "7 rounds, 2 worker(s) (w1, w2)" in checked.stdout
    assert ("Note: rounds 7 is not a multiple of 5 (rounds per synchronized step of prodlda): "
            "the run stops after 1 step(s), 5 rounds.") in checked.stdout
    # Seven workers on 30 documents: one test document each, scored 0 or 1 in the run's table
    # without a word.
    small = _fedctl("check", "--config", str(ROOT / "examples" / "mlp_multiclass.yaml"),
                    "--workers", "7", "--set", "data.limit=30", "--set", "data.partition=iid",
                    "--no-ports")
    assert small.returncode == 0, small.stderr
    assert ("Note: w1 (1), w2 (1), w3 (1) and 4 more: test split(s) under 10 documents, where "
            "one document moves a score by a tenth or more") in small.stdout, small.stdout
    assert "test split(s) under" not in checked.stdout


def test_init_and_keygen_that_cannot_write_say_so_in_one_line(tmp_path: Path) -> None:
    """A folder that cannot be written, or a path through a file: a traceback before."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    made = _fedctl("init", "-o", str(blocker / "cluster.yaml"))
    assert made.returncode == 1
    assert made.stderr.strip().splitlines() == [
        f"Error: {blocker / 'cluster.yaml'}: cannot write ({blocker} is a file, not a folder)"]
    config = tmp_path / "cluster.yaml"
    assert _fedctl("init", "-o", str(config)).returncode == 0
    keys = _fedctl("keygen", "-c", str(config), "--dir", str(blocker / "keys"))
    assert keys.returncode == 1
    assert len(keys.stderr.strip().splitlines()) == 1 and "cannot write" in keys.stderr, (
        keys.stderr)


@pytest.mark.parametrize("family", ["mlp", "nmf", "prodlda", "combinedtm", "fstc", "lda",
                                    "sentencelda"])
def test_init_writes_a_config_that_checks_and_names_itself(family: str, tmp_path: Path) -> None:
    """`fedctl init` for each family, outside the project: `fedctl check` accepts what it
    wrote, and its header's "Run:" line names the new file (it named the example)."""
    from click.testing import CliRunner

    from fedctl.cli import main
    from fedctl.use_cli import STARTERS

    target = tmp_path / "cluster.yaml"
    made = CliRunner().invoke(main, ["init", "-f", family, "-o", str(target)],
                              prog_name="fedctl")
    assert made.exit_code == 0, made.output
    text = target.read_text()
    assert f"examples/{STARTERS[family]}" not in text
    run_lines = [line for line in text.splitlines() if line.startswith("#") and "Run:" in line]
    assert run_lines and all(f"--config {target}" in line for line in run_lines), run_lines
    # Its "Then:" line reads the runs beside the new file (it named runs/latest of wherever
    # the user stood), and any bundled data where it is.
    for line in (line for line in text.splitlines() if line.startswith("#") and "Then:" in line):
        paths = [Path(w) for w in line.split() if "/" in w]
        assert paths and all(p.exists() or p == tmp_path / "runs" / "latest" for p in paths), line
    checked = _fedctl("check", "--config", str(target), "--no-ports")
    assert checked.returncode == 0, checked.stderr
    assert f"valid. Family {family}" in checked.stdout


@pytest.mark.slow
def test_ctrl_c_after_training_keeps_the_model_and_the_wait_is_explained(
        make_config: MakeConfig, tmp_path: Path, embed_cache: Path) -> None:
    """After the last round the workers score their local-only baselines and the master its
    centralized one (35 to 80 s on the default job), under a bar at 100 % that said nothing;
    Ctrl-C then kept the run as failed without its model. The model is written once training
    is over, and the wait says what it is for."""
    config = make_config(tmp_path, workers=2, rounds=2, baselines=True,
                         model={"family": "mlp", "hidden": 8, "local_epochs": 150})
    said = ("training done, model saved; now the workers' final reports, their local-only "
            "baselines and the centralized one")
    err_path = tmp_path / "run.err"
    with open(err_path, "w") as err_file:
        run = subprocess.Popen(fedctl_command("run", "--config", str(config), "--no-progress"),
                               cwd=ROOT, env=child_env(embed_cache), stdout=subprocess.DEVNULL,
                               stderr=err_file, text=True, preexec_fn=_interruptible)
    try:
        # (the launcher's line, not the master's: the launcher reads the event a poll later,
        # and a Ctrl-C in between found it not yet said, one CI run in a few)
        wait_for(lambda: said in err_path.read_text(), 120, "the end of training")
        run.send_signal(signal.SIGINT)
        run.wait(timeout=60)
    finally:
        kill_tree(run)
    err = err_path.read_text()
    assert run.returncode == 130, err[-3000:]
    failed = tmp_path / "out.failed"
    assert (failed / "model.npz").is_file() and (failed / "model.json").is_file()
    assert f"training was over: its model is kept (`fedctl predict {failed} FILE`)" in err
