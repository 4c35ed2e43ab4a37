"""Exact recovery, family by family, over real processes (docs/RECOVERY.md).

Each family's job runs twice: undisturbed, and with the master SIGKILLed mid-run and resumed
(``fedctl master --resume``) and then a worker SIGKILLed and started again. The master goes
back to its checkpoint; every worker goes back to its own snapshot of the same round and draws
the same mini-batches; the restarted worker carries on from its snapshot. Both runs must log
every round once and end with the same ``model.npz``, bit for bit.

The heartbeat timeout and round deadline are long, so that the round open when w2 dies waits
for the new w2 (however slowly this machine starts a process) rather than closing without it:
a round that closes without a worker cannot equal one that had its update.
"""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.conftest import ROOT, MakeConfig, Procs, events, run_job, wait_for

pytestmark = pytest.mark.slow

WORKERS = ("w1", "w2")  # w2 is killed; w1 goes back to its snapshot with the master
PATIENT = {"heartbeat_timeout": 600, "round_deadline": 600}

#: Small jobs with rounds slow enough (a few hundred ms) to be hit mid-run.
JOBS: dict[str, dict[str, Any]] = {
    # mlp with SCAFFOLD: the optimizer's moments and the shuffling generator in the snapshots,
    # and the control variates: the server's across --resume in the checkpoint, each worker's
    # in its snapshots.
    # int8 compression: its error feedback's residual is worker state too.
    "mlp_scaffold": {"rounds": 12, "model": {"family": "mlp", "local_epochs": 30, "hidden": 64},
                     "strategy": "scaffold", "compression": {"kind": "int8"},
                     "data": {"task": "multiclass"}},
    # Secure aggregation: a secure round hit by the master's death is begun again by the
    # resumed master (a new incarnation: fresh keys), and by w2's restart (its secrets died
    # with it: a new attempt); only sums are applied, so nothing twice.
    "mlp_secagg": {"rounds": 12, "model": {"family": "mlp", "local_epochs": 30, "hidden": 64},
                   "privacy": {"secure_aggregation": {"threshold": 2}},
                   "data": {"task": "multiclass"}},
    # (30 rounds: at a few ms a round, 12 could end before the test saw its second round
    # after the resume, the master's log being written behind it)
    "nmf": {"rounds": 30, "model": {"family": "nmf", "n_topics": 8, "mi_weight": 0.1,
                                    "vocab_size": 400, "local_epochs": 5},
            "strategy": {"name": "fedadam", "eta": 0.01}, "data": {"task": "multiclass"}},
    # 30 steps of 5 rounds (batch norm over the union batch): steps take milliseconds, and a
    # shorter job could end before the log shows its second round.
    "prodlda": {"rounds": 150, "model": {"family": "prodlda", "mode": "sync", "n_topics": 8,
                                        "vocab_size": 400, "batch_size": 32},
                "data": {"task": "multiclass"}},
    # The same under secure aggregation: each phase a secure round; w2's restart mid-step
    # makes it abstain in the clear, the step is redone, and the sums are exact integers, so
    # the model still ends bit for bit where the undisturbed run's does.
    "prodlda_secagg": {"rounds": 100, "model": {"family": "prodlda", "mode": "sync",
                                               "n_topics": 8, "vocab_size": 400,
                                               "batch_size": 32},
                       "privacy": {"secure_aggregation": {"threshold": 2}},
                       "data": {"task": "multiclass"}},
    "fstc": {"rounds": 10, "model": {"family": "fstc", "n_clusters": 5, "iterations": 40},
             "data": {"task": "multiclass"}},
    "lda": {"rounds": 12, "model": {"family": "lda", "n_topics": 6, "sweeps": 100,
                                    "vocab_size": 400},
            "data": {"task": "multiclass"}},
}


def _rounds(out: Path) -> list[int]:
    return [e["round"] for e in events(out, "round")]


def _worker_round(procs: Procs, worker: str = "w1") -> int:
    """The last round the worker's log says it trained (0 before the first)."""
    trained = re.findall(r"fedctl\.worker: round (\d+):", procs.log(worker))
    return int(trained[-1]) if trained else 0


def _model(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "model.npz") as z:
        return {k: z[k] for k in z.files}


def _run(procs: Procs, cfg: Path) -> None:
    procs.master(cfg)
    for w in WORKERS:
        procs.worker(cfg, w)


