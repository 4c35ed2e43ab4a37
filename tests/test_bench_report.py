"""The arithmetic of `fedctl bench`'s report, without a cluster (tests/test_bench.py runs one)."""

from __future__ import annotations

import pytest


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
