"""No trust inside the cluster: a worker that holds an admitted key speaks only for itself and
cannot crash, stall, exhaust or corrupt the master.

The acceptance test runs the real thing twice on CURVE: a `fedctl master` and two honest
`fedctl worker` processes (w2, w3), once with w1 absent (the undisturbed run) and once with w1's
key in the hands of :class:`tests.hostile.Hostile`, which sends every attack of issue #22's
table. The honest workers' final scores must match, the master's memory stay bounded, and no
forged line, NaN or Inf reach its log or metrics. Smaller tests put one in-process master (real
sockets, no training) through the attacks that end a worker's part: a registration that breaks
the set-up, a vocabulary no documents could give, a step abstained from again and again.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import yaml
import zmq

from common import constants as C
from common.config import load_config
from common.data.shards import local_data, worker_seed
from common.data.text import vocabulary_info
from common.net.security import keygen
from common.net.wire import ProtocolError
from master import screening
from master.server import Master
from tests.conftest import MakeConfig, Procs, events, start_worker_threads, wait_for
from tests.hostile import Hostile, RssWatch, frames, nested_lists_header

pytestmark = pytest.mark.slow

CLASSES = ["rest", "MeanOfTransportation"]
HONEST_INFO = {"input_dim": 384, "classes": CLASSES}


def _config(make_config: MakeConfig, tmp_path: Path, keys: Path | None = None,
            workers: int = 3, **overrides: Any) -> Path:
    """A CURVE cluster of w1..w3 (or of ``workers``) in ``tmp_path`` (keys in ``keys``,
    default tmp_path/keys)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    keys = keys or tmp_path / "keys"
    if not keys.exists():
        keygen(keys, ["w1", "w2", "w3"])
    return make_config(tmp_path, workers=workers, security={"mode": "curve", "keys_dir": str(keys)},
                       **{"rounds": 3, "min_workers": 2, **overrides})


def _endpoints(config: Path) -> tuple[str, str, Path]:
    raw = yaml.safe_load(config.read_text())
    m = raw["master"]
    return (f"tcp://127.0.0.1:{m['rep_port']}", f"tcp://127.0.0.1:{m['pub_port']}",
            Path(raw["security"]["keys_dir"]))


def _run(procs: Procs, config: Path, attack: Any = None, workers_config: Path | None = None,
         honest: tuple[str, ...] = ("w2", "w3")) -> tuple[dict[str, Any], int]:
    """Master and the ``honest`` workers as processes (and the attack, if any, on a thread);
    returns summary.json and the master's peak resident memory. The workers read
    ``workers_config`` where given (default: the master's)."""
    master = procs.master(config)
    rss = RssWatch(master.pid)
    rss.start()
    thread = None
    if attack is not None:
        thread = threading.Thread(target=attack, daemon=True)
        thread.start()
    for w in honest:
        procs.worker(workers_config or config, w)
    codes = procs.wait_all(timeout=240)
    peak = rss.stop()
    if thread is not None:
        thread.join(timeout=30)
    assert codes == {n: 0 for n in codes}, procs.logs_tail()
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    return json.loads((out / "summary.json").read_text()), peak


def _run_beside_a_hostile_w1(procs: Procs, config: Path, mark: bool = False,
                             honest: tuple[str, ...] = ("w2", "w3")
                             ) -> tuple[dict[str, Any], list[BaseException]]:
    """w1 a real Worker on a thread of this process, the only worker there (so that the
    test's patches are its alone; ``mark`` sets ``family.hostile`` for them to tell), the
    master and the ``honest`` workers processes of their own, as in a real job. Returns
    summary.json and what w1's run raised."""
    from worker.client import Worker

    hostile = Worker(load_config(config), "w1")
    if mark:
        hostile.family.hostile = True
    errors: list[BaseException] = []

    def attack() -> None:
        try:
            hostile.run()
        except BaseException as exc:  # surfaced by the caller
            errors.append(exc)

    summary, _ = _run(procs, config, attack, honest=honest)
    return summary, errors


class Attack:
    """w1's key in hostile hands, following the master through the job (the table of #22)."""

    def __init__(self, config: Path) -> None:
        self.rep, self.pub, self.keys = _endpoints(config)
        cfg = load_config(config)
        self.info = {"input_dim": 384, "classes": local_data(cfg, "w1").classes}
        self.ctx = zmq.Context()
        self.codes: dict[str, str] = {}
        self.flood: dict[str, int] = {}
        self.error: BaseException | None = None

    def __call__(self) -> None:
        try:
            self._attack()
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            self.ctx.destroy(linger=0)

    def _attack(self) -> None:
        h = Hostile(self.ctx, self.rep, self.pub, self.keys, "w1", timeout=5)
        sub = h.subscribe(b"announce", b"round", b"shutdown")
        wait_for(lambda: h.request("ping", {"worker_id": "w1"}), 60, "the master's REP")
        reg = {"n_samples": 100, "device": "cpu", "info": self.info}
        c = self.codes
        c["register as w2"] = h.code("register", {"worker_id": "w2", **reg,
                                                  "n_samples": 999_999})
        c["register as w3"] = h.code("register", {"worker_id": "w3", **reg})
        c["ping, 16 MiB of nested lists"] = _code(h.send_frames(
            [b"ping", nested_lists_header(16 * 2**20 - 64)]))
        c["register, 16 MiB of nested lists"] = _code(h.send_frames(
            [b"register", nested_lists_header(16 * 2**20 - 64)], timeout=15))
        c["register, newline in device"] = h.code("register", {
            "worker_id": "w1", **reg, "device": "cpu\nFORGED master line"})
        # A large registration is read once per REGISTER_INTERVAL a key (the 16 MiB one just
        # now counts): this one, sooner, would be refused `busy` before it is read.
        time.sleep(C.REGISTER_INTERVAL)
        c["register, 10,000 classes"] = h.code("register", {
            "worker_id": "w1", **reg, "info": {"input_dim": 384,
                                              "classes": [f"class-{i:014d}" for i in
                                                          range(10_000)]}})
        c["register, n_samples 2^63"] = h.code("register", {"worker_id": "w1", **reg,
                                                            "n_samples": 2**63})
        c["register, unknown info key"] = h.code("register", {
            "worker_id": "w1", **reg, "info": {**self.info, "junk": [[]] * 1000}})
        c["register as w1"] = h.code("register", {"worker_id": "w1", **reg})
        # Each frame over the master's limit (max_message_mb: 20 here; 256 by default): the same
        # cut-off as for 1 GiB frames, without sending gigabytes through the test machine.
        big = np.zeros(24 * 2**20, dtype=np.uint8)
        done_rounds: set[int] = set()
        while True:
            if not sub.poll(60_000):
                raise TimeoutError("the master went silent")
            parts = sub.recv_multipart()
            head = msgpack.unpackb(parts[1])
            kind, body = head["kind"], head["body"]
            if kind == "shutdown" or (kind == "announce" and body["phase"] == "reporting"):
                break
            if kind != "round" or body["round"] in done_rounds:
                continue
            rnd, version = body["round"], body["version"]
            done_rounds.add(rnd)
            model = {name: np.frombuffer(buf, dtype=dt).reshape(shape)
                     for (name, dt, shape), buf in zip(head["arrays"], parts[2:], strict=True)}
            up = {"worker_id": "w1", "round": rnd, "version": version, "n_samples": 100,
                  "metrics": {"train_time": 0.1}}
            if rnd == 1:
                # (pings around it: a key that stays silent past heartbeat_timeout is dead)
                h.code("ping", {"worker_id": "w1"})
                c["3 frames over the limit"] = _code(h.send_frames(
                    frames("update", up) + [big.data, big.data, big.data], timeout=2))
                h.code("ping", {"worker_id": "w1"})
                c["fetch as w3"] = h.code("fetch", {"worker_id": "w3"})
                c["ping as w2"] = h.code("ping", {"worker_id": "w2"})
            if rnd == 2:
                self.flood = h.flood(20, 500)
                # The flood emptied w1's token bucket: the update waits for it to refill a
                # little (a few per REQUEST_RATE), as a worker's retry would.
                time.sleep(0.1)
            # The refused attempts last, each at once after the other, then the poisoned update:
            # with the honest updates in, a round closes REFUSED_GRACE_S after the last
            # refusal of those still out.
            c[f"round {rnd}: update as w2"] = h.code("update", {**up, "worker_id": "w2"},
                                                     model)
            c[f"round {rnd}: n_samples 2^63"] = h.code("update", {**up, "n_samples": 2**63},
                                                       model)
            c[f"round {rnd}: n_samples over the registered"] = h.code(
                "update", {**up, "n_samples": 101}, model)
            c[f"round {rnd}: sent_at NaN"] = h.code("update", {**up, "sent_at": math.nan},
                                                    model)
            c[f"round {rnd}: timing as text"] = h.code(
                "update", {**up, "metrics": {"train_time": "0.1"}}, model)
            size = sum(a.size for a in model.values())
            topk = {}
            for name, a in model.items():
                topk[name + "#idx"] = np.zeros(a.size + 1, dtype=np.int64)
                topk[name + "#val"] = np.zeros(a.size + 1, dtype=np.float32)
            c[f"round {rnd}: top-k of {size + len(model)} pairs"] = h.code(
                "update", {**up, "compression": "topk"}, topk)
            poison = ({n: np.full_like(a, np.finfo(np.float32).max) for n, a in model.items()}
                      if rnd == 2 else
                      {n: np.where(np.arange(a.size).reshape(a.shape) % 2, 1e30, -1e30
                                   ).astype(a.dtype) for n, a in model.items()})
            c[f"round {rnd}: poisoned update"] = h.code("update", up, poison)
        fake = {"federated": {"macro_f1": 0.999}, "n_train": 100, "n_test": 10, "version": 3}
        for w in ("w2", "w3"):
            c[f"report as {w}"] = h.code("report", {"worker_id": w, "report": fake})
        c["report with an unknown field"] = h.code("report", {
            "worker_id": "w1", "report": {**fake, "junk": list(range(100))}})
        c["report with NaN"] = h.code("report", {
            "worker_id": "w1", "report": {**fake, "federated": {"macro_f1": math.nan}}})
        c["report with an F1 of 1e12"] = h.code("report", {
            "worker_id": "w1", "report": {**fake, "federated": {"macro_f1": 1e12}}})
        sub.close()
        h.close()


def _code(reply: dict[str, Any] | None) -> str:
    if reply is None:
        return "no reply"
    return reply["body"]["code"] if reply["kind"] == "error" else reply["kind"]


#: The acceptance runs: 14 classes and a learning rate that gets somewhere in 3 rounds, so
#: that equal scores mean equal models (a model that predicts one class scores alike anyway).
LEARNING = {"model": {"family": "mlp", "lr": 0.01}, "data": {"task": "multiclass"},
            "max_message_mb": 20}