@pytest.mark.parametrize("family", list(JOBS))
def test_master_and_worker_killed_change_nothing(family: str, tmp_path: Path,
                                                 make_config: MakeConfig,
                                                 embed_cache: Path) -> None:
    job = JOBS[family]
    # Undisturbed, beside the disturbed run (each mostly waits on its processes' start).
    calm_dir = tmp_path / "calm"
    calm_dir.mkdir()
    calm = ThreadPoolExecutor(1).submit(
        run_job, make_config(calm_dir, workers=2, **PATIENT, **job), calm_dir / "logs",
        embed_cache, WORKERS)

    # The master killed after round 2 and resumed; then w2 killed and restarted. The workers
    # are paused (SIGSTOP) around each kill, so that a fast job cannot end meanwhile.
    hit_dir = tmp_path / "hit"
    hit_dir.mkdir()
    hit = make_config(hit_dir, workers=2, **PATIENT, **job)
    out = hit_dir / "out"
    procs = Procs(hit_dir / "logs", embed_cache)

    def pause(names: tuple[str, ...], sig: signal.Signals) -> None:
        for name in names:
            procs.procs[name].send_signal(sig)

    def kill(name: str) -> None:
        procs.procs[name].send_signal(signal.SIGKILL)
        procs.procs[name].wait(timeout=10)
        del procs.procs[name]

    try:
        _run(procs, hit)
        # (w1's own log, unbuffered: metrics.jsonl comes with the checkpoints, which are
        # spaced out for time, and a fast job could end between two of them; one round in it
        # says there is a checkpoint to resume from)
        wait_for(lambda: _worker_round(procs) >= 2 and len(_rounds(out)) >= 1, 300, "round 2",
                 procs.check_alive_or_ok, interval=0.02)
        pause(WORKERS, signal.SIGSTOP)
        kill("master")
        assert not (out / "summary.json").exists(), "the job ended before the master was killed"
        procs.master(hit, "--resume", name="master2")
        wait_for(lambda: "resumed job" in procs.log("master2"), 300, "the master to resume",
                 procs.check_alive_or_ok)
        resumed_at = _worker_round(procs)
        pause(WORKERS, signal.SIGCONT)
        wait_for(lambda: _worker_round(procs) >= resumed_at + 2
                 or (out / "summary.json").exists(), 300, "two rounds after resuming",
                 procs.check_alive_or_ok, interval=0.02)
        pause(("w1",), signal.SIGSTOP)
        kill("w2")
        assert not (out / "summary.json").exists(), "the job ended before w2 was killed"
        procs.worker(hit, "w2")
        pause(("w1",), signal.SIGCONT)
        codes = procs.wait_all(timeout=400)
        assert set(codes.values()) == {0}, procs.logs_tail()
    finally:
        procs.stop_all()
        calm.result()  # (its own failure, if any, is raised here)
    expected_rounds = _rounds(calm_dir / "out")

    rounds = _rounds(out)
    assert rounds == list(range(1, len(rounds) + 1))  # every round logged once, none lost
    calm_summary = json.loads((calm_dir / "out" / "summary.json").read_text())
    hit_summary = json.loads((out / "summary.json").read_text())
    if family.startswith("prodlda"):
        # A step redone costs rounds, not steps: the budget is the same steps.
        # (A step is redone when a kill caught it midway.)
        steps = JOBS[family]["rounds"] // 5
        assert hit_summary["trained"]["steps"] == calm_summary["trained"]["steps"] == steps
    else:
        assert rounds == expected_rounds
    assert len(events(out, "resume")) == 1
    # The updates of rounds past the checkpoint, sent to the master that died, and the rounds
    # begun again are the restarts' doing: not counted as the workers' refused requests.
    assert not any({"stale_round", "not_ready"} & set(counts)
                   for counts in hit_summary["refused"].values()), hit_summary["refused"]
    assert [e for e in events(out, "register") if e["worker"] == "w2" and e["rejoin"]]
    # (w1 goes back to a snapshot when it had trained past the checkpoint, as it usually has;
    # the model's equality below is what counts.)
    assert "back to its own state" in procs.log("w2")  # the restarted w2 carried on
    for w in WORKERS:  # torch was never handed a read-only received array to share
        assert "not writable" not in procs.log(w), procs.log(w)
    calm_model, hit_model = _model(calm_dir / "out"), _model(out)
    assert calm_model.keys() == hit_model.keys()
    for name, array in calm_model.items():
        assert np.array_equal(array, hit_model[name]), (
            f"{name}: max |diff| {np.abs(array - hit_model[name]).max()}")
    # The job is over: the workers' snapshots are gone with it.
    assert not (out / "workers").exists()


