"""Load: a real master process serves 100 workers (threads of this process, each with its own
sockets, heartbeat and local update) through complete rounds of the MLP family.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import load_config
from tests.conftest import MakeConfig, Procs, events

pytestmark = pytest.mark.slow

N = 100


def _peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident memory; None once it has ended (a zombie's status has no
    VmHWM: the master may end between the caller's poll and this read)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def test_hundred_workers_complete_rounds(tmp_path: Path, make_config: MakeConfig, procs: Procs
                                         ) -> None:
    torch.set_num_threads(1)
    from worker.client import Worker

    cfg_path = make_config(tmp_path, workers=N, rounds=3, min_workers=N, heartbeat_timeout=30,
                           data={"partition": "iid"}, model={"family": "mlp", "hidden": 32})
    cfg = load_config(cfg_path)
    master = procs.master(cfg_path)
    reports: dict[str, Any] = {}
    errors: list[str] = []

    def work(wid: str) -> None:
        try:
            reports[wid] = Worker(cfg, wid).run()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{wid}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(w.name,), daemon=True) for w in cfg.workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:5]
    assert len(reports) == N
    peak = _peak_rss_mib(master.pid) if master.poll() is None else None
    assert master.wait(timeout=120) == 0, procs.logs_tail()
    out = tmp_path / "out"
    rounds = events(out, "round")
    assert [e["round"] for e in rounds] == [1, 2, 3]
    assert all(e["n_updates"] == N for e in rounds)
    # One broadcast per round, whatever N: the master serializes the model once (~50 kB of
    # weights; round 1 also carries the setup information, a few bytes more).
    sizes = [e["broadcast_bytes"] for e in rounds]
    assert max(sizes) < 100_000 and max(sizes) - min(sizes) < 1_000
    if peak is not None:
        assert peak < 1024, f"master peak RSS {peak:.0f} MiB"
