"""The whole cluster as a user runs it: `fedctl run`, a late worker, the CLI.

`fedctl run` starts the same `fedctl master --config` / `fedctl worker --config --id` commands
a user would type in four terminals (common/local_cluster.py), so the whole-job test below also
checks what running them by hand gives.

Every test here runs real `fedctl` processes (``python -m fedctl.cli``) over ZeroMQ on TCP
loopback, on 600 documents of the bundled dbpedia_10k file embedded with the real
sentence-transformer model (once per session, see ``embed_cache`` in conftest.py).
"""

from __future__ import annotations

import json
import math
import re
import signal
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
import zmq

from common.net.wire import decode, encode
from tests.conftest import (
    CLASSES,
    ROOT,
    MakeConfig,
    Procs,
    child_env,
    events,
    fedctl_command,
    kill_tree,
    run_fedctl,
    wait_for,
)

#: The MLP's arrays (Linear(384, 256) - ReLU - Linear(256, 2)) by name.
MLP_SHAPES = {"0.weight": (256, 384), "0.bias": (256,), "2.weight": (2, 256), "2.bias": (2,)}
MODEL_BYTES = 4 * sum(math.prod(s) for s in MLP_SHAPES.values())
WORKER_ROUND_FIELDS = ("loss", "accuracy", "macro_f1", "bytes_in", "bytes_out", "train_time",
                       "wait_time", "cpu_s")


def _comparison_rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    # A list of rows, or {"per_worker": rows, "pooled": ...} where the data could be pooled.
    return data["per_worker"] if isinstance(data, dict) else data