def test_clear_ends_a_refused_worker_and_a_master_whose_workers_are_gone(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """A worker the master refuses prints one line naming the reason, no traceback, and exits
    non-zero; a master whose workers are all gone (here killed; after a resume, never back)
    says why and exits non-zero rather than wait forever, keeping its checkpoint."""
    # The master gives up heartbeat_timeout + join_timeout (6 s) after the last it heard; the
    # workers get their own copy of the config with a long join_timeout, the longest they wait
    # for the master's first announcement however slowly this machine starts it.
    cfg = make_config(tmp_path, workers=1, rounds=60, heartbeat_timeout=2, join_timeout=4,
                      model=JOBS["mlp_scaffold"]["model"], data={"task": "multiclass"})
    patient = tmp_path / "workers.yaml"
    patient.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "join_timeout": 60},
                                      sort_keys=False))
    out = tmp_path / "out"
    own = tmp_path / "own.jsonl"  # a stranger's documents: w9 is in no worker list
    rows = (ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl").read_text().splitlines()
    own.write_text("\n".join(rows[:30]) + "\n")
    master = procs.master(cfg)
    procs.worker(patient, "w1")
    stranger = procs.worker(patient, "w9", "--data", str(own))
    assert stranger.wait(timeout=120) != 0
    said = procs.log("w9")
    assert "Traceback" not in said, said
    (error,) = [line for line in said.splitlines() if line.startswith("Error:")]
    assert "refused w9" in error and "not in this cluster's worker list" in error

    wait_for(lambda: len(_rounds(out)) >= 2, 300, "round 2", procs.check_alive_or_ok)
    procs.procs["w1"].send_signal(signal.SIGKILL)
    assert master.wait(timeout=120) != 0
    assert "0 worker(s) heard from (none)" in procs.log("master")
    assert (out / "checkpoint.npz").exists()  # kept, to resume once the workers are back


def test_a_master_left_with_fewer_than_min_workers_ends(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """Two workers, min_workers 2: w2 killed mid-run leaves w1 alone, no round could close;
    after heartbeat_timeout + join_timeout the master ends, naming the one it still hears."""
    cfg = make_config(tmp_path, workers=2, rounds=200, heartbeat_timeout=2, join_timeout=3,
                      model=JOBS["mlp_scaffold"]["model"], data={"task": "multiclass"})
    out = tmp_path / "out"
    master = procs.master(cfg)
    procs.worker(cfg, "w1")
    procs.worker(cfg, "w2")
    wait_for(lambda: len(_rounds(out)) >= 2, 300, "round 2", procs.check_alive_or_ok)
    procs.procs["w2"].send_signal(signal.SIGKILL)
    assert master.wait(timeout=120) != 0
    said = procs.log("master")
    assert "1 worker(s) heard from (w1)" in said and "min_workers is 2" in said, said
    assert (out / "checkpoint.npz").exists()


def test_an_interrupted_fedctl_run_resumed_by_hand_changes_nothing(
        tmp_path: Path, make_config: MakeConfig, embed_cache: Path) -> None:
    """`fedctl run` into a history (runs/latest) stopped by SIGTERM, then resumed as the README
    says: `fedctl master --resume` and `fedctl worker` with the same config. The run's workers
    had kept their snapshots in its own folder (runs/<id>.failed/workers/), and workers started
    alone looked in runs/workers/: they trained the redone rounds from their start, a
    different model without a word. They find the run's own snapshots now."""
    import subprocess

    from fedctl.launch import child_env, fedctl_command, worker_threads
    from tests.conftest import kill_tree, run_fedctl

    job = {"rounds": 12, "model": {"family": "mlp", "local_epochs": 30, "hidden": 64},
           "data": {"task": "multiclass"}, **PATIENT}

    def config(folder: Path) -> Path:
        folder.mkdir()
        return make_config(folder, workers=2, output_dir=str(folder / "runs" / "latest"),
                           **job)

    # Undisturbed, by `fedctl run` too: its workers' threads are the same as the hit run's.
    calm_cfg = config(tmp_path / "calm")
    calm = ThreadPoolExecutor(1).submit(run_fedctl, "run", "--config", str(calm_cfg),
                                        "--no-progress", timeout=400, cache_dir=embed_cache)
    cfg = config(tmp_path / "hit")
    runs = tmp_path / "hit" / "runs"
    procs = Procs(tmp_path / "hit" / "logs", embed_cache)
    run = subprocess.Popen(fedctl_command("run", "--config", str(cfg), "--no-progress"),
                           cwd=ROOT, env=child_env(embed_cache), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: any(len(_rounds(p)) >= 3 for p in runs.glob("*.partial")), 300,
                 "round 3 of fedctl run",
                 lambda: run.poll() is None or pytest.fail("fedctl run ended early"),
                 interval=0.02)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 143
        (failed,) = runs.glob("*.failed")
        procs.master(cfg, "--resume")
        for w in WORKERS:
            procs.worker(cfg, w, "--threads", str(worker_threads(len(WORKERS))))
        codes = procs.wait_all(timeout=400)
        assert set(codes.values()) == {0}, procs.logs_tail()
    finally:
        kill_tree(run)
        procs.stop_all()
    assert calm.result().returncode == 0
    for w in WORKERS:
        assert "its snapshots of run" in procs.log(w), procs.log(w)
        assert str(failed / "workers" / w) in procs.log(w), procs.log(w)
    calm_model, hit_model = _model(tmp_path / "calm" / "runs" / "latest"), _model(failed)
    for name, array in calm_model.items():
        assert np.array_equal(array, hit_model[name]), (
            f"{name}: max |diff| {np.abs(array - hit_model[name]).max()}")
