"""The arithmetic of `fedctl bench`'s report, and its command line's refusals, without a
cluster (tests/test_bench.py runs one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_fedctl


def test_least_overhead_spreads_the_training_over_the_cores() -> None:
    """What a framework costing nothing would reach: 3 trainings of 1.6 ms (5.0 core-ms) on
    2 cores end 2.5 ms after the broadcast, 0.9 ms after the slowest's own 1.6 ms."""
    from fedctl.bench.report import _least_overhead

    run = {"anatomy": {"train_cpu": 0.005, "train": 0.0016}, "cores": 2,
           "bare": {"round_s": 0.0007}}
    assert _least_overhead(run) == pytest.approx(0.0009 + 0.0007)
    # Trainings that fit the cores side by side leave the bare exchange alone.
    run["anatomy"]["train_cpu"] = 0.003
    assert _least_overhead(run) == pytest.approx(0.0007)
    run["anatomy"]["train_cpu"] = None
    assert _least_overhead(run) is None



def test_small_models_get_more_anatomy_rounds() -> None:
    """20 rounds of a 10 ms round gave medians that moved by half between two runs: a model
    runs as many more rounds (and bare exchanges) as it is smaller than 25 M, up to a cap."""
    from fedctl.bench.plan import Plan

    plan = Plan()
    assert plan.anatomy_rounds_for(25_155_002) == (20, 7)
    assert plan.anatomy_rounds_for(1_585_154) == (300, 110)
    assert plan.anatomy_rounds_for(99_074) == (300, 300)
    assert Plan.quick().anatomy_rounds_for(99_074) == (3, 3)  # the smoke run stays small


@pytest.mark.parametrize("args, message", [
    (["--config", "/no/such.yaml"], "Error: /no/such.yaml: no such file"),
    (["--hidden", "abc"], "argument --hidden: expected sizes like 256,4096, got 'abc'"),
    (["--hidden", "0,256"], "argument --hidden: expected sizes like 256,4096, got '0,256'"),
])
def test_bench_refuses_bad_input_without_a_traceback(tmp_path: Path, args: list[str],
                                                     message: str) -> None:
    """A config that cannot be read, or sizes that are not sizes, used to end in a traceback
    (after the sections before the anatomy had run, for --hidden)."""
    proc = run_fedctl("bench", "--out", str(tmp_path / "out"), *args)
    assert proc.returncode in (1, 2) and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
