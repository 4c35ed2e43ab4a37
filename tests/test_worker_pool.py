"""The scaling benchmark's worker pools (fedctl/bench/worker_pool.py): many workers as threads
of a few processes, on a real loopback cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_worker_pools_run_the_workers_as_threads_of_a_few_processes(tmp_path: Path) -> None:
    # The scaling benchmark's way to 1,000 workers (fedctl/bench/worker_pool.py), small.
    from common.config import load_config
    from fedctl.bench.harness import bench_config, run_cluster

    cfg = bench_config(load_config(ROOT / "cluster.yaml"), tmp_path / "out", n_workers=6,
                       rounds=2, eval_every=0, baselines=False,
                       **{"data.partition": "iid", "data.limit": 600, "security.mode": "none"})
    run = run_cluster(cfg, threads_mode=True, pools=2, timeout=300)
    assert run["mode"] == "threads of 2 processes" and run["n_workers"] == 6
    assert [r["n_updates"] for r in run["rounds"]] == [6, 6]
    logs = tmp_path / "out" / "logs"
    assert sorted(p.name for p in logs.glob("pool*.log")) == ["pool1.log", "pool2.log"]


def test_a_worker_pool_refuses_ids_the_job_does_not_have(tmp_path: Path) -> None:
    from fedctl.bench.worker_pool import main

    assert main(["--config", str(ROOT / "cluster.yaml"), "--ids", "w1,nobody"]) == 2