def _ping(rep_endpoint: str, worker_id: str, timeout_ms: int = 5000):
    """One `ping` on a fresh REQ socket; the decoded reply, or None without one."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)  # (a failed handshake leaves no pipe)
    try:
        sock.connect(rep_endpoint)
        sock.send_multipart(encode("ping", {"worker_id": worker_id}))
        return decode(sock.recv_multipart())
    except zmq.Again:
        return None
    finally:
        sock.close()


# --------------------------------------------------------------------------------------------
# fedctl run
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fedctl_run_whole_job(tmp_path: Path, make_config: MakeConfig, embed_cache: Path
                              ) -> None:
    rounds = 4
    # The defaults (1 local epoch at lr 1e-3: ~3 optimizer steps per worker and round on
    # ~160 documents) first collapse the one-vs-rest model onto the majority class, so over a
    # handful of rounds its macro-F1 *drops* (0.51 -> 0.48 on this data). A few more local
    # epochs and a larger step make 4 rounds enough to learn the task.
    cfg = make_config(tmp_path, workers=3, rounds=rounds, baselines=True,
                      model={"family": "mlp", "local_epochs": 5, "lr": 0.003})
    out = tmp_path / "out"
    proc = subprocess.Popen(fedctl_command("run", "--config", str(cfg), "--workers", "3"), cwd=ROOT,
                            env=child_env(embed_cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, f"fedctl run failed:\n{stderr[-3000:]}"

    evs = events(out)
    kinds = [e["event"] for e in evs]
    assert kinds[0] == "start" and kinds[-1] == "done"
    regs = [e for e in evs if e["event"] == "register"]
    assert sorted(e["worker"] for e in regs) == ["w1", "w2", "w3"]
    assert all(e["phase"] == "joining" and not e["rejoin"] for e in regs)

    round_evs = [e for e in evs if e["event"] == "round"]
    assert [e["round"] for e in round_evs] == list(range(1, rounds + 1))
    assert all(e["n_updates"] == 3 and e["missing"] == [] for e in round_evs), round_evs
    assert [e["version"] for e in round_evs] == list(range(1, rounds + 1))

    worker_rounds = [e for e in evs if e["event"] == "worker_round"]
    assert sorted((e["worker"], e["round"]) for e in worker_rounds) == [
        (w, r) for w in ("w1", "w2", "w3") for r in range(1, rounds + 1)]
    for e in worker_rounds:
        for key in WORKER_ROUND_FIELDS:
            assert isinstance(e.get(key), (int, float)) and math.isfinite(e[key]), (key, e)
        assert 0 <= e["accuracy"] <= 1 and 0 <= e["macro_f1"] <= 1
        assert e["bytes_out"] >= MODEL_BYTES  # the update carries the whole model
        assert e["bytes_in"] > 0 and e["train_time"] > 0 and e["wait_time"] >= 0
        # A round's CPU (every thread, since the last upload) holds its training's CPU, which
        # training cannot do without. (Not its wall time: a busy machine takes cores away.)
        assert e["cpu_s"] >= e["fit_cpu_s"] > 0, e
    assert all(e["cpu_s"] > 0 for e in round_evs), round_evs
    # ...and `fedctl run` says what a round cost the machine, from those figures.
    cpu = statistics.median(e["cpu_s"] + sum(w["cpu_s"] for w in worker_rounds
                                             if w["round"] == e["round"]) for e in round_evs)
    said = re.search(r"a round cost the master and the workers ([\d.]+) ms of CPU .*?"
                     r"(\d+) core\(s\), rounds cannot follow each other faster than every "
                     r"([\d.]+) ms", stdout)
    assert said, stdout[-2000:]
    assert float(said[1]) == pytest.approx(1000 * cpu, abs=0.06)
    assert float(said[3]) == pytest.approx(float(said[1]) / int(said[2]), abs=0.06)

    # Learning happened: the global model each round starts from scores better and better on
    # the workers' own test splits (round 1 is the untrained initial model).
    f1 = [e["mean_macro_f1"] for e in round_evs]
    assert f1[-1] >= f1[0] + 0.2, f"mean macro-F1 per round: {f1}"
    loss = [np.mean([e["loss"] for e in worker_rounds if e["round"] == r])
            for r in range(1, rounds + 1)]
    assert loss[-1] < loss[0], f"mean test loss per round: {loss}"

    with np.load(out / "model.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    assert {k: a.shape for k, a in arrays.items()} == MLP_SHAPES
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in arrays.values())
    model = json.loads((out / "model.json").read_text())
    assert model["family"] == "mlp" and model["version"] == rounds
    assert model["setup"] == {"classes": CLASSES, "input_dim": 384}

    rows = _comparison_rows(out / "comparison.json")
    assert [r["worker"] for r in rows] == ["w1", "w2", "w3"]
    for r in rows:
        for col in ("local_only", "federated", "centralized"):
            assert r[f"{col}_macro_f1"] is not None and 0 <= r[f"{col}_macro_f1"] <= 1, r
        assert r["n_train"] > 0 and r["n_test"] > 0
    # The workers' shares and test splits partition the 600 documents.
    assert sum(r["n_train"] + r["n_test"] for r in rows) == 600

    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == ["w1", "w2", "w3"] and summary["rounds"] == rounds
    assert summary["version"] == rounds and summary["errors_served"] == 0
    assert [r["worker"] for r in summary["comparison"]] == ["w1", "w2", "w3"]
    assert (out / "comparison.md").exists()

    # The comparison table is printed, one line per worker.
    assert "| worker | train | test | local-only F1 | federated F1 | centralized F1" in stdout
    for w in ("w1", "w2", "w3"):
        assert any(line.startswith(f"| {w} |") for line in stdout.splitlines()), stdout
    assert str(out) in stdout
    for name in ("master", "w1", "w2", "w3"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0
    for w in ("w1", "w2", "w3"):
        assert f"{w} done: federated macro-F1" in (out / "logs" / f"{w}.log").read_text()


# --------------------------------------------------------------------------------------------
# A worker that starts late
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_late_worker_joins_during_training(tmp_path: Path, make_config: MakeConfig,
                                           procs: Procs) -> None:
    """w3 starts after training has begun and still takes part in the following rounds.

    Rounds take milliseconds, far less than a worker needs to start, so the test holds the
    job open by pausing w2 (SIGSTOP) right after it registers: the round it is in cannot close
    without it (min_workers=2, and w1 alone is 1). Once w3 has registered, w2 resumes.

    The workers run with their own copy of the config with a long join_timeout: a worker
    also uses join_timeout as the longest silence it accepts from the master, and a paused
    process hears nothing (its ZeroMQ I/O thread is paused too), so on resuming w2 could take
    its own pause for the master's silence (and w1 and w3 need not be as hasty as the master).
    """
    rounds = 6
    # join_timeout: the master starts with min_workers this long after the first registration;
    # local_epochs slows rounds a little so that pausing w2 lands before the job could end;
    # heartbeat_timeout: the paused w2 is not dropped (which would let its round close) however
    # long w3 takes to start on a busy machine (over 5 s, the default, with two tests at a time).
    cfg = make_config(tmp_path, workers=3, rounds=rounds, min_workers=2, join_timeout=2,
                      heartbeat_timeout=60, model={"family": "mlp", "local_epochs": 20})
    raw = yaml.safe_load(cfg.read_text())
    rep = f"tcp://127.0.0.1:{raw['master']['rep_port']}"
    patient = tmp_path / "workers.yaml"
    patient.write_text(yaml.safe_dump({**raw, "join_timeout": 300}, sort_keys=False))
    out = tmp_path / "out"
    procs.master(cfg)
    procs.worker(patient, "w1")
    w2 = procs.worker(patient, "w2")
    paused = False
    try:
        wait_for(lambda: {"w1", "w2"} <= {e["worker"] for e in events(out, "register")}, 120,
                 "w1 and w2 to register", procs.check_alive_or_ok, interval=0.05)
        w2.send_signal(signal.SIGSTOP)
        paused = True
        assert not events(out, "done"), "the job ended before w2 could be paused"

        def training() -> bool:
            reply = _ping(rep, "w1")
            return reply is not None and reply.kind == "pong" and reply.body["phase"] == "training"

        wait_for(training, 60, "the master to start training", procs.check_alive_or_ok)
        assert "w3" not in {e["worker"] for e in events(out, "register")}
        procs.worker(patient, "w3")
        wait_for(lambda: [e for e in events(out, "register") if e["worker"] == "w3"], 120,
                 "w3 to register", procs.check_alive_or_ok)
    finally:
        if paused:
            w2.send_signal(signal.SIGCONT)
    codes = procs.wait_all(timeout=150)
    assert codes == {"master": 0, "w1": 0, "w2": 0, "w3": 0}, procs.logs_tail()

    (reg3,) = [e for e in events(out, "register") if e["worker"] == "w3"]
    assert reg3["phase"] == "training" and reg3["round"] >= 1 and not reg3["rejoin"]
    w3_rounds = {e["round"] for e in events(out, "worker_round") if e["worker"] == "w3"}
    later = set(range(reg3["round"] + 1, rounds + 1))
    assert later and later <= w3_rounds, (reg3, sorted(w3_rounds))
    round_evs = {e["round"]: e for e in events(out, "round")}
    assert sorted(round_evs) == list(range(1, rounds + 1))
    assert all(round_evs[r]["n_updates"] == 3 for r in later)
    assert json.loads((out / "summary.json").read_text())["workers"] == ["w1", "w2", "w3"]
    assert "w3 done: federated macro-F1" in procs.log("w3")
    # --threads 1 (what Procs passes) caps torch and every BLAS / OpenMP pool the worker loaded
    (threads,) = [line.split("CPU threads: ")[1] for line in procs.log("w3").splitlines()
                  if "CPU threads: " in line]
    pools = dict(p.rsplit(" ", 1) for p in threads.split(", "))
    assert {"torch", "openblas", "openmp"} <= set(pools) and set(pools.values()) == {"1"}, threads


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "mentions"), [
    ((), ("master", "worker", "run", "check", "data", "--help", "--version")),
    (("master",), ("--config", "--workers", "--rounds", "--output", "--threads",
                   "--log-level")),
    (("worker",), ("--config", "--id", "--data", "--device", "--workers", "--rounds",
                   "--threads", "--log-level")),
    (("run",), ("--config", "--workers", "--rounds", "--output", "--progress", "--no-progress",
                "--log-level")),
    (("check",), ("--config", "--family", "--no-family", "--id", "--data", "--as", "--workers",
                  "--rounds", "--json")),
    (("data", "shard"), ("--config", "--data", "--out", "--workers", "--json", "[WORKER]...")),
])
def test_help(args: tuple[str, ...], mentions: tuple[str, ...]) -> None:
    result = run_fedctl(*args, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage:")
    for word in mentions:
        assert word in result.stdout, (word, result.stdout)


def test_worker_without_master_gives_up(tmp_path: Path, make_config: MakeConfig,
                                        embed_cache: Path) -> None:
    cfg = make_config(tmp_path, workers=2, join_timeout=2)  # free ports: nobody listens there
    result = run_fedctl("worker", "--config", str(cfg), "--id", "w1", timeout=90,
                        cache_dir=embed_cache)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert "announcement" in errors[0] and "within 2s" in errors[0], errors[0]


@pytest.mark.parametrize(("overrides", "field"), [
    ({"colour": "blue"}, "colour"),
    ({"data": {"limt": 600}}, "data.limt"),
    ({"master": {"pub_port": "five"}}, "master.pub_port"),
    ({"rounds": 0}, "rounds"),
], ids=["unknown-field", "unknown-nested-field", "bad-port", "zero-rounds"])
def test_bad_config_is_one_line_error(tmp_path: Path, make_config: MakeConfig, overrides: dict,
                                      field: str) -> None:
    cfg = make_config(tmp_path, **overrides)
    result = run_fedctl("run", "--config", str(cfg), timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and f"{field}:" in lines[0], lines[0]
    assert str(cfg) in lines[0]
    assert not (tmp_path / "out").exists()  # nothing was started


def test_bad_data_setting_is_one_line_error(tmp_path: Path, make_config: MakeConfig) -> None:
    cfg = make_config(tmp_path, data={"partition": "bogus"})
    result = run_fedctl("run", "--config", str(cfg), timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and "partition" in lines[-1], lines[-1]


@pytest.mark.slow
def test_bad_model_field_is_one_line_error(tmp_path: Path, make_config: MakeConfig,
                                           embed_cache: Path) -> None:
    cfg = make_config(tmp_path, model={"family": "mlp", "hiddn": 64})
    proc = subprocess.Popen(fedctl_command("run", "--config", str(cfg), "--no-progress"), cwd=ROOT,
                            env=child_env(embed_cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "model.hiddn" in lines[0], \
        stderr[-2000:]
    assert not (tmp_path / "out" / "logs").exists()  # nothing was started