def test_a_hostile_member_changes_nothing_for_the_honest_ones(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    # Undisturbed: w1 never comes; the master starts with w2 and w3 once both have registered
    # and join_timeout has passed since the first did. The workers keep a long join_timeout:
    # they also take it for the longest silence they accept from the master.
    keys = tmp_path / "keys"
    calm = _config(make_config, tmp_path / "calm", keys, join_timeout=2, **LEARNING)
    patient = calm.with_name("workers.yaml")
    patient.write_text(yaml.safe_dump({**yaml.safe_load(calm.read_text()), "join_timeout": 60},
                                      sort_keys=False))
    calm_summary, calm_peak = _run(procs, calm, workers_config=patient)
    procs.stop_all()

    hostile_dir = tmp_path / "hostile"
    attacked = _config(make_config, hostile_dir, keys, **LEARNING)
    procs2 = Procs(hostile_dir / "logs", procs.cache_dir)
    attack = Attack(attacked)
    try:
        summary, peak = _run(procs2, attacked, attack)
    finally:
        procs2.stop_all()
    assert attack.error is None, repr(attack.error)
    c = attack.codes
    expected = {
        "register as w2": "identity", "register as w3": "identity",
        "ping, 16 MiB of nested lists": "too_large",
        "register, 16 MiB of nested lists": "too_large",
        "register, newline in device": "bad_field", "register, 10,000 classes": "bad_field",
        "register, n_samples 2^63": "bad_field", "register, unknown info key": "bad_field",
        "register as w1": "welcome", "3 frames over the limit": "no reply",
        "fetch as w3": "identity", "ping as w2": "identity",
        "report as w2": "identity", "report as w3": "identity",
        "report with an unknown field": "bad_field", "report with NaN": "bad_field",
        "report with an F1 of 1e12": "bad_field",
    }
    for rnd in (1, 2, 3):
        expected |= {f"round {rnd}: update as w2": "identity",
                     f"round {rnd}: n_samples 2^63": "bad_field",
                     f"round {rnd}: n_samples over the registered": "bad_field",
                     f"round {rnd}: sent_at NaN": "bad_field",
                     f"round {rnd}: timing as text": "bad_field",
                     f"round {rnd}: poisoned update": "ack"}
    topk = {k: v for k, v in c.items() if "top-k" in k}
    assert set(topk.values()) == {"shape"} and len(topk) == 3, topk
    assert {k: c.get(k) for k in expected} == expected

    # The honest workers' scores are those of the undisturbed run.
    def scores(s: dict[str, Any]) -> dict[str, float]:
        return {r["worker"]: r["federated_macro_f1"] for r in s["comparison"]
                if r["worker"] in ("w2", "w3")}
    calm_f1, f1 = scores(calm_summary), scores(summary)
    assert all(abs(f1[w] - calm_f1[w]) <= 0.01 for w in ("w2", "w3")), (f1, calm_f1)
    assert summary["rounds"] == 3 and summary["trained"]["rounds"] == 3
    # Bounded memory, and a fair share of service under the flood.
    assert peak < 2 * calm_peak, (peak, calm_peak)
    assert attack.flood.get("busy", 0) > 0 and sum(attack.flood.values()) == 10_000
    # Nothing broken or forged reached the outputs.
    out = Path(yaml.safe_load(attacked.read_text())["output_dir"])
    text = (out / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    left_out = [json.loads(line) for line in text.splitlines() if '"left_out"' in line]
    assert {(e["round"], e["worker"]) for e in left_out} == {(1, "w1"), (2, "w1"), (3, "w1")}
    log = procs2.log("master")
    assert not any(line.startswith("FORGED") for line in log.splitlines())
    with np.load(out / "model.npz") as model:
        assert all(np.isfinite(model[k]).all() for k in model.files if model[k].dtype.kind == "f")
    def log_events(cfg: Path) -> list[dict[str, Any]]:
        path = Path(yaml.safe_load(cfg.read_text())["output_dir"]) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]
    # Fair service: how long the honest uploads took to be received, per round.
    uploads = {name: {(e["round"], e["worker"]): round(e.get("upload_s", -1), 4)
                      for e in log_events(cfg) if e["event"] == "worker_round"
                      and e["worker"] != "w1"} for name, cfg in (("calm", calm),
                                                                ("attacked", attacked))}
    print(f"\nfigures: F1 attacked {f1} calm {calm_f1}; master peak RSS attacked "
          f"{peak / 2**20:.0f} MiB calm {calm_peak / 2**20:.0f} MiB; flood replies "
          f"{attack.flood}; honest uploads (s) {uploads}; refused {summary['refused']}")
    refused = summary["refused"]["w1"]
    assert refused["identity"] >= 8 and refused["outlier"] == 3 and refused["busy"] > 0
    assert "w2" not in summary["refused"] and "w3" not in summary["refused"]


def _in_process_master(config: Path) -> tuple[Master, threading.Thread]:
    master = Master(load_config(config), ctx=zmq.Context())
    master.bind()
    thread = threading.Thread(target=master.serve, daemon=True)
    thread.start()
    return master, thread


@contextmanager
def _serving(config: Path) -> Iterator[tuple[Master, threading.Thread, Callable[[str], Hostile]]]:
    """A master on a thread of this process (real sockets) and a maker of clients holding a
    given worker's key; all stopped at the end."""
    master, thread = _in_process_master(config)
    rep, pub, keys = _endpoints(config)
    ctx = zmq.Context()
    try:
        yield master, thread, lambda key_of: Hostile(ctx, rep, pub, keys, key_of)
    finally:
        master.phase = "done"
        thread.join(timeout=5)
        master.close()
        ctx.destroy(linger=0)


def test_a_registration_that_breaks_the_setup_excludes_only_its_worker(
        tmp_path: Path, make_config: MakeConfig) -> None:
    config = _config(make_config, tmp_path, min_workers=2)
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2", "w3")}
        reg = {"n_samples": 100, "device": "cpu"}
        # Each alone is a valid registration; w1's feature size cannot be combined.
        assert clients["w1"].code("register", {"worker_id": "w1", **reg, "info": {
            "input_dim": 385, "classes": CLASSES}}) == "welcome"
        for w in ("w2", "w3"):
            assert clients[w].code("register", {"worker_id": w, **reg,
                                                "info": HONEST_INFO}) == "welcome"
        wait_for(lambda: master.phase == "training", 10, "training to start")
        assert thread.is_alive()
        assert master.open is not None and master.open.participants == ["w2", "w3"]
        assert clients["w1"].code("ping", {"worker_id": "w1"}) == "excluded"
        assert clients["w2"].code("ping", {"worker_id": "w2"}) == "pong"
        assert "w1" in master.excluded and "feature size" in master.excluded["w1"]


def test_vocabulary_counts_no_documents_could_give_are_refused(
        tmp_path: Path, make_config: MakeConfig) -> None:
    config = _config(make_config, tmp_path, model={"family": "lda"})
    with _serving(config) as (master, thread, client):
        h = client("w1")
        junk = {f"junk{i}": [2**62, 2**62] for i in range(5000)}
        reg = {"worker_id": "w1", "n_samples": 100, "device": "cpu"}
        assert h.code("register", {**reg, "info": {"vocabulary": junk, "n_docs": 100}}
                      ) == "bad_field"
        # Counts a billion documents could give, from a worker that registered 100: its made-up
        # words were the agreed vocabulary's first.
        made_up = {f"zq{i}": [10**12, 10**9] for i in range(300)}
        assert h.code("register", {**reg, "info": {"vocabulary": made_up, "n_docs": 10**9}}
                      ) == "bad_field"
        honest = {"vocabulary": {"train": [30, 20], "station": [12, 10]}, "n_docs": 100}
        assert h.code("register", {**reg, "info": honest}) == "welcome"
        assert thread.is_alive() and "w1" in master.workers


def test_made_up_words_at_huge_counts_take_at_most_their_workers_places(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """2,000 made-up words, each in every one of w1's documents 10,000 times (counts
    ``check_vocabulary_info`` allows), took every place of the agreed vocabulary: the honest
    workers' documents had no word in it, their updates were refused, and the master ended
    saying nothing. Words one worker alone holds now fill at most its part of the places."""
    config = _config(make_config, tmp_path, min_workers=3,
                     model={"family": "lda", "vocab_size": 300, "min_df": 2})
    rows = [json.loads(line) for line in
            Path("data/stackoverflow_subset/stackoverflow_subset.jsonl").open()]
    texts = [r["text"] for r in rows]
    n_docs = 500
    made_up = {f"zzbogus{i}": [n_docs * 10_000, n_docs] for i in range(2000)}
    infos = {"w1": {"vocabulary": made_up, "n_docs": n_docs},
             "w2": vocabulary_info(texts[:n_docs]), "w3": vocabulary_info(texts[n_docs:])}
    with _serving(config) as (master, thread, client):
        for w, info in infos.items():
            assert client(w).code("register", {"worker_id": w, "n_samples": info["n_docs"],
                                               "device": "cpu", "info": info}) == "welcome"
        wait_for(lambda: master.phase == "training", 20, "training to start")
        vocabulary = master.family.setup_info_["vocabulary"]
        assert thread.is_alive()
    assert len(vocabulary) == 300
    assert sum(w.startswith("zzbogus") for w in vocabulary) == 100  # ceil(300 / 3)
    honest = vocabulary_info(texts)["vocabulary"]
    assert sum(w in honest for w in vocabulary) == 200


def test_a_member_growing_the_model_round_after_round_gets_no_honest_one_excluded(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """nmf, two members: w1 sends the model with one value 90 times larger each round, under
    the growth limit every round. By round 10 the honest w2's loss on that model was past
    float32's range, its updates were refused for the loss alone, and it was excluded at round
    12 (the job then failed for w1's sake). Its updates are now taken without the number, and
    the growth is held over a window of rounds (NORM_GROWTH_WINDOW), not only against the last
    model: w1's updates are left out, and the model stays within reach of honest values."""
    config = _config(make_config, tmp_path, workers=2, rounds=14, min_workers=2,
                     round_deadline=20, model={"family": "nmf"})
    cfg = load_config(config)
    info = vocabulary_info(local_data(cfg, "w1").train_texts)
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []
    with _serving(config) as (master, thread, client):
        h = client("w1")
        assert h.code("register", {"worker_id": "w1", "n_samples": info["n_docs"],
                                   "device": "cpu", "info": info}) == "welcome"
        honest = start_worker_threads(cfg, ["w2"], reports, errors)
        wait_for(lambda: master.phase != "joining", 60, "training to start")
        grown = 0
        while master.phase == "training" and grown < 14:
            rnd, version, model = _round_open(master)
            if rnd <= grown:
                time.sleep(0.02)
                continue
            grown = rnd
            first = sorted(model)[0]
            model[first].flat[0] = (float(model[first].flat[0]) or 1.0) * 90
            assert h.code("update", {"worker_id": "w1", "round": rnd, "version": version,
                                     "n_samples": info["n_docs"], "metrics": {}}, model
                          ) == "ack"
        honest[0].join(timeout=60)
        assert thread.is_alive()
        assert not errors and "w2" in reports, errors
        assert "w2" not in master.excluded and master.round == 14
        largest = max(float(np.abs(a).max()) for a in master.family.global_.arrays.values())
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(e["round"] for e in rounds if e["event"] == "round") == 14
    assert {e["worker"] for e in rounds if e["event"] == "left_out"} == {"w1"}
    assert largest < 1e4  # (past 1e12 by round 14, the window aside)


def test_one_request_of_many_frames_cannot_fill_the_masters_memory(
        tmp_path: Path, make_config: MakeConfig, procs: Procs) -> None:
    """ZMQ_MAXMSGSIZE bounds each frame, not their number, and libzmq holds a request whole
    before the master can read it: one request of 60 frames of 64 MiB (3.75 GiB, each frame
    under max_message_mb) grew the master by as much. Past memory_limit_mb the master drops
    its REP connections, the queued requests with them, and the honest workers go on."""
    limit_mb = 1024
    config = _config(make_config, tmp_path, rounds=5, join_timeout=5,
                     memory_limit_mb=limit_mb)
    rep, pub, keys = _endpoints(config)
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    master = procs.master(config)
    rss = RssWatch(master.pid)
    rss.start()
    ctx = zmq.Context()
    try:  # before any worker registers: the job waits in its joining phase meanwhile
        h = Hostile(ctx, rep, pub, keys, "w1", timeout=5)
        wait_for(lambda: h.request("ping", {"worker_id": "w1"}), 60, "the master's REP")
        big = np.zeros(64 * 2**20, dtype=np.uint8)
        sock = h._secure(ctx.socket(zmq.DEALER))
        sock.sndhwm = 0
        sock.connect(rep)
        sock.send_multipart([b"", *frames("update", {"worker_id": "w1"}), *[big.data] * 60],
                            copy=False)
        wait_for(lambda: "connections_dropped" in (out / "metrics.jsonl").read_text(), 180,
                 "the master to drop its connections", procs.check_alive_or_ok)
        assert not sock.poll(0)  # never read, never answered
        sock.close()
        h.close()
    finally:
        ctx.destroy(linger=0)
    for w in ("w2", "w3"):
        procs.worker(config, w)
    codes = procs.wait_all(timeout=240)
    peak = rss.stop()
    assert codes == {n: 0 for n in codes}, procs.logs_tail()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 5 and not summary.get("failed"), summary
    dropped = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if '"connections_dropped"' in line]
    assert dropped and dropped[0]["limit_mb"] == limit_mb, dropped
    assert peak < (limit_mb + 768) * 2**20, f"master peaked at {peak / 2**20:.0f} MiB"
    assert "dropped every connection to the REP port" in procs.log("master")


def test_a_memory_limit_below_the_masters_own_memory_is_raised_once(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """memory_limit_mb under what the master itself holds: it drops its connections once,
    finds its memory still past the limit, raises the limit above it and serves on."""
    config = _config(make_config, tmp_path, memory_limit_mb=1)
    with _serving(config) as (master, thread, client):
        h = client("w1")
        wait_for(lambda: master._memory.limit > 2**20, 10, "the limit to be raised")
        raised = master._memory.limit
        assert h.code("ping", {"worker_id": "w1"}) == "unknown_worker"  # answered
        time.sleep(0.5)  # ten more checks: none drops the connections again
        assert master._memory.limit == raised and thread.is_alive()
        assert h.code("ping", {"worker_id": "w1"}) == "unknown_worker"  # answered


def test_a_job_of_thousands_of_terms_is_refused_unread(tmp_path: Path,
                                                       make_config: MakeConfig) -> None:
    """Compared whole, a registration's job of 65,536 terms (218 kB) cost the master 60-90 ms:
    a flood of them from one admitted key starved the honest workers. It is refused at the
    2,000th term."""
    from master.agreement import MAX_JOB_NODES

    config = _config(make_config, tmp_path)

    def tree(depth: int) -> Any:
        return 0 if depth == 0 else {f"k{i}": tree(depth - 1) for i in range(16)}

    with _serving(config) as (master, thread, client):
        h = client("w1")
        reg = {"worker_id": "w1", "n_samples": 100, "device": "cpu", "info": HONEST_INFO}
        reply = h.request("register", {**reg, "job": {"model": tree(3)}})
        assert reply is not None and reply["kind"] == "error", reply
        assert reply["body"]["code"] == "rejected", reply
        assert f"more than {MAX_JOB_NODES} terms" in reply["body"]["message"], reply
        assert h.code("register", reg) == "welcome" and thread.is_alive()


@pytest.mark.parametrize("how", ["abstains", "is_screened_out"])
def test_a_worker_that_stops_every_step_is_excluded_and_the_others_train(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs, how: str) -> None:
    """prodlda with a synchronized batch norm: w1 begins every step and, in its second phase,
    abstains or sends statistics a million times too large (left out by the screening), either
    of which restarts the step; it is excluded after ABSTAIN_LIMIT tries. (Left out, it used to
    be neither silent nor abstaining: no step ever completed, and the job trained nothing.)"""
    from common.models.ntm_sync_bn import ABSTAIN, N_PHASES
    from worker.families.base import FitResult
    from worker.families.ntm import ProdLDAClient

    fit = ProdLDAClient.fit

    def abstaining_fit(self, round_, meta, arrays):  # the hostile one only
        if getattr(self, "hostile", False) and int(meta.get("phase", 0)) == 1:
            if how == "abstains":
                return FitResult({ABSTAIN: np.zeros(0)}, 1, {"abstain": 1.0})
            honest = fit(self, round_, meta, arrays)
            return FitResult({k: v * 1e6 for k, v in honest.arrays.items()},
                             honest.n_samples, honest.metrics)
        return fit(self, round_, meta, arrays)

    monkeypatch.setattr(ProdLDAClient, "fit", abstaining_fit)
    steps = 2
    config = _config(make_config, tmp_path, rounds=N_PHASES * (steps + 3), min_workers=2,
                     model={"family": "prodlda", "vocab_size": 500})
    summary, errors = _run_beside_a_hostile_w1(procs, config, mark=True)
    assert len(errors) == 1 and "excluded" in str(errors[0]), errors
    assert "w1" in summary["excluded"], summary
    assert summary["trained"]["steps"] >= steps, summary["trained"]
    assert set(summary["workers"]) >= {"w2", "w3"}, summary


def test_a_worker_whose_updates_are_refused_among_healthy_ones_costs_no_deadlines(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """w1's training diverges (NaN weights, refused) while w2 and w3 train: each round waited
    its whole deadline for w1, which sends nothing else, until w1 was excluded
    (ABSTAIN_LIMIT rounds: 3 minutes here, 6 at the default deadline)."""
    from worker.families.base import FitResult
    from worker.families.mlp import MLPClient

    fit = MLPClient.fit

    def diverging_fit(self, round_, meta, arrays):
        result = fit(self, round_, meta, arrays)
        if not getattr(self, "hostile", False):
            return result
        return FitResult({k: np.full_like(v, np.nan) for k, v in result.arrays.items()},
                         result.n_samples, {**result.metrics, "train_loss": math.nan})

    monkeypatch.setattr(MLPClient, "fit", diverging_fit)
    config = _config(make_config, tmp_path, rounds=4, min_workers=2, round_deadline=60)
    summary, errors = _run_beside_a_hostile_w1(procs, config, mark=True)
    assert len(errors) == 1 and "excluded" in str(errors[0]), errors
    assert "w1" in summary["excluded"] and summary["trained"]["rounds"] == 4, summary
    # each of w1's 3 rounds waited its 60 s deadline; now a refused update's grace, 5 s
    # (each round's, not the job's: the job's includes starting processes on a loaded machine)
    took = [e["duration_s"] for e in events(tmp_path / "out", "round")]
    assert len(took) == 4 and max(took) < 30, took


def test_a_heavy_member_in_sentencelda_gets_no_honest_ones_topics_left_out(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """sentencelda: w1 declares a billion documents (its words at counts they allow) and sends
    its topics with a quarter of each on one word. The merge, weighed by its tokens, rewrote
    w2's composed model; w2's own topics, far from it, were then left out as outliers every
    round, so its composed model was never built again. iFTM's uploads are bounded by their
    form; they are not screened by that distance."""
    from worker.families.base import FitResult
    from worker.families.lda import SentenceLDAClient

    big = 10**9
    fit, info = SentenceLDAClient.fit, SentenceLDAClient.registration_info

    def heavy_info(self):
        if not getattr(self, "hostile", False):
            return info(self)
        # Documents like w2's, trained alike: its topics are taken for w2's in the merge.
        self.train_texts, self.seed = mimic.train_texts, worker_seed(cfg, "w2")
        return {"vocabulary": {w: [big * 10_000, big] for w in info(self)["vocabulary"]},
                "n_docs": big}

    def heavy_fit(self, round_, meta, arrays):
        result = fit(self, round_, meta, arrays)
        if not getattr(self, "hostile", False):
            return result
        topics = 0.75 * np.asarray(result.arrays["topics"], dtype=np.float64)
        topics[:, -1] += 0.25
        topics /= topics.sum(axis=1, keepdims=True)
        return FitResult({"topics": topics.astype(np.float32)}, big, result.metrics)

    monkeypatch.setattr(SentenceLDAClient, "registration_info", heavy_info)
    monkeypatch.setattr(SentenceLDAClient, "fit", heavy_fit)
    monkeypatch.setattr(SentenceLDAClient, "n_samples",
                        property(lambda self: big if getattr(self, "hostile", False)
                                 else self.data.n_train))
    config = _config(make_config, tmp_path, rounds=4, min_workers=3,
                     model={"family": "sentencelda", "n_topics": 8, "sweeps": 10,
                            "vocab_size": 1500}, data={"task": "multiclass"})
    cfg = load_config(config)
    mimic = local_data(cfg, "w2")
    summary, errors = _run_beside_a_hostile_w1(procs, config, mark=True)
    assert not errors, errors
    assert summary["refused"] == {}, summary["refused"]
    assert {"w2", "w3"} <= set(summary["workers"])


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1e6, 1e20])
def test_one_of_two_members_whose_batch_moments_are_far_off_is_found(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs, scale: float) -> None:
    """prodlda, synchronized batch norm, two workers (too few to screen one out by distance):
    w1 multiplies its encoder's batch means by ``scale`` in every step's first phase, finite
    numbers. 1e6 used to move the final model's running variance to 5e10 in silence; 1e20 made
    the step's end overflow, and the master, undoing only the published payload, retried on a
    half-made step (KeyError), excluded both workers and ended the job. Now the moments are
    held to the growth limit in the phase they arrive in: w1 is left out there, at every step,
    and each step goes on with w2's batch."""
    from common.models.ntm_sync_bn import N_PHASES
    from worker.families.base import FitResult
    from worker.families.ntm import ProdLDAClient

    fit = ProdLDAClient.fit

    def lying_fit(self, round_, meta, arrays):  # only w1 runs in this process
        honest = fit(self, round_, meta, arrays)
        if int(meta.get("phase", 0)) != 0 or "mean" not in honest.arrays:
            return honest
        return FitResult({**honest.arrays, "mean": honest.arrays["mean"] * scale},
                         honest.n_samples, honest.metrics)

    monkeypatch.setattr(ProdLDAClient, "fit", lying_fit)
    steps = 5
    config = _config(make_config, tmp_path, workers=2, rounds=N_PHASES * steps, min_workers=1,
                     model={"family": "prodlda", "vocab_size": 500})
    summary, errors = _run_beside_a_hostile_w1(procs, config, honest=("w2",))
    assert not errors and not summary.get("failed"), (errors, summary)
    assert summary["trained"]["steps"] == steps, summary["trained"]
    log = procs.log("master")
    assert log.count("the update of w1 is left out") >= steps, log
    assert "the update of w2 is left out" not in log
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    model = np.load(out / "model.npz")
    for name in model.files:  # the running variance of an honest run stays near 1
        if name.endswith("running_var"):
            assert np.all(np.isfinite(model[name])) and model[name].max() < 100, name


@pytest.mark.slow
def test_one_of_two_members_whose_gradient_sums_overflow_float32_is_excluded(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """prodlda, synchronized batch norm, two workers: w1 sends sums of 1e100 at the decoder's
    logits (phase 2), finite in the master's float64 but not in the workers' float32. They
    used to be published: w2's next phase was then non-finite, w2 was refused and blamed, and
    the job ended having trained nothing. Now no value past what a float32 worker can square
    is published: w1 is left out, its steps are redone, it is excluded, and w2 trains."""
    from common.models.ntm_sync_bn import N_PHASES
    from worker.families.base import FitResult
    from worker.families.ntm import ProdLDAClient

    fit = ProdLDAClient.fit

    def overflowing_fit(self, round_, meta, arrays):  # only w1 runs in this process
        honest = fit(self, round_, meta, arrays)
        if int(meta.get("phase", 0)) != 2 or "sum_g" not in honest.arrays:
            return honest
        return FitResult({k: np.full_like(v, 1e100) for k, v in honest.arrays.items()},
                         honest.n_samples, honest.metrics)

    monkeypatch.setattr(ProdLDAClient, "fit", overflowing_fit)
    steps = 2
    config = _config(make_config, tmp_path, workers=2, rounds=N_PHASES * (steps + 4),
                     min_workers=1, model={"family": "prodlda", "vocab_size": 500})
    summary, errors = _run_beside_a_hostile_w1(procs, config, honest=("w2",))
    assert "w1" in summary["excluded"] and "w2" not in summary["excluded"], summary
    assert summary["trained"]["steps"] >= steps, summary["trained"]
    log = procs.log("master")
    assert "float32 worker can square" in log and "the update of w2" not in log, log


@pytest.mark.slow
def test_fstc_centres_or_head_of_one_of_two_members_far_off_are_left_out(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """FSTC, two workers: w1 sends centres of 1e5 (finite, under the coordinate bound, its
    counts in order) and, in the final round, honest centres beside a head of ±1e5. The
    master compared whole models only, and FSTC's published arrays change between rounds
    (the start's head, then centres alone, then centres and head), so both used to be
    published: w2 was then refused and
    excluded, and the job ended 0 with a model of 1e5 centres. Now centres and head are each
    held to the growth limit: w1 is left out every round, and the model is w2's."""
    from worker.families.base import FitResult
    from worker.families.fstc import FSTCClient

    fit = FSTCClient.fit

    def far_fit(self, round_, meta, arrays):  # only w1 runs in this process
        honest = fit(self, round_, meta, arrays)
        # Far centres, then (with honest centres) a far head in the final round.
        far = ("head.weight", "head.bias") if "head.weight" in honest.arrays else ("centers",)
        sign = {"head.bias": -1}
        arrays = {k: np.full_like(v, sign.get(k, 1) * 1e5) if k in far else v
                  for k, v in honest.arrays.items()}
        return FitResult(arrays, honest.n_samples, honest.metrics)

    monkeypatch.setattr(FSTCClient, "fit", far_fit)
    rounds = 3
    config = _config(make_config, tmp_path, workers=2, rounds=rounds, min_workers=1,
                     model={"family": "fstc", "n_clusters": 4, "iterations": 5,
                            "batch_size": 64}, data={"task": "multiclass"})
    summary, errors = _run_beside_a_hostile_w1(procs, config, honest=("w2",))
    assert not summary.get("failed") and "w2" not in summary["excluded"], summary
    log = procs.log("master")
    assert log.count("the update of w1 is left out") == rounds, log
    assert "the centres:" in log and "the head:" in log, log
    assert "the update of w2" not in log, log
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    with np.load(out / "model.npz") as model:
        assert all(np.abs(model[n]).max() < 1e3 for n in model.files), model.files


def _fstc_server(k: int, dim: int) -> tuple[Any, Any]:
    """An FSTC master family of two workers and two rounds, set up from one registration
    (k-FED centres of norm about 1/2) for both; and its first payload."""
    from common.config import parse_config
    from master.families.fstc import FSTCServer
    from master.strategies import make_strategy

    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 2,
                        "model": {"family": "fstc", "n_clusters": k}}, "<test>")
    server = FSTCServer(cfg, make_strategy("fedavg"))
    rng = np.random.default_rng(0)
    info = {"n_clusters": k, "dim": dim, "centers": (rng.normal(size=(k, dim)) / 4).tolist(),
            "counts": [5] * k}
    return server, server.setup({"w1": info, "w2": info})


def test_fstc_far_kfed_centres_and_a_far_final_head_of_one_of_three_are_left_out(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """FSTC, w1 of three (attack review): its k-FED registration holds K centres of norm 3.9
    (coordinates 0.2, far under the 1e6 bound), one document each: they took most global
    clusters, every worker's training went NaN, every final head was refused and the run
    ended a success with a model.npz no one could use. And its final head, honest but for
    600 on one cluster's bias, was averaged in: every document went to that cluster (NMI 0
    for all). Now its centres are left out of the start (KFED_NORM_FACTOR) and its head out of
    the final model (HEAD_OUTLIER_FACTOR), and the honest members train as without it."""
    from worker.families.base import FitResult
    from worker.families.fstc import FSTCClient

    info, fit = FSTCClient.registration_info, FSTCClient.fit

    def far_registration(self):  # only w1 runs in this process
        honest = info(self)
        signs = np.random.default_rng(7).choice([-1.0, 1.0],
                                                size=(honest["n_clusters"], honest["dim"]))
        return {**honest, "centers": (0.2 * signs).tolist(),
                "counts": [1] * honest["n_clusters"]}

    def biased_fit(self, round_, meta, arrays):
        honest = fit(self, round_, meta, arrays)
        if "head.bias" not in honest.arrays:
            return honest
        bias = honest.arrays["head.bias"].copy()
        bias[0] += 600.0
        return FitResult({**honest.arrays, "head.bias": bias}, honest.n_samples,
                         honest.metrics)

    monkeypatch.setattr(FSTCClient, "registration_info", far_registration)
    monkeypatch.setattr(FSTCClient, "fit", biased_fit)
    config = _config(make_config, tmp_path, workers=3, rounds=3, min_workers=3,
                     model={"family": "fstc", "n_clusters": 6, "iterations": 10,
                            "batch_size": 64}, data={"task": "multiclass"})
    summary, errors = _run_beside_a_hostile_w1(procs, config)
    assert not errors and not summary.get("failed"), (errors, summary)
    log = procs.log("master")
    assert "w1's k-FED centres are left out of the start: its largest centre's norm, 3.92" \
        in log, log
    assert "kfed start from 2 worker(s)" in log, log
    assert "the head of w1 is left out of the final model" in log, log
    assert "NaN" not in procs.log("w2") + procs.log("w3")
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    with np.load(out / "model.npz") as model:
        assert np.abs(model["head.bias"]).max() < 50, model["head.bias"]
        assert np.linalg.norm(model["centers"], axis=1).max() < 1.0


def test_an_fstc_run_whose_final_heads_were_all_refused_fails() -> None:
    """Every model of the final round refused or left out: the job ended a success, and its
    model.npz, centres without a head, could not be loaded (`fedctl predict`)."""
    from master.strategies import ClientResult

    k = 3
    server, first = _fstc_server(k, dim=4)
    assert server.model_problem() is None  # the start's head
    up = {"centers": first.arrays["centers"], "counts": np.full(k, 5, np.float32)}
    server.aggregate(1, [ClientResult("w1", up, 15)])  # round 2, the final one, never comes
    assert "no clustering head" in server.model_problem()
    head = {n: a for n, a in first.arrays.items() if n.startswith("head.")}
    server.aggregate(2, [ClientResult("w1", {**up, **head}, 15)])
    assert server.model_problem() is None


def test_secure_sums_refused_round_after_round_end_the_job_saying_why(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """The same w1 (batch means x 1e6) under secure aggregation: inside the sum no member can
    be left out, so each step's first phase is refused. It was repeated until the round budget
    (twice the rounds) ran out, and the job ended 'finished' with 0 steps and no reason. Now it
    fails after SECAGG_MAX_REFUSED_SUMS refused sums in a row, saying why."""
    from common import constants as C
    from common.models.ntm_sync_bn import N_PHASES
    from worker.families.base import FitResult
    from worker.families.ntm import ProdLDAClient

    fit = ProdLDAClient.fit

    def lying_fit(self, round_, meta, arrays):  # only w1 runs in this process
        honest = fit(self, round_, meta, arrays)
        if int(meta.get("phase", 0)) != 0 or "mean" not in honest.arrays:
            return honest
        return FitResult({**honest.arrays, "mean": honest.arrays["mean"] * 1e6},
                         honest.n_samples, honest.metrics)

    monkeypatch.setattr(ProdLDAClient, "fit", lying_fit)
    config = _config(make_config, tmp_path, workers=2, rounds=N_PHASES * 5, min_workers=2,
                     model={"family": "prodlda", "vocab_size": 500},
                     privacy={"secure_aggregation": {"threshold": 2}})
    codes = _beside_a_hostile_w1(procs, config, ("w2",))
    assert codes == {"master": 1, "w2": 3}, procs.logs_tail()
    failed = procs.log("master").strip().splitlines()[-1]
    assert failed.startswith(f"Error: the last {C.SECAGG_MAX_REFUSED_SUMS} secure sums could "
                             f"not be applied"), failed
    assert "a member's update cannot be left out of a sum" in failed
    assert procs.log("master").count("the secure sum cannot be applied") == (
        C.SECAGG_MAX_REFUSED_SUMS)


def test_a_member_excluded_in_a_secure_step_does_not_end_the_master(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """w1 registers again at each unmask stage of round 1: the third time it is excluded,
    after its masked input was taken. The step's next phase went to the fixed members, w1
    among them, and the master ended in a KeyError; now the step starts again without it."""
    from common.models.ntm_sync_bn import N_PHASES
    from common.net import transport

    request = transport.LazyPirateClient.request
    sent: dict[str, Any] = {}

    def registers_again(self, kind, body=None, arrays=None):  # only w1 runs in this process
        if kind == "register":
            sent["register"] = dict(body)
        elif (kind == "secagg" and (body or {}).get("stage") == "unmask"
              and body.get("round") == 1 and sent.get("again", 0) < 3):
            sent["again"] = sent.get("again", 0) + 1
            request(self, "register", sent["register"])
        return request(self, kind, body, arrays)

    monkeypatch.setattr(transport.LazyPirateClient, "request", registers_again)
    # Without CURVE: with it, a key registers at most once every REGISTER_INTERVAL.
    config = make_config(tmp_path, workers=3, security={"mode": "none"},
                         rounds=N_PHASES * 2, min_workers=2,
                         model={"family": "prodlda", "vocab_size": 500},
                         privacy={"secure_aggregation": {"threshold": 2}})
    codes = _beside_a_hostile_w1(procs, config, ("w2", "w3"))
    assert sent.get("again") == 3
    assert codes == {"master": 0, "w2": 0, "w3": 0}, procs.logs_tail()
    log = procs.log("master")
    assert "excluded w1 from the job: registered again" in log
    assert "w1 dropped out in phase 1; redoing the step" in log


@pytest.mark.parametrize("workers, threshold", [(3, 2), (3, 3)],
                         ids=["unmasked-without-it", "too-few-shares-without-it"])
def test_a_member_that_keeps_its_reveal_back_is_excluded(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs, workers: int, threshold: int) -> None:
    """w1 sends its masked input and then never its reveal: each round waited out the reveal
    stage (SECAGG_STAGE_TIMEOUT, 60 s) and was unmasked from the others' shares, with nothing
    counted against w1, for the whole job; with a threshold its shares are needed for, each
    attempt failed and the round began again, also with nothing counted. Now it is silent
    (once an attempt), and excluded at ABSTAIN_LIMIT."""
    from common.net import transport
    from common.net.wire import Message
    from common.secagg import protocol as P
    from worker.client import Worker

    monkeypatch.setattr(C, "SECAGG_STAGE_TIMEOUT", 2.0)  # the master is on a thread here
    request = transport.LazyPirateClient.request
    kept_back = []

    def keeps_its_reveal(self, kind, body=None, arrays=None):  # only w1 runs in this process
        if kind == "secagg" and (body or {}).get("stage") == P.REVEAL:
            kept_back.append(body["round"])
            return Message(kind="secagg", body={"ready": True})
        return request(self, kind, body, arrays)

    monkeypatch.setattr(transport.LazyPirateClient, "request", keeps_its_reveal)
    rounds = C.ABSTAIN_LIMIT + 2
    # (without CURVE: keys are made for three workers)
    config = make_config(tmp_path, workers=workers, security={"mode": "none"}, rounds=rounds,
                         min_workers=2, privacy={"secure_aggregation": {"threshold": threshold}})
    master, thread = _in_process_master(config)
    try:
        hostile, errors = Worker(load_config(config), "w1"), []
        threading.Thread(target=lambda: _catch(hostile.run, errors), daemon=True).start()
        honest = [f"w{i}" for i in range(2, workers + 1)]
        for w in honest:
            procs.worker(config, w)
        # Without w1 the others are fewer than a threshold of 3: that job ends, saying why.
        ends = 0 if threshold < workers else 3
        assert procs.wait_all(timeout=240) == dict.fromkeys(honest, ends), procs.logs_tail()
        thread.join(timeout=30)
    finally:
        master.phase = "done"
        thread.join(timeout=5)
        master.close()
    assert len(kept_back) >= C.ABSTAIN_LIMIT
    assert "ABSTAIN_LIMIT" in master.excluded.get("w1", ""), master.excluded
    if threshold < workers:
        assert master.summary.get("rounds") == rounds and "failed" not in master.summary
    else:
        assert "threshold" in master.summary.get("failed", ""), master.summary


def test_a_member_that_abstains_twice_a_step_is_excluded(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch,
        procs: Procs) -> None:
    """w1 abstains from each step's last phase twice, then takes part: every abstention used
    to be forgiven when the step completed, so it was never excluded while each of its steps
    was redone twice, and the job's round budget ran out at a third of its steps."""
    from common.models.ntm_sync_bn import ABSTAIN, N_PHASES
    from worker.families.base import FitResult
    from worker.families.ntm import ProdLDAClient

    fit = ProdLDAClient.fit
    last_phase = []

    def abstains_twice(self, round_, meta, arrays):  # only w1 runs in this process
        if int(meta.get("phase", 0)) == N_PHASES - 1:
            last_phase.append(round_)
            if len(last_phase) % 3:
                return FitResult({ABSTAIN: np.zeros(0)}, 1, {"abstain": 1.0})
        return fit(self, round_, meta, arrays)

    monkeypatch.setattr(ProdLDAClient, "fit", abstains_twice)
    steps = 4
    config = _config(make_config, tmp_path, rounds=N_PHASES * steps, min_workers=2,
                     model={"family": "prodlda", "vocab_size": 500})
    codes = _beside_a_hostile_w1(procs, config, ("w2", "w3"))
    assert codes == {"master": 0, "w2": 0, "w3": 0}, procs.logs_tail()
    summary = json.loads((Path(load_config(config).output_dir) / "summary.json").read_text())
    assert "not forgiven by steps completed" in summary["excluded"]["w1"], summary["excluded"]
    assert summary["trained"]["steps"] == steps, summary["trained"]


def _beside_a_hostile_w1(procs: Procs, config: Path, honest: tuple[str, ...]
                         ) -> dict[str, int]:
    """The master and the ``honest`` workers as processes, w1 on a thread of this process (its
    code monkeypatched by the test); their exit codes once all have ended."""
    from worker.client import Worker

    procs.master(config)
    hostile, errors = Worker(load_config(config), "w1"), []
    thread = threading.Thread(target=lambda: _catch(hostile.run, errors), daemon=True)
    thread.start()
    for w in honest:
        procs.worker(config, w)
    codes = procs.wait_all(timeout=240)
    thread.join(timeout=30)
    return codes


def _catch(run: Any, errors: list[BaseException]) -> None:
    try:
        run()
    except BaseException as exc:  # the job's failure reaches w1 too
        errors.append(exc)


def _small_sync_prodlda_master(mode: str = "sync", strategy: str = "fedavg",
                               **privacy: Any) -> Any:
    """The master's half of a synchronized-batch-norm prodlda job of two workers (or, with
    ``mode`` fedavg, of averaged weights), set up in this process (30 words each, 50 agreed,
    3 topics)."""
    from common.config import parse_config
    from master.families.ntm import ProdLDAServer
    from master.strategies import make_strategy

    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 10, "privacy": privacy,
                        "model": {"family": "prodlda", "n_topics": 3, "vocab_size": 50,
                                  "min_df": 1, "mode": mode}}, "<test>")
    server = ProdLDAServer(cfg, make_strategy(strategy))
    server.setup({w: {"vocabulary": {f"word{j}": [3, 2] for j in range(i, i + 30)},
                      "n_docs": 5} for i, w in enumerate(["w1", "w2"])})
    return server


def test_an_aggregate_refused_mid_step_leaves_the_family_as_it_was() -> None:
    """A refused aggregate is undone through the family's savepoint: a synchronized step's
    last phase steps Adam, counts the step and clears the phase's statistics, and all of it
    comes back, so that the retry without the update left out can be made."""
    import copy

    import torch

    from common.models.ntm_sync_bn import N_PHASES
    from master.strategies import ClientResult

    server = _small_sync_prodlda_master()
    rng = np.random.default_rng(0)

    def uploads(phase: int) -> list[ClientResult]:
        expected = server.reducer_.expected_upload(phase)
        return [ClientResult(w, {n: np.abs(rng.standard_normal(shape)).astype(dtype) + 1
                                 for n, (shape, dtype) in expected.items()}, 4)
                for w in ("w1", "w2")]

    for phase in range(N_PHASES):  # a first step: Adam holds moments of every parameter
        server.aggregate(phase + 1, uploads(phase))
    for phase in range(N_PHASES - 1):
        server.aggregate(N_PHASES + phase + 1, uploads(phase))
    grads = uploads(N_PHASES - 1)
    weights = server.model_.get_arrays()
    adam = copy.deepcopy(server.model_.optimizer_.state_dict())
    back = server.savepoint()
    first = server.aggregate(2 * N_PHASES, grads).arrays
    assert server.steps_ == 2 and server.phase_ == 0 and server.reducer_.enc_ is None
    back()
    assert server.steps_ == 1 and server.phase_ == N_PHASES - 1
    assert all(np.array_equal(a, weights[n]) for n, a in server.model_.get_arrays().items())
    assert all(torch.equal(server.model_.optimizer_.state_dict()["state"][i][k], v)
               for i, st in adam["state"].items() for k, v in st.items())
    again = server.aggregate(2 * N_PHASES, grads).arrays  # made again, the same
    assert all(np.array_equal(again[n], first[n]) for n in first)


def _round_open(master: Master) -> tuple[int, int, dict[str, np.ndarray]]:
    """The open round's number, the model version and the model it was sent (read in-process:
    the attacks below need no subscription)."""
    wait_for(lambda: master.open is not None, 20, "a round to open")
    rnd = master.open
    assert rnd is not None
    return rnd.number, master.version, {
        n: np.array(a) for n, a in master.family.payload_for("w1").arrays.items()}


@pytest.mark.parametrize("silent_in, excluded", [(2, True), (1, False)])
def test_a_member_silent_two_rounds_in_three_is_excluded_one_in_three_is_not(
        tmp_path: Path, make_config: MakeConfig, silent_in: int, excluded: bool) -> None:
    """w1, alive, answered every third round only: each answer forgave all its silence, and
    every other round waited its whole deadline for it, the whole job long. A silent round is
    now forgiven only after SILENCE_FORGIVEN_AFTER_ROUNDS answered; a member silent one round
    in three (slow, jittery) is never excluded."""
    # (a deadline of 1 s closed a round on w2 and w3 before w1's update, sent after theirs,
    # came in, on a loaded machine: silent where it had spoken)
    config = _config(make_config, tmp_path, rounds=15, min_workers=2, round_deadline=2.5,
                     heartbeat_timeout=120)
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2", "w3")}
        for w, h in clients.items():
            assert h.code("register", {"worker_id": w, "n_samples": 100, "device": "cpu",
                                       "info": HONEST_INFO}) == "welcome"
        answered: list[int] = []
        while len(answered) < 15:
            rnd, version, model = _round_open(master)
            up = {"round": rnd, "version": version, "n_samples": 100, "metrics": {}}
            w1_speaks = (rnd % 3 == 0) if silent_in == 2 else (rnd % 3 != 0)
            speakers = ["w2", "w3"] + (["w1"] if w1_speaks and "w1" not in
                                       master.excluded else [])
            for w in speakers:
                assert clients[w].code("update", {**up, "worker_id": w}, model) == "ack"
            answered.append(rnd)
            wait_for(lambda r=rnd: master.phase != "training" or (
                master.open is not None and master.open.number > r), 20, "the round to close")
        if excluded:
            assert "forgiven" in master.excluded.get("w1", ""), master.excluded
            # silent in rounds 1, 2 (answered 3) and 4: excluded when round 4 closed
            assert master._silent["w1"] == 3 and answered[:4] == [1, 2, 3, 4]
        else:
            assert "w1" not in master.excluded, master.excluded
        assert {"w2", "w3"}.isdisjoint(master.excluded)


def test_a_member_alive_that_never_uploads_cannot_hold_a_round_for_ever(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """w1 of two (min_workers 2) registered and stayed alive but sent nothing: the round
    needed its update, never closed, and so never counted its silence; the master waited
    for ever. Each deadline past the round's now counts it silent; at ABSTAIN_LIMIT it is
    excluded and the job ends, saying why."""
    config = _config(make_config, tmp_path, rounds=3, min_workers=2, workers=2,
                     round_deadline=1, heartbeat_timeout=120)
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2")}
        for w, h in clients.items():
            assert h.code("register", {"worker_id": w, "n_samples": 100, "device": "cpu",
                                       "info": HONEST_INFO}) == "welcome"
        rnd, version, model = _round_open(master)
        assert clients["w2"].code("update", {"round": rnd, "version": version,
                                             "n_samples": 100, "metrics": {},
                                             "worker_id": "w2"}, model) == "ack"
        wait_for(lambda: master.phase == "done", 30, "the job to end")
        assert "w1" in master.excluded and "ABSTAIN_LIMIT" in master.excluded["w1"]
        assert master.summary["failed"] == "1 worker(s) left after excluding w1, min_workers is 2"


def test_one_of_two_members_cannot_saturate_fedadams_moments(tmp_path: Path,
                                                             make_config: MakeConfig) -> None:
    """w1 of two sent, once, the model plus 1e16 in every value (finite, and its squares
    within float64): FedAdam's step is bounded by its learning rate, so the aggregate passed
    the growth check, and the second moment then held w1's change for thousands of rounds:
    every later step went where w1 chose. With two updates the round's median says nothing;
    the aggregated rounds before it do."""
    config = _config(make_config, tmp_path, rounds=3, min_workers=2, workers=2,
                     strategy="fedadam")
    rng = np.random.default_rng(0)
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2")}
        for w, h in clients.items():
            assert h.code("register", {"worker_id": w, "n_samples": 100, "device": "cpu",
                                       "info": HONEST_INFO}) == "welcome"
        for _ in range(3):
            rnd, version, model = _round_open(master)
            up = {"round": rnd, "version": version, "n_samples": 100, "metrics": {}}
            for w in clients:
                step = 1e16 if (w, rnd) == ("w1", 2) else 0.01
                sent = {n: (a + step * rng.standard_normal(a.shape)).astype(a.dtype)
                        for n, a in model.items()}
                assert clients[w].code("update", {**up, "worker_id": w}, sent) == "ack"
            wait_for(lambda r=rnd: master.open is None or master.open.number > r, 20,
                     "the round to close")
        state = master.family.strategy.state()
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    left = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"left_out"' in line]
    assert [(e["round"], e["worker"]) for e in left] == [(2, "w1")], left
    assert "too few updates" in left[0]["reason"]
    second = [v for k, v in state.items() if k.startswith("v/")]  # FedAdam's second moment
    assert second and max(float(np.abs(v).max()) for v in second) < 1.0, list(state)


def test_one_of_two_members_cannot_shrink_the_model_out_of_reach(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """w1 of two, weighing 10,000 x w2, sent the model times 1e-8 once: the model published
    was that small, and every honest aggregate after it was past 100 x it: refused, round
    after round, for the rest of the job."""
    config = _config(make_config, tmp_path, rounds=4, min_workers=2, workers=2)
    rng = np.random.default_rng(0)
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2")}
        for w, n in (("w1", 1_000_000), ("w2", 100)):
            assert clients[w].code("register", {"worker_id": w, "n_samples": n,
                                                "device": "cpu", "info": HONEST_INFO}
                                   ) == "welcome"
        versions = []
        for _ in range(4):
            rnd, version, model = _round_open(master)
            versions.append(version)
            for w, n in (("w1", 1_000_000), ("w2", 100)):
                sent = ({k: a * np.float32(1e-8) for k, a in model.items()}
                        if (w, rnd) == ("w1", 2) else
                        {k: (a + 0.01 * rng.standard_normal(a.shape)).astype(a.dtype)
                         for k, a in model.items()})
                up = {"round": rnd, "version": version, "n_samples": n, "metrics": {},
                      "worker_id": w}
                assert clients[w].code("update", up, sent) == "ack"
            wait_for(lambda r=rnd: master.open is None or master.open.number > r, 20,
                     "the round to close")
        final = {k: np.array(a) for k, a in master.family.global_.arrays.items()}
    assert versions == [0, 1, 2, 3], versions  # every round published a model
    assert screening.norm(final) > 0.1 * screening.norm(model), "the model was shrunk"


def test_a_members_metric_names_and_text_arrays_cannot_stop_the_master(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """A metric named ``self`` once clashed with the log writer's own argument: its thread died
    and the master waited for it for ever at the end. A text array once reached the
    screening's arithmetic and killed the master. Both are now harmless: the metric is logged,
    the array refused as not numbers. A loss past MAX_METRIC (an honest one, on a model another
    member blew up) once cost its worker its update, then its place: the number alone is left
    out."""
    config = _config(make_config, tmp_path, rounds=2, min_workers=3)
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2", "w3")}
        for w, h in clients.items():
            assert h.code("register", {"worker_id": w, "n_samples": 100, "device": "cpu",
                                       "info": HONEST_INFO}) == "welcome"
        for _ in range(2):
            rnd, version, model = _round_open(master)
            up = {"round": rnd, "version": version, "n_samples": 100}
            assert clients["w2"].code("update", {**up, "worker_id": "w2", "metrics": {}},
                                      {"abstain": np.array(["abc"])}) == "dtype"
            for w in clients:
                metrics = {"w1": {"self": 1.0, "train_time": 0.1},
                           "w2": {"macro_f1": 1e11, "train_time": 0.3},
                           "w3": {"loss": 10 * C.MAX_METRIC, "train_time": 0.2}}.get(w, {})
                assert clients[w].code("update", {**up, "worker_id": w, "metrics": metrics},
                                       model) == "ack"
            wait_for(lambda r=rnd: master.open is None or master.open.number > r, 20,
                     "the round to close")
        wait_for(lambda: master.phase == "reporting", 20, "the reporting phase")
        flush = threading.Thread(target=master._checkpoints.flush, daemon=True)
        flush.start()
        flush.join(timeout=10)
        assert not flush.is_alive(), "the log writer died: flush() waits for ever"
        assert thread.is_alive()
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["self"] for e in logged if e["event"] == "worker_round" and e["worker"] == "w1"
            ] == [1.0, 1.0]
    w3 = [e for e in logged if e["event"] == "worker_round" and e["worker"] == "w3"]
    assert [e["train_time"] for e in w3] == [0.2, 0.2] and not any("loss" in e for e in w3)
    assert "w3" not in master.excluded
    # An F1 of 1e11 was the round's "global macro-F1" in the log and every curve's scale.
    w2 = [e for e in logged if e["event"] == "worker_round" and e["worker"] == "w2"]
    assert [e["train_time"] for e in w2] == [0.3, 0.3] and not any("macro_f1" in e for e in w2)
    assert all(e.get("mean_macro_f1") is None for e in logged if e["event"] == "round")


def test_a_poisoned_scaffold_control_change_is_left_out(tmp_path: Path,
                                                       make_config: MakeConfig) -> None:
    """SCAFFOLD's control changes build the state the master keeps and sends to everyone: one
    member's, at float32's largest, is screened out by its norm as a model update would be,
    and the control variate stays finite."""
    from common.constants import SCAFFOLD_CHANGE

    config = _config(make_config, tmp_path, rounds=2, min_workers=3, strategy="scaffold")
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2", "w3")}
        for w, h in clients.items():
            assert h.code("register", {"worker_id": w, "n_samples": 100, "device": "cpu",
                                       "info": HONEST_INFO}) == "welcome"
        rnd, version, model = _round_open(master)
        for i, (w, h) in enumerate(clients.items()):
            fill = np.finfo(np.float32).max if w == "w1" else 1e-3 * (i + 1)
            dc = {SCAFFOLD_CHANGE + n: np.full(a.shape, fill, np.float32)
                  for n, a in model.items()}
            assert h.code("update", {"worker_id": w, "round": rnd, "version": version,
                                     "n_samples": 100, "metrics": {}},
                          {**model, **dc}) == "ack"
        wait_for(lambda: master.open is None or master.open.number > rnd, 20,
                 "the round to close")
        assert thread.is_alive()
        control = master.family.strategy.control_
        assert control and all(np.abs(c).max() < 1 for c in control.values())
        assert master.refused["w1"]["outlier"] == 1 and not master.refused["w2"]["outlier"]


def test_sync_batch_norm_uploads_are_checked_for_their_form() -> None:
    """An abstention is an empty float array, as workers send it; a sum of squares is never
    negative (a negative one made the published variance negative and every honest worker's
    next upload NaN)."""
    from common.models.ntm_sync_bn import ABSTAIN, N_PHASES
    from common.net.wire import ProtocolError

    server = _small_sync_prodlda_master()
    server.check_update({ABSTAIN: np.zeros(0)})
    for bad in (np.array(["abc"]), np.zeros(3), np.zeros(0, np.int64)):
        with pytest.raises(ProtocolError):
            server.check_update({ABSTAIN: bad})
    checked = 0
    for phase in range(N_PHASES):
        server.phase_ = phase
        expected = server.reducer_.expected_upload(phase)
        good = {n: np.ones(shape, dtype) for n, (shape, dtype) in expected.items()}
        server.check_update(good)
        if "m2" in good:
            with pytest.raises(ProtocolError, match="negative"):
                server.check_update({**good, "m2": -good["m2"]})
            checked += 1
    assert checked


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam"])
def test_a_negative_running_variance_is_refused_and_never_published(strategy: str) -> None:
    """A running variance below zero passed every check of averaged weights, and the model it
    was averaged into gave NaN on every honest worker that evaluated it. Refused in an upload;
    and a server optimizer that steps past zero publishes zero."""
    from common.net.wire import ProtocolError
    from master.families.ntm import RUNNING_VAR
    from master.strategies import ClientResult

    server = _small_sync_prodlda_master(mode="fedavg", strategy=strategy)
    model = server.global_.arrays
    variances = [n for n in model if n.endswith(RUNNING_VAR)]
    assert variances
    server.check_update(model)
    for name in variances:
        with pytest.raises(ProtocolError, match="a variance"):
            server.check_update({**model, name: np.full_like(model[name], -5.0)})
    # Honest updates that shrink the variance a lot: FedAdam's step went past zero in the
    # sixth round, and every worker's evaluation gave NaN.
    for _ in range(10):
        low = {n: (np.full_like(a, 1e-6) if n.endswith(RUNNING_VAR) else a)
               for n, a in server.global_.arrays.items()}
        out = server.aggregate(1, [ClientResult("w1", low, 5), ClientResult("w2", low, 5)])
        assert all((out.arrays[n] >= 0).all() for n in variances)


def test_a_secure_sums_rounding_below_zero_of_a_variance_is_not_refused() -> None:
    """A 16-bit ring (float16 or int8 compression) rounds by about 4e-4 at clip 8: honest
    variances of 1e-5 averaged to -1.7e-4, and the whole sum was refused as holding a negative
    variance (five in a row end the job)."""
    from common.secagg.ring import dequantize_sum, levels, quantize, to_vector
    from master.families.ntm import RUNNING_VAR

    server = _small_sync_prodlda_master(mode="fedavg",
                                        secure_aggregation={"threshold": 2, "clip": 8.0})
    base = {n: (np.full_like(a, 2e-4) if n.endswith(RUNNING_VAR) else a)
            for n, a in server.global_.arrays.items()}
    server.global_ = type(server.global_)(server.global_.meta, base)
    honest = {n: (np.full_like(a, 1e-5) if n.endswith(RUNNING_VAR) else a)
              for n, a in base.items()}
    L = levels(3, 16)
    ring = sum(quantize(to_vector(honest, base, 1.0, clip=8.0)[0], 8.0, L, 16)
               for _ in range(3))
    out = server.secure_result(dequantize_sum(ring, 3, 8.0, L), n_max=5, members=3)
    server.check_update(out)  # refused before: "holds negative values"
    assert all((out[n] >= 0).all() for n in out if n.endswith(RUNNING_VAR))


def test_fstc_start_counts_past_the_registered_documents_are_refused(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """The k-FED start weighs each worker's centres by its counts: a worker of 100 documents
    claiming 3,000 would pull the start onto its own centres."""
    config = _config(make_config, tmp_path, model={"family": "fstc", "n_clusters": 3})
    with _serving(config) as (master, thread, client):
        h = client("w1")
        reg = {"worker_id": "w1", "n_samples": 100, "device": "cpu"}
        centers = np.random.default_rng(0).normal(size=(3, 384)).tolist()
        info = {"n_clusters": 3, "dim": 384, "centers": centers}
        reply = h.request("register", {**reg, "info": {**info, "counts": [1000] * 3}})
        assert reply is not None and reply["body"]["code"] == "bad_field", reply
        assert "register.info.counts: 3000 documents" in reply["body"]["message"]
        assert h.code("register", {**reg, "info": {**info, "counts": [40, 30, 30]}}
                      ) == "welcome" and thread.is_alive()


def test_fstc_counts_weigh_no_more_than_their_capped_samples() -> None:
    """Eq. 16 weighs each centre by its count: counts past a result's n_samples (lowered by
    max_weight_fraction, or inflated at registration) are scaled down to it, so that the weight
    caps hold for FSTC's centres too."""
    from common.config import parse_config
    from master.families.fstc import FSTCServer
    from master.strategies import ClientResult, make_strategy

    k, dim = 3, 4
    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 3,
                        "model": {"family": "fstc", "n_clusters": k}}, "<test>")
    rng = np.random.default_rng(1)
    info = {"n_clusters": k, "dim": dim, "centers": rng.normal(size=(k, dim)).tolist(),
            "counts": [5, 5, 5]}

    def centres(counts: float) -> np.ndarray:
        server = FSTCServer(cfg, make_strategy("fedavg"))
        first = server.setup({"w1": info, "w2": info})
        honest = {"centers": first.arrays["centers"], "counts": np.full(k, 5, np.float32)}
        far = {"centers": first.arrays["centers"] + 10, "counts": np.full(k, counts,
                                                                         np.float32)}
        return server.aggregate(1, [ClientResult("w1", honest, 15),
                                    ClientResult("w2", far, 15)]).arrays["centers"]

    assert np.allclose(centres(1000), centres(5))  # as if it had claimed its 15 documents


def test_fstc_takes_numbers_for_centres_and_the_model_only_in_the_final_round() -> None:
    """Bytes in a registration's centres (numpy reads b"1" as 1.0) are refused: they would
    stop every later checkpoint, which writes registrations as JSON. A head sent before the
    final round would be published as the global head. In the final round, a member's encoder
    arrays must be the encoder's own, names and shapes."""
    from common.config import parse_config
    from common.net.wire import ProtocolError
    from master.families.fstc import FSTCServer
    from master.strategies import ClientResult, make_strategy

    k, dim = 3, 4
    cfg = parse_config({"workers": ["w1", "w2", "w3"], "rounds": 2,
                        "model": {"family": "fstc", "n_clusters": k, "encoder": "finetune"}},
                       "<test>")
    server = FSTCServer(cfg, make_strategy("fedavg"))
    rng = np.random.default_rng(0)
    info = {"n_clusters": k, "dim": dim, "centers": rng.normal(size=(k, dim)).tolist(),
            "counts": [5, 5, 5]}
    server.check_info(info)
    with pytest.raises(ProtocolError, match="centers"):
        server.check_info({**info, "centers": [[b"1", 2.5, 0.0, 0.0], *info["centers"][1:]]})
    first = server.setup({w: info for w in ("w1", "w2", "w3")})
    assert not first.meta["final"]
    up = {"centers": first.arrays["centers"], "counts": np.full(k, 5, np.float32)}
    server.check_update(up)
    server.check_claims(up, 15)
    # Counts past the update's documents: each centre is weighed by its count (eq. 16).
    with pytest.raises(ProtocolError, match="counts sum to 3000, more than the update's 15"):
        server.check_claims({**up, "counts": np.full(k, 1000, np.float32)}, 15)
    head = {n: a for n, a in first.arrays.items() if n.startswith("head.")}
    with pytest.raises(ProtocolError, match="final round"):
        server.check_update({**up, **head})
    final = server.aggregate(1, [ClientResult(w, up, 15) for w in ("w1", "w2", "w3")])
    assert final.meta["final"]
    with pytest.raises(ProtocolError, match="final round"):
        server.check_update(up)  # the model must come now
    # The encoder's own arrays, exactly (here a stand-in form: test_fstc checks the real
    # one against a fine-tuned clusterer's): a member's odd arrays are refused at receipt, so
    # no count of forms decides the average (with two members a tie went to the lower id).
    server._encoder_shapes = {"encoder.layer.weight": (2, 2)}
    encoder = {"encoder.layer.weight": np.ones((2, 2), np.float32)}
    for odd in ({"encoder.other.weight": np.full((3, 3), 1e-3, np.float32)},
                {"encoder.layer.weight": np.ones((2, 3), np.float32)},
                {**encoder, "encoder.extra": np.ones(1, np.float32)}, {}):
        with pytest.raises(ProtocolError, match="the encoder's arrays are not the model's"):
            server.check_update({**up, **head, **odd})
    results = [ClientResult(w, {**up, **head, **encoder}, 15) for w in ("w2", "w3")]
    for r in results:
        server.check_update(r.arrays)
    model = server.aggregate(2, results).arrays
    np.testing.assert_array_equal(model["encoder.layer.weight"], encoder["encoder.layer.weight"])


def test_fstc_centres_and_head_far_off_are_refused_or_not_published() -> None:
    """An FSTC update's centres past MAX_COORDINATE are refused at receipt; under it, centres
    or a final head that grow the published ones past the growth limit are not published
    (the family raises, the master leaves out the update furthest out), while honest ones
    are."""
    from master.families.fstc import MAX_COORDINATE
    from master.strategies import ClientResult

    k, dim = 3, 4
    server, first = _fstc_server(k, dim)
    rng = np.random.default_rng(1)
    up = {"centers": first.arrays["centers"], "counts": np.full(k, 5, np.float32)}
    with pytest.raises(ProtocolError, match="centers: a coordinate past"):
        server.check_update({**up, "centers": np.full((k, dim), 2 * MAX_COORDINATE,
                                                      np.float32)})
    far = {**up, "centers": np.full((k, dim), 1e5, np.float32)}
    server.check_update(far)  # under the bound: for the growth check
    with pytest.raises(ValueError, match="the centres: .* over 100 times"):
        server.aggregate(1, [ClientResult("w1", far, 15), ClientResult("w2", up, 15)])
    final = server.aggregate(1, [ClientResult("w2", up, 15)])
    assert final.meta["final"]
    head = {n: a for n, a in first.arrays.items() if n.startswith("head.")}
    trained = {n: a + rng.normal(size=a.shape).astype(np.float32) for n, a in head.items()}
    far_head = {"head.weight": np.full((k, dim), 1e5, np.float32),
                "head.bias": np.full(k, -1e5, np.float32)}
    with pytest.raises(ValueError, match="the head: .* over 100 times"):
        server.aggregate(2, [ClientResult("w1", {**up, **far_head}, 15),
                             ClientResult("w2", {**up, **trained}, 15)])
    model = server.aggregate(2, [ClientResult("w2", {**up, **trained}, 15)]).arrays
    np.testing.assert_allclose(model["head.weight"], trained["head.weight"])


def test_an_honest_fstc_head_at_a_high_temperature_is_published() -> None:
    """The final head was held to 100 times the nearest-centre head of the last centres,
    whose scale is 1/temperature: at temperature 20 (lr_head 1e-2, 20 rounds) an honestly
    trained head of norm 14.8 against a start of 0.086 was refused. A head is now refused
    only past both that and what its Adam steps at lr_head could reach."""
    from common.config import parse_config
    from master.families.fstc import FSTCServer
    from master.strategies import ClientResult, make_strategy

    k, dim, rounds = 4, 32, 20
    cfg = parse_config({"workers": ["w1"], "rounds": rounds,
                        "model": {"family": "fstc", "n_clusters": k, "temperature": 20.0,
                                  "lr_head": 1e-2, "iterations": 50}}, "<test>")
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(k, dim))
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    server = FSTCServer(cfg, make_strategy("fedavg"))
    server.setup({"w1": {"n_clusters": k, "dim": dim, "centers": centers.tolist(),
                         "counts": [150] * k}})
    up = {"centers": server.global_.arrays["centers"], "counts": np.full(k, 150, np.float32)}
    for r in range(1, rounds - 1):
        server.aggregate(r, [ClientResult("w1", up, 600)])
    trained = {"head.weight": (rng.normal(size=(k, dim)) * 1.3).astype(np.float32),
               "head.bias": rng.normal(size=k).astype(np.float32)}  # norm about 15
    back = server.savepoint()
    server.aggregate(rounds, [ClientResult("w1", {**up, **trained}, 600)])
    back()
    far = {"head.weight": np.full((k, dim), 1e5, np.float32),
           "head.bias": np.full(k, -1e5, np.float32)}
    with pytest.raises(ValueError, match="the head: .* past the .* Adam steps"):
        server.aggregate(rounds, [ClientResult("w1", {**up, **far}, 600)])


def test_a_forged_fstc_secure_input_cannot_move_a_centre_past_the_clip() -> None:
    """Under secure aggregation the master sees only the sum: a member's centres at the clip
    weighed as one document each moved a centre by about clip × n_max once divided by the
    counts. Every honest centre (and head value) is a weighted mean of clipped values, so
    one past the clip is refused as forged; honest sums are read as before."""
    from common.models.fstc import centers_as_sum, centers_from_sum

    k, dim, n_max, clip = 3, 4, 1000, 8.0
    rng = np.random.default_rng(0)
    members = [{"centers": rng.normal(size=(k, dim)).astype(np.float32) / 4,
                "counts": np.array([300, 200, 100], np.float32)} for _ in range(2)]
    vectors = [centers_as_sum(m, 600, n_max, clip)[0] for m in members]
    previous = np.zeros((k, dim), np.float32)
    honest = centers_from_sum(sum(vectors), k, dim, False, n_max, previous, clip)
    expected = sum(m["centers"] * m["counts"][:, None] for m in members) / 2 / np.array(
        [300, 200, 100])[:, None]
    np.testing.assert_allclose(honest["centers"], expected, rtol=1e-5)
    forged = np.zeros_like(vectors[0])
    forged[:k * dim] = clip
    forged[k * dim:k * dim + k] = clip / n_max
    with pytest.raises(ValueError, match="past the clip 8, .* a secure input was forged"):
        centers_from_sum(vectors[0] + forged, k, dim, False, n_max, previous, clip)


def test_registering_again_and_again_cannot_hold_a_secure_round_open(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """Each registration during a secure round begins it again with a new deadline (the
    worker's secrets died with its old process); past the round's last attempt the member is
    excluded instead, and the round goes on without it. From the same process (its secrets
    still there) each one is a strike for the whole job, not the round: a member that held
    attempts 1 and 2 of every round and re-registered (80 s a round at a 10 s deadline) was
    never counted; at ABSTAIN_LIMIT it is excluded."""
    from common.constants import SECAGG_MAX_ATTEMPTS

    config = _config(make_config, tmp_path, rounds=2, min_workers=2,
                     privacy={"secure_aggregation": {"threshold": 2}})
    with _serving(config) as (master, thread, client):
        clients = {w: client(w) for w in ("w1", "w2", "w3")}
        reg = {"n_samples": 100, "device": "cpu", "info": HONEST_INFO}
        for w, h in clients.items():
            assert h.code("register", {"worker_id": w, **reg}) == "welcome"
        wait_for(lambda: master.secure is not None, 20, "the secure round")
        codes = [clients["w1"].code("register", {"worker_id": "w1", **reg})
                 for _ in range(SECAGG_MAX_ATTEMPTS)]
        assert codes == ["welcome"] * (SECAGG_MAX_ATTEMPTS - 1) + ["excluded"], codes
        assert master.secure is not None and master.secure.attempt == SECAGG_MAX_ATTEMPTS
        assert "w1" in master.excluded and "restart" in master.excluded["w1"]
        assert master._secure_rejoins["w1"] == C.ABSTAIN_LIMIT  # (no process id: the same)
        assert clients["w1"].code("ping", {"worker_id": "w1"}) == "excluded"
        assert thread.is_alive()


@pytest.mark.parametrize("process", ["the same", "a new one each time"])
def test_registrations_repeated_at_the_request_rate_do_not_fill_the_log(
        tmp_path: Path, make_config: MakeConfig, caplog: pytest.LogCaptureFixture,
        process: str) -> None:
    """A small registration passes the rate limit as any request does: repeated within
    REREGISTER_QUIET_S it says nothing new and writes neither a log line nor an event; nor,
    past REGISTER_LOG_LIMIT a minute, does one that names a new process every time (which
    wrote a warning, a line and an event for each: 2.6 MB of log in 10 s)."""
    config = _config(make_config, tmp_path, rounds=2)
    caplog.set_level(logging.INFO, logger="fedctl.master")
    with _serving(config) as (master, thread, client):
        h = client("w1")
        reg = {"worker_id": "w1", "n_samples": 100, "device": "cpu", "info": HONEST_INFO}
        codes = {h.code("register", {**reg, "process": f"p{i}" if process != "the same"
                                     else "p"}) for i in range(200)}
        assert codes == {"welcome"} and thread.is_alive()
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([e for e in logged if e["event"] == "register"]) <= C.REGISTER_LOG_LIMIT
    about_w1 = [r for r in caplog.records if "w1" in r.getMessage()]
    # A line and a warning for each logged one, the warning past the limit, and a refusal or
    # two of the rate limit's: a few, not the 400 lines of 200 registrations.
    assert len(about_w1) <= 2 * C.REGISTER_LOG_LIMIT + 4, [r.getMessage() for r in about_w1]


def test_final_reports_come_after_training_and_a_few_each(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """A report was taken in any phase and any number of times, each appended to
    reports.jsonl and logged: one member sent 11,000 in 20 s (114 MB). Now none is kept before
    the last round, a resent one is not kept twice, and at most MAX_REPORTS_PER_WORKER differ;
    the rest are acknowledged unkept (a refusal made an honest worker's run fail)."""
    config = _config(make_config, tmp_path, rounds=2)
    report = {"federated": {"macro_f1": 0.5}, "n_train": 100, "n_test": 10, "version": 1}
    with _serving(config) as (master, thread, client):
        h = client("w1")
        for w in ("w1", "w2"):  # w2's report, never sent, keeps the master waiting for it
            reg = {"worker_id": w, "n_samples": 100, "device": "cpu", "info": HONEST_INFO}
            assert client(w).code("register", reg) == "welcome"
        assert h.code("report", {"worker_id": "w1", "report": report}) == "ack"  # not kept
        # As after the last round (set from here: the job's only reader is that thread).
        master._report_deadline = time.monotonic() + 60
        master.phase = "reporting"
        codes = [h.code("report", {"worker_id": "w1", "report": report}) for _ in range(3)]
        codes += [h.code("report", {"worker_id": "w1", "report": {
            **report, "n_test": i}}) for i in range(5)]
        assert codes == ["ack"] * 8, codes  # acknowledged, kept or not: honest ones go on
        assert thread.is_alive()
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    kept = (out / C.REPORTS_FILE).read_text().splitlines()
    assert len(kept) == C.MAX_REPORTS_PER_WORKER, kept


def test_a_class_only_one_member_brought_does_not_break_the_baselines(
        tmp_path: Path, make_config: MakeConfig) -> None:
    """A member that registered one class more than the data holds made the agreed model one
    output wider than the simulation's baselines, and the master died at the end of the run
    (state_dict size mismatch), with no table and no summary."""
    from master.baselines import mlp_baselines
    from master.families import make_server_family

    cfg = load_config(_config(make_config, tmp_path, rounds=1))
    family = make_server_family(cfg)
    honest = {"input_dim": 384, "classes": local_data(cfg, "w2").classes}
    family.setup({"w1": {**honest, "classes": [*honest["classes"], "zzz"]},
                  "w2": honest, "w3": honest})
    assert len(family.setup_info_["classes"]) == len(honest["classes"]) + 1
    sim = mlp_baselines(family)
    assert sim is not None and set(sim["centralized"]) == {"w1", "w2", "w3"}
    assert all(math.isfinite(v) for s in sim["pooled"].values() for v in s.values())


def test_registration_text_that_would_reach_terminals_or_trackers_is_refused() -> None:
    """Vocabulary words with escapes or line breaks reached `fedctl topics` (a cleared screen,
    forged topic lines); a metric name MLflow refuses ('a!b') stopped the run's tracking;
    an FSTC k-FED centre of 1e100 (finite in float64) overflowed float32 and the master
    published Inf to everyone."""
    from common.config import parse_config
    from common.net.messages import check_metrics
    from master.families.fstc import FSTCServer
    from master.families.vocabulary import check_vocabulary_info
    from master.strategies import make_strategy

    for word in ("\x1b[2Jclear", "fake\ntopic 99: injected", "two words", "\x07bell"):
        with pytest.raises(ProtocolError, match="printable"):
            check_vocabulary_info({"n_docs": 10, "vocabulary": {word: [1, 1]}})
    check_vocabulary_info({"n_docs": 10, "vocabulary": {"économie": [2, 1]}})
    for name in ("a!b", "w1/..", "a//b", "/x", "x" * 65):
        with pytest.raises(ProtocolError, match="metric names"):
            check_metrics({name: 1.0}, "update.metrics")
    check_metrics({"train_loss": 1.0, "val/loss": 1.0, "top-5 acc": 1.0, "f1:macro": 1.0,
                   "précision": 1.0}, "update.metrics")
    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 3,
                        "model": {"family": "fstc", "n_clusters": 2}}, "<test>")
    server = FSTCServer(cfg, make_strategy("fedavg"))
    with pytest.raises(ProtocolError, match="coordinate"):
        server.check_info({"n_clusters": 2, "dim": 3, "centers": [[1e100, 0.0, 0.0]],
                           "counts": [1]})


def test_a_cluster_without_a_worker_list_admits_a_bounded_number_of_names(
        tmp_path: Path, make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """With security none and no worker list any peer may register, and one that made up a
    new name at every request grew the master's roster without bound: past
    MAX_UNLISTED_WORKERS a new name is refused (`too_large`), the admitted ones go on."""
    monkeypatch.setattr(C, "MAX_UNLISTED_WORKERS", 2)
    config = make_config(tmp_path, workers=[], min_workers=5, security={"mode": "none"})
    master, thread = _in_process_master(config)
    rep = f"tcp://127.0.0.1:{yaml.safe_load(config.read_text())['master']['rep_port']}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.linger = 0
    sock.sndtimeo = 10_000  # (a failed handshake leaves no pipe)
    sock.connect(rep)

    def code(worker_id: str) -> str:
        sock.send_multipart(frames("register", {"worker_id": worker_id, "n_samples": 100,
                                                "device": "cpu", "info": HONEST_INFO}))
        assert sock.poll(10_000, zmq.POLLIN), "no reply"
        header = msgpack.unpackb(sock.recv_multipart()[1])
        return header["body"]["code"] if header["kind"] == "error" else header["kind"]

    try:
        assert [code(w) for w in ("a", "b", "c", "a", "d")] == [
            "welcome", "welcome", "too_large", "welcome", "too_large"]
        assert sorted(master.workers) == ["a", "b"] and thread.is_alive()
    finally:
        master.phase = "done"
        thread.join(timeout=5)
        master.close()
        ctx.destroy(linger=0)
