"""A resumed master before it reopens its round (the `RESUME_GRACE` window).

Regression: workers whose update (or fetch) reached a resumed master before it had reopened the
round were told `stale_round`, took the round as done, and never sent it again; the master then
waited for `min_workers` updates forever. Now the master answers `not_ready`, announces
`open: false`, and the workers redo the round once it is published.

The master and workers run in this process (threads) and talk ZeroMQ over TCP loopback; the
grace window is held open by hand so that the test does not race it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from common.config import load_config
from common.net.wire import Message, decode, encode
from master.server import Master
from tests.conftest import MakeConfig, events, start_worker_threads

pytestmark = pytest.mark.slow
WORKERS = ["w1", "w2", "w3"]


def _run(cfg_path: Path, resume: bool = False, hold: bool = False
         ) -> tuple[Master, threading.Thread, dict[str, Any], list[BaseException]]:
    """Bind a master and start it and the three workers as threads."""
    cfg = load_config(cfg_path)
    master = Master(cfg, resume=resume)
    if hold:
        master._resume_at = math.inf  # the grace window stays open until the test ends it
    master.bind()
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            master.serve()
        except BaseException as exc:
            errors.append(exc)
        finally:
            master.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    start_worker_threads(cfg, WORKERS, reports, errors)
    return master, server, reports, errors


def _request(endpoint: str, kind: str, body: dict[str, Any], arrays: Any = None) -> Message:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # (a failed handshake leaves no pipe)
    try:
        sock.connect(endpoint)
        sock.send_multipart(encode(kind, body, arrays), copy=False)
        return decode(sock.recv_multipart())
    finally:
        sock.close()


def _announce(endpoint: str) -> dict[str, Any]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"announce")
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # (a failed handshake leaves no pipe)
    try:
        sock.connect(endpoint)
        return decode(sock.recv_multipart()).body
    finally:
        sock.close()


def test_update_before_the_resumed_round_opens_is_redone(tmp_path: Path,
                                                         make_config: MakeConfig) -> None:
    first = make_config(tmp_path, rounds=2, checkpoint_every=1, name="two.yaml")
    _, server, _, errors = _run(first)
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors

    # The same job, resumed with two more rounds to go; round 3 is not open yet.
    more = make_config(tmp_path, rounds=4, checkpoint_every=1, name="four.yaml")
    cfg = load_config(more)
    master, server, reports, errors = _run(more, resume=True, hold=True)
    rep, pub = cfg.master.rep_endpoint, cfg.master.pub_endpoint
    try:
        beacon = _announce(pub)
        assert (beacon["phase"], beacon["round"], beacon["open"]) == ("training", 3, False)
        model = {k: v.copy() for k, v in master.family.global_.arrays.items()}
        early = _request(rep, "update", {"worker_id": "w1", "round": 3, "version": 2,
                                         "n_samples": 10, "metrics": {}}, model)
        assert (early.kind, early.body["code"]) == ("error", "not_ready")
        fetch = _request(rep, "fetch", {"worker_id": "w2"})
        assert (fetch.kind, fetch.body["code"]) == ("error", "not_ready")
        time.sleep(1.0)  # the workers hear the announcements and wait
        assert master.open is None and not errors, errors
    finally:
        master._resume_at = 0.0
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors
    out = Path(cfg.output_dir)
    rounds = {e["round"]: e for e in events(out, "round")}
    assert sorted(rounds) == [1, 2, 3, 4]
    for r in (3, 4):  # every worker took part in the resumed rounds
        assert (rounds[r]["n_updates"], rounds[r]["missing"]) == (3, []), rounds[r]
    assert sorted(reports) == WORKERS


def test_resume_refuses_a_finished_run_and_an_empty_folder(make_config: MakeConfig,
                                                           tmp_path: Path) -> None:
    """`fedctl master --resume` on a finished run used to write its results over with n/a;
    on a folder with no checkpoint it left an empty metrics log behind. Both are refused
    before anything is written."""
    cfg = load_config(make_config(tmp_path, workers=1, rounds=1))
    out = Path(cfg.output_dir)
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from"):
        Master(cfg, resume=True)
    assert not out.exists()
    out.mkdir()
    (out / "checkpoint.npz").write_bytes(b"the checkpoint of the finished run")
    (out / "summary.json").write_text('{"rounds": 1}')
    with pytest.raises(FileNotFoundError, match="holds a finished run of 1 round"):
        Master(cfg, resume=True)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.npz", "summary.json"]


def test_resume_refuses_a_config_of_another_model(tmp_path: Path,
                                                  make_config: MakeConfig) -> None:
    """A resume with another width used to go on training the checkpoint's arrays and save
    them under the new width's name (a model no one could load)."""
    first = make_config(tmp_path, rounds=2, checkpoint_every=1, name="two.yaml")
    _, server, _, errors = _run(first)
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors
    wider = make_config(tmp_path, rounds=4, name="wider.yaml",
                        model={"family": "mlp", "hidden": 7})
    with pytest.raises(RuntimeError, match=r"--resume: the checkpoint's job is not .*"
                                           r"model\.hidden: \d+ in the checkpoint, 7 in the "
                                           r"config"):
        Master(load_config(wider), resume=True)


