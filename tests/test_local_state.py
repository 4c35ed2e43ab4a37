"""Every family's worker state survives a trip through a snapshot file (``common.state``).

In one process, on the bundled data: a worker trains two rounds; a second worker of the same
id, set up afresh and loaded from the snapshot taken after round one (written to disk and read
back), trains round two again. Their uploads must be equal bit for bit: a snapshot that missed
anything the next round reads (a generator, an optimizer's moments, a mini-batch position)
fails here before it fails in a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.config import parse_config
from common.data.shards import local_data, worker_seed
from common.state import load, save
from master.families import make_server_family
from tests.conftest import config_dict
from worker.families import make_client_family

MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"family": "mlp", "local_epochs": 2, "hidden": 32},
    "nmf": {"family": "nmf", "n_topics": 6, "mi_weight": 0.1, "vocab_size": 300},
    "nmf_local_critic": {"family": "nmf", "n_topics": 6, "mi_weight": 0.1, "vocab_size": 300,
                         "critic_aggregation": "local"},
    "prodlda_sync": {"family": "prodlda", "mode": "sync", "n_topics": 6, "vocab_size": 300,
                     "batch_size": 32, "sync_batch_norm": False},
    "prodlda_fedavg": {"family": "prodlda", "mode": "fedavg", "n_topics": 6,
                       "vocab_size": 300, "batch_size": 32},
    "fstc": {"family": "fstc", "n_clusters": 4, "iterations": 20},
    "lda": {"family": "lda", "n_topics": 5, "sweeps": 3, "vocab_size": 300},
}


def _worker(cfg: Any, setup: dict[str, Any]) -> Any:
    seed = worker_seed(cfg, "w1")
    torch.manual_seed(seed)
    fam = make_client_family(cfg, local_data(cfg, "w1"), "cpu", seed)
    fam.setup(setup)
    return fam


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. torch sharing a read-only array
@pytest.mark.parametrize("name", list(MODELS))
def test_a_snapshot_replays_the_next_round_exactly(name: str, tmp_path: Path,
                                                   embed_cache: Path) -> None:
    raw = config_dict(tmp_path / "out", embed_cache, workers=2, rounds=4,
                      model=MODELS[name], data={"task": "multiclass"})
    cfg = parse_config(raw, source="<test>")
    server = make_server_family(cfg)
    regs = {}
    for wid in ("w1", "w2"):
        fam = make_client_family(cfg, local_data(cfg, wid), "cpu", worker_seed(cfg, wid))
        regs[wid] = fam.registration_info()
    payload = server.setup(regs)
    setup = server.setup_info_
    first = server.payload_for("w1")
    for array in first.arrays.values():  # as they come off the wire: views of the frames
        array.setflags(write=False)

    a = _worker(cfg, setup)  # scores each payload before training on it, as a worker does
    a.evaluate(first.meta, first.arrays)
    a.fit(1, first.meta, first.arrays)
    save(tmp_path / "after-1.safetensors",
         {"family": a.local_state(), "rng": torch.get_rng_state()})
    a.evaluate(first.meta, first.arrays)
    second = a.fit(2, first.meta, first.arrays)

    _, tree = load(tmp_path / "after-1.safetensors")
    b = _worker(cfg, setup)
    b.load_local_state(tree["family"])
    torch.set_rng_state(tree["rng"])
    b.evaluate(first.meta, first.arrays)
    again = b.fit(2, first.meta, first.arrays)

    assert payload is not None
    assert second.arrays.keys() == again.arrays.keys()
    for key, array in second.arrays.items():
        assert np.array_equal(array, again.arrays[key]), (
            f"{key}: max |diff| {np.abs(np.asarray(array) - again.arrays[key]).max()}")


def test_snapshots_write_over_the_files_they_no_longer_need(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from worker.snapshots import Snapshots

    snaps = Snapshots(tmp_path / "w1", "w1")
    assert not snaps.adopt("run-a")
    rng = np.random.default_rng(0)
    trees = {r: {"moments": rng.standard_normal(1000 + 100 * (r % 2)), "step": r,
                 "counts": torch.arange(r, dtype=torch.int64), "mask": np.ones(3, bool)}
             for r in range(1, 7)}  # odd rounds longer: a file written over must be cut short
    inodes = {}
    for r in range(1, 7):
        keep = r - 1 if r != 4 else 1  # a master whose checkpoint is round 1 asks for 1 back
        snaps.save(r, trees[r], keep=keep)
        inodes[r] = snaps._path(r).stat().st_ino
    # What a resumed master may ask for stays: the newest at or before keep, and after it.
    assert snaps.rounds() == [5, 6]
    # Each new round went into a file no longer wanted, which existed until then: round 1's
    # (the oldest unwanted) for 3, round 2's for 5, and for 6 the spare kept of round 3's.
    assert (inodes[3], inodes[5], inodes[6]) == (inodes[1], inodes[2], inodes[1])
    for r in (5, 6):
        back = snaps.load(r)
        assert back["step"] == r and np.array_equal(back["moments"], trees[r]["moments"])
        assert torch.equal(back["counts"], trees[r]["counts"]) and back["mask"].dtype == bool
    assert sorted(p.name for p in snaps.folder.iterdir()) == [
        ".spare-000004", "RUN", "round-000005.safetensors", "round-000006.safetensors"]
    assert len(load_file(str(snaps._path(6)))) == 3  # the safetensors layout, as its reader reads
    # A cut file is refused in one line; a write cut short by a kill leaves a temp file, which
    # the next registration removes.
    data = snaps._path(6).read_bytes()
    snaps._path(6).write_bytes(data[: len(data) - 8])
    with pytest.raises(ValueError, match="not a state file"):
        snaps.load(6)
    (snaps.folder / ".round-000007.safetensors.abc123.tmp").write_bytes(b"half")
    assert snaps.adopt("run-a")
    assert not list(snaps.folder.glob(".*"))  # neither temp nor spare files


def test_state_files_keep_shapes_and_byte_order_and_leak_nothing(tmp_path: Path) -> None:
    import os

    from common.atomic import atomic_write

    # 0-d arrays and tensors stay 0-d (an Adam step, a batch norm's count), big-endian input
    # comes back equal, a transposed tensor in its own order.
    tree = {"step": torch.tensor(7.0), "n": np.array(3, dtype=np.int64),
            "be": np.arange(5, dtype=">f8"), "t": torch.arange(6.0).reshape(2, 3).T}
    save(tmp_path / "s.safetensors", tree)
    _, back = load(tmp_path / "s.safetensors")
    assert back["step"].shape == () and back["n"].shape == () and int(back["n"]) == 3
    assert np.array_equal(back["be"], np.arange(5.0)) and torch.equal(back["t"], tree["t"])

    # A file to write over that cannot be taken (a folder) falls back to a new file and leaks
    # no descriptor; one that is the target itself is not taken, so a failed write keeps it.
    fds = len(os.listdir("/proc/self/fd"))
    (tmp_path / "folder").mkdir()
    for _ in range(5):
        atomic_write(tmp_path / "x.bin", lambda fh: fh.write(b"new"), reuse=tmp_path / "folder")
    assert (tmp_path / "x.bin").read_bytes() == b"new"
    assert len(os.listdir("/proc/self/fd")) == fds

    def fail(fh: Any) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "x.bin", fail, reuse=tmp_path / "x.bin")
    assert (tmp_path / "x.bin").read_bytes() == b"new"
    assert len(os.listdir("/proc/self/fd")) == fds
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "s.safetensors", "x.bin"]


def test_an_optimizer_copy_puts_adams_state_back_in_place() -> None:
    """The master's savepoint of a synchronized step (common/models/optim_copy.py): Adam's
    moments after two steps come back exactly, in the same tensors; a copy taken before the
    first step takes away the state that step created; the buffers are reused, not remade."""
    import torch

    from common.models.optim_copy import OptimizerCopy

    torch.manual_seed(0)
    # Several parameters of different shapes (with one, `p in [tensors]` never compared two).
    w, b, v = (torch.nn.Parameter(torch.randn(*s)) for s in ((5, 3), (3,), (2, 5)))
    opt = torch.optim.Adam([w, b, v], lr=0.1)
    kept = OptimizerCopy()

    def step() -> None:
        opt.zero_grad()
        ((w ** 2).sum() + b.sum() + (v ** 3).sum()).backward()
        opt.step()

    back = kept.take(opt)  # before the first step: no state yet
    step()
    assert opt.state[w]
    back()
    assert not opt.state

    step()
    step()
    want = {id(p): {k: t.clone() for k, t in opt.state[p].items()} for p in (w, b, v)}
    tensors = {id(p): dict(opt.state[p]) for p in (w, b, v)}
    back = kept.take(opt)
    buffers = {k: id(t) for k, t in kept._kept[id(w)].items()}
    step()
    assert not torch.equal(opt.state[w]["exp_avg"], want[id(w)]["exp_avg"])
    opt.state[b]["made_by_the_step"] = torch.zeros(1)
    back()
    for p in (w, b, v):
        assert set(opt.state[p]) == set(want[id(p)])
        for k, t in want[id(p)].items():
            assert torch.equal(opt.state[p][k], t), k
            assert opt.state[p][k] is tensors[id(p)][k], k  # back into the tensors Adam holds
    kept.take(opt)
    assert {k: id(t) for k, t in kept._kept[id(w)].items()} == buffers  # written over


def test_snapshots_behind_a_lagging_checkpoint_make_no_new_files(tmp_path: Path) -> None:
    """A master whose checkpoint lands every few rounds frees that many snapshots at once: all
    are kept as spares for the rounds until the next release (a new file costs several times
    one written over), and no more than those rounds need, so a one-off long lag is not kept."""
    from worker.snapshots import SPARES, Snapshots

    snaps = Snapshots(tmp_path / "w1", "w1")
    snaps.adopt("run-a")
    tree = {"moments": np.zeros(1000)}
    new_files = []

    def files() -> list[str]:
        return sorted(p.name for p in snaps.folder.iterdir() if p.name != "RUN")

    lag = 6
    for r in range(1, 61):
        before = set(files())
        snaps.save(r, tree, keep=lag * ((r - 1) // lag))  # the checkpoint: every 6th round
        new_files.append(not before - set(files()))  # no earlier file taken over
    assert not any(new_files[2 * lag:])  # once warm, every round is written over a spare
    assert len(files()) <= 2 * lag
    # A one-off lag of 30 rounds, then the usual 6 again: the extra spares go.
    for r in range(61, 91):
        snaps.save(r, tree, keep=60)
    for r in range(91, 116):
        snaps.save(r, tree, keep=lag * ((r - 1) // lag))
    # Round 115 freed 108 to 113: right after a release, spares for the next six rounds.
    assert snaps.rounds() == [114, 115]
    assert max(SPARES, lag - 1) <= len([n for n in files() if n.startswith(".spare-")]) <= lag


def test_a_runs_snapshots_are_found_in_its_history_whatever_the_workers_name(
        tmp_path: Path) -> None:
    """A worker started alone to resume a run finds that run's snapshots where they are in
    the history (its own runs/workers/<id>, or a run folder's), by the run's id; a name with
    glob's characters (allowed in worker names) matched other workers' folders, or none."""
    from worker.snapshots import RUN_FILE, find_run_snapshots

    runs = tmp_path / "runs"
    for place, run_id in ((runs / "20261128T000000Z-aaaaaa.failed" / "workers", "run1"),
                          (runs / "workers", "run2")):
        for name in ("w1", "w*", "node[1]"):
            (place / name).mkdir(parents=True)
            (place / name / RUN_FILE).write_text(run_id + "\n")
    failed = runs / "20261128T000000Z-aaaaaa.failed" / "workers"
    assert find_run_snapshots(runs, "node[1]", "run1") == failed / "node[1]"
    assert find_run_snapshots(runs, "w*", "run1") == failed / "w*"
    assert find_run_snapshots(runs, "w1", "run2") == runs / "workers" / "w1"
    assert find_run_snapshots(runs, "w2", "run1") is None
    assert find_run_snapshots(runs, "w1", "run3") is None
    assert find_run_snapshots(tmp_path / "nowhere", "w1", "run1") is None
