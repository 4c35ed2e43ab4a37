"""benchmarks/gpu_check.py's CPU path, and where a worker's training really ran (issue #31).

The script runs each family's example through ``fedctl run`` with every worker on cuda and on
cpu. Here, on any machine: one family, two rounds, 600 documents. Without CUDA its cuda column
says so and nothing runs there; with CUDA the workers' tensors must all have been on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedctl.launch import child_env
from tests.conftest import ROOT


@pytest.mark.slow
def test_gpu_check_runs_on_any_machine(tmp_path: Path, embed_cache: Path) -> None:
    # The session's embedding cache (the same 600 documents), not the user's own.
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--families", "mlp",
                           "--rounds", "2", "--limit", "600", "--work", str(tmp_path / "work"),
                           "--results", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=child_env(embed_cache))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (report["families_done"], report["families"]) == (1, 1)  # written after each family
    res = report["results"]["mlp"]
    cpu = res["cpu"]
    assert cpu["rounds"] == 2 and cpu["error"] is None
    assert 0 < cpu["final"] <= 1 and cpu["train_s_per_round"] > 0
    assert cpu["tensors_on_gpu_min"] == 0.0  # measured, and nothing on a GPU
    assert cpu["gpu_peak_mb_max"] is None
    md = (tmp_path / "gpu_check.md").read_text()
    if torch.cuda.is_available():
        assert res["cuda"]["tensors_on_gpu_min"] == 1.0, res["cuda"]
        assert res["cuda"]["gpu_peak_mb_max"] > 0
    else:
        assert "CUDA is not available" in res["cuda"]["skipped"]
        assert "| mlp | macro_f1 | not run (no CUDA) |" in md


def test_tensor_placement_and_out_of_memory_line() -> None:
    from worker import devices

    class Family:
        def __init__(self) -> None:
            self.model = type("Model", (), {})()
            self.model.model_ = torch.nn.Linear(4, 2)  # found one level down, as in MLPClient
            self.x_train = torch.zeros(10)
            self.name = "mlp"

    assert devices.tensors_on_gpu(Family()) == 0.0
    assert devices.tensors_on_gpu(type("NoTorch", (), {"topics": [1, 2]})()) is None
    assert devices.peak_mb("cpu") is None
    # Counted on a worker's first round and every CHECK_EVERY-th it trains, not on every one.
    assert [r for r in range(1, 25) if devices.check_due(r)] == [1, 1 + devices.CHECK_EVERY,
                                                                 1 + 2 * devices.CHECK_EVERY]
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert devices.is_out_of_memory(oom) and not devices.is_out_of_memory(MemoryError())
    line = devices.out_of_memory_message("w2", "cuda:0", 3, "mlp", {"batch_size": 64},
                                         "cluster.yaml")
    assert line == ("w2: CUDA out of memory on cuda:0 in round 3 (mlp): lower "
                    "model.batch_size (now 64) in cluster.yaml, or set this worker's "
                    "device: cpu")


def test_a_worker_asked_for_cuda_without_it_stops_in_one_line(make_config, tmp_path: Path
                                                              ) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    config = make_config(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "fedctl", "worker", "--config", str(config),
                           "--id", "w1", "--device", "cuda"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "device 'cuda' requested but CUDA is not available" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cuda_out_of_memory_in_training_ends_the_worker_in_one_line(embed_cache: Path,
                                                                    tmp_path: Path) -> None:
    """A real master and worker over loopback; the worker's training raises torch's own
    CUDA out-of-memory error (as a GPU that is too small does): the worker stops with one line
    naming its batch size, not a traceback, and the master is left to its deadline."""
    import threading

    from common.config import parse_config
    from master.server import DONE, Master
    from tests.conftest import config_dict
    from worker import devices
    from worker.client import Worker

    cfg = parse_config(config_dict(tmp_path / "out", embed_cache, workers=["w1"], rounds=2,
                                   model={"family": "mlp", "batch_size": 32}),
                       source=str(tmp_path / "cluster.yaml"))
    master = Master(cfg)
    master.bind()
    server = threading.Thread(target=master.serve, daemon=True)
    server.start()
    worker = Worker(cfg, "w1")

    def fit(*_args: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    worker.family.fit = fit  # type: ignore[method-assign]
    try:
        with pytest.raises(devices.GPUMemoryError) as caught:
            worker.run()
    finally:
        master.phase = DONE  # its loop ends at its next tick; the job is not the subject
        server.join(timeout=30)
        master.close()
    assert str(caught.value) == (
        f"w1: CUDA out of memory on cpu in round 1 (mlp): lower model.batch_size (now 32) in "
        f"{tmp_path / 'cluster.yaml'}, or set this worker's device: cpu")