def test_resume_refuses_other_data_a_damaged_checkpoint_and_a_second_master(
        tmp_path: Path, make_config: MakeConfig) -> None:
    from common.atomic import atomic_write
    from master.checkpoint import FILENAME, Checkpoint

    """A resume with another data.limit went on and cut its baselines from other documents
    than the workers trained on; a damaged checkpoint gave a traceback (an empty one, a bare
    "Aborted!"); two masters into one folder both ran and mixed their metrics."""
    first = make_config(tmp_path, rounds=2, checkpoint_every=1, name="two.yaml",
                        baselines=True)
    _, server, _, errors = _run(first)
    server.join(timeout=180)
    assert not server.is_alive() and not errors, errors
    out = Path(load_config(first).output_dir)
    (out / "summary.json").unlink()  # as if the master had died before its end
    other = make_config(tmp_path, rounds=4, name="other.yaml", data={"limit": 300},
                        baselines=True)
    with pytest.raises(RuntimeError, match=r"--resume: the checkpoint's data is not .*"
                                           r"data\.limit: 600 in the checkpoint, 300 in the "
                                           r"config"):
        Master(load_config(other), resume=True)
    # Another worker list cuts every worker's share anew (and the baselines' with it): a
    # resume with --workers 3 went on, a worker that never was in its comparison table.
    two = make_config(tmp_path, workers=2, rounds=4, name="two_workers.yaml")
    with pytest.raises(RuntimeError, match=r"--resume: the checkpoint's data is not .*"
                                           r"workers: \['w1', 'w2', 'w3'\] in the checkpoint, "
                                           r"\['w1', 'w2'\] in the config"):
        Master(load_config(two), resume=True)
    same = load_config(make_config(tmp_path, rounds=4, name="four.yaml"))
    holder = Master(same, resume=True)  # the folder is free again after the refusal
    try:
        with pytest.raises(RuntimeError, match="another master is writing into"):
            Master(same, resume=True)
    finally:
        holder.close()
    good = (out / "checkpoint.npz").read_bytes()
    for damaged in (b"", good[:5000], good[:100] + bytes(2000) + good[2100:]):
        (out / "checkpoint.npz").write_bytes(damaged)
        with pytest.raises(RuntimeError, match=r"checkpoint\.npz: unreadable .*resume is not "
                                               r"possible from it"):
            Master(same, resume=True)
    # Written by someone else: a deflated member (an 8 MB one held 8 GiB of zeros), and a
    # record edited by hand (a KeyError, a TypeError... as tracebacks).
    (out / "checkpoint.npz").write_bytes(good)
    ckpt = Checkpoint.load(out)
    arrays = {k: v for k, v in np.load(out / "checkpoint.npz").items()}
    np.savez_compressed(out / "checkpoint.npz", **arrays)
    with pytest.raises(RuntimeError, match=r"unreadable \(NpzError: .* is compressed"):
        Master(same, resume=True)
    name = next(iter(ckpt.global_arrays))
    nan_model = {**ckpt.global_arrays, name: np.full_like(ckpt.global_arrays[name], np.nan)}
    atomic_write(out / FILENAME, Checkpoint(ckpt.meta, nan_model, ckpt.strategy_arrays,
                                            ckpt.family_arrays).write_to)
    with pytest.raises(RuntimeError, match=rf"not a checkpoint's .*'{name}' holds NaN"):
        Master(same, resume=True)  # it would publish a model no worker can train
    for edit in ({"run_id": None}, {"version": [1]}, {"registrations": 5}):
        meta = {**ckpt.meta, **edit}
        if edit == {"run_id": None}:
            del meta["run_id"]
        atomic_write(out / FILENAME, Checkpoint(meta, ckpt.global_arrays, ckpt.strategy_arrays,
                                                ckpt.family_arrays).write_to)
        with pytest.raises(RuntimeError, match=r"its record is not a checkpoint's .*resume is "
                                               r"not possible from it"):
            Master(same, resume=True)


def test_a_master_that_dies_at_its_end_is_resumed_with_the_reports_it_had(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """Killed while it trained its baselines, after the workers had reported and left, a
    resumed master waited for reports no one would send and wrote every worker's scores as
    n/a. The reports are kept as they come (reports.jsonl)."""
    first = make_config(tmp_path, rounds=2, checkpoint_every=1, heartbeat_timeout=2)
    _, server, reports, errors = _run(first)
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors
    out = Path(load_config(first).output_dir)
    before = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()  # as if the master had died before its end
    master = Master(load_config(first), resume=True)
    master.bind()
    try:
        after = master.serve()
    finally:
        master.close()
    assert after["comparison"] == before["comparison"], (before, after)
    assert all(r["federated_macro_f1"] is not None for r in after["comparison"])



def test_a_master_resumed_after_training_waits_for_its_workers_to_report(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """Stopped after its last round, before two of three workers had reported (`fedctl run`
    interrupted while they scored their baselines), then resumed as its hint says, the master
    waited a heartbeat_timeout for workers not yet restarted and wrote their scores as n/a.
    It now waits for them as a starting master does, up to join_timeout."""
    first = make_config(tmp_path, rounds=2, checkpoint_every=1, heartbeat_timeout=2,
                        join_timeout=60)
    _, server, _, errors = _run(first)
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors
    out = Path(load_config(first).output_dir)
    before = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()
    kept = [line for line in (out / "reports.jsonl").read_text().splitlines()
            if '"w2"' in line]
    (out / "reports.jsonl").write_text("\n".join(kept) + "\n")
    cfg = load_config(first)
    master = Master(cfg, resume=True)
    master.bind()
    result: dict[str, Any] = {}
    server = threading.Thread(target=lambda: result.update(master.serve()), daemon=True)
    server.start()
    try:
        time.sleep(3 * cfg.heartbeat_timeout)  # the user starts the workers by hand, later
        reports: dict[str, Any] = {}
        start_worker_threads(cfg, ["w1", "w3"], reports, errors)
        server.join(timeout=120)
    finally:
        master.close()
    assert not server.is_alive() and not errors, errors
    assert sorted(reports) == ["w1", "w3"]
    assert result["comparison"] == before["comparison"]


def _two_rounds_checkpointed(tmp_path: Path, make_config: MakeConfig) -> tuple[Path, Any]:
    """A two-round job run to its end, checkpointing each round: its folder and checkpoint."""
    from master.checkpoint import Checkpoint

    first = make_config(tmp_path, rounds=2, checkpoint_every=1, name="two.yaml")
    _, server, _, errors = _run(first)
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors
    out = Path(load_config(first).output_dir)
    return out, Checkpoint.load(out)


def test_resume_remembers_who_was_excluded_and_refused(tmp_path: Path,
                                                       make_config: MakeConfig) -> None:
    """summary.json after a resume used to say `excluded: {}` and count refusals from zero:
    an excluded member could even register again; the counts toward excluding one began at
    zero again. The checkpoint keeps them."""
    import json

    from common.atomic import atomic_write
    from master.checkpoint import FILENAME

    out, ckpt = _two_rounds_checkpointed(tmp_path, make_config)
    assert ckpt.meta["excluded"] == {}
    ckpt.meta["excluded"] = {"w9": "sent a poisoned update"}  # as a run would have
    ckpt.meta["refused"] = {"w9": {"bad_field": 3}}
    assert ckpt.meta["misconduct"] == {"silent": {}, "abstained": {},
                                       "steps_since_forgiven": {}, "rounds_since_forgiven": {}}
    # A count toward ABSTAIN_LIMIT began at zero again after a resume: a new allowance.
    ckpt.meta["misconduct"] = {"silent": {"w9": 2}, "abstained": {"w9": 1},
                               "steps_since_forgiven": {"w9": 3},
                               "rounds_since_forgiven": {"w9": 2}}
    atomic_write(out / FILENAME, ckpt.write_to)

    more = make_config(tmp_path, rounds=3, checkpoint_every=1, name="three.yaml")
    master, server, _, errors = _run(more, resume=True)
    back = _request(load_config(more).master.rep_endpoint, "register",
                    {"worker_id": "w9", "n_samples": 5, "device": "cpu", "info": {}})
    assert (back.kind, back.body["code"]) == ("error", "excluded")
    assert (master._silent["w9"], master._abstained["w9"], master._steps_since_forgiven["w9"],
            master._rounds_since_forgiven["w9"]) == (2, 1, 3, 2)
    server.join(timeout=120)
    assert not server.is_alive() and not errors, errors
    summary = json.loads((out / "summary.json").read_text())
    assert summary["excluded"] == {"w9": "sent a poisoned update"}
    assert summary["refused"]["w9"]["bad_field"] == 3


def test_resume_keeps_the_growth_windows(tmp_path: Path, make_config: MakeConfig) -> None:
    """A master resumed with empty growth windows held the next aggregate to 100 x the model
    it replaced alone: the member that had just stepped 99 x could step 99 x again."""
    from common.atomic import atomic_write
    from master.checkpoint import FILENAME

    out, ckpt = _two_rounds_checkpointed(tmp_path, make_config)
    [(form, norms, least, most)] = ckpt.meta["growth"]  # the mlp's one form, two published
    assert len(norms) == 2 and least == min(norms) > 0 and most == max(norms), (norms, least)
    ckpt.meta["growth"] = [[form, [1e-3, *norms], 1e-3, most]]  # as if a smaller one had been
    atomic_write(out / FILENAME, ckpt.write_to)

    more = make_config(tmp_path, rounds=3, checkpoint_every=1, name="three.yaml")
    master = Master(load_config(more), resume=True)
    try:
        assert master._growth.state() == [[form, [1e-3, *norms], 1e-3, most]]
        current = {k: np.asarray(v) for k, v in ckpt.global_arrays.items()}
        # the same model again passes against itself, but not against the window's floor
        assert master._growth.problem(current, current) is not None
    finally:
        master.close()
    ckpt.meta["growth"] = [[form, ["NaN"], 1.0, 1.0]]
    atomic_write(out / FILENAME, ckpt.write_to)
    with pytest.raises(RuntimeError, match="growth windows are malformed"):
        Master(load_config(more), resume=True)
