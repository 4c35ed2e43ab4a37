"""Robust aggregation against a poisoning member (issue #27).

Five workers (mlp on the test's 600 documents, Dirichlet topic skew, multiclass), one of them a
poisoner (tests/poisoner.py). Its sign-flipped update (x10) wrecks FedAvg (macro-F1 0.91 -> 0.13
when measured); FedMedian, trimmed mean (beta 0.2) and Krum (f = 1) with nearest-neighbour mixing
keep the model, near their clean run. Without mixing they keep it too, but with four skewed
honest workers a median or a trimmed mean pushed one rank over by the outlier is biased
(measured here: FedMedian -4, trimmed mean -10 points; benchmarks/robust.py has the full-size
job, with and without mixing). Its constant shift is so far out that the master's own
screening leaves it out, whatever the strategy. Master and workers run
on threads of this process and talk ZeroMQ over TCP loopback (each job as processes would cost
more in start-up than in training).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.config import parse_config
from master.server import Master
from tests.conftest import config_dict, start_worker_threads
from tests.poisoner import poisoning_worker

pytestmark = pytest.mark.slow

HONEST = ["w1", "w2", "w3", "w4"]
#: Enough local training that 6 rounds on 600 documents learn the 14 classes (mean macro-F1
#: about 0.6-0.8): the one-vs-rest default on so few documents never leaves "rest".
MODEL = {"family": "mlp", "hidden": 64, "local_epochs": 20}
ROUNDS = 15
MIXED = {"num_malicious_clients": 1, "mixing": True}
ROBUST = {"fedmedian": {"name": "fedmedian", **MIXED},
          "fedtrimmedavg": {"name": "fedtrimmedavg", "beta": 0.2, **MIXED},
          "krum": {"name": "krum", **MIXED}}


def _final_f1(cache: Path, folder: Path, strategy: dict[str, Any], attack: str | None
              ) -> float:
    """The honest workers' mean macro-F1 of the final model."""
    cfg = parse_config(config_dict(folder / "out", cache, workers=[*HONEST, "w5"], rounds=ROUNDS,
                                   strategy=strategy, model=MODEL,
                                   data={"partition": "dirichlet", "task": "multiclass"}),
                       source=str(folder))
    master = Master(cfg)
    master.bind()
    server = threading.Thread(target=master.serve, daemon=True)
    server.start()
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []
    threads = start_worker_threads(cfg, HONEST if attack else [*HONEST, "w5"], reports, errors)
    if attack:
        bad = poisoning_worker(cfg, "w5", attack)
        threads.append(threading.Thread(target=bad.run, daemon=True))
        threads[-1].start()
    try:
        for t in [*threads, server]:
            t.join(timeout=300)
    finally:
        master.close()
    assert not errors, errors
    assert not server.is_alive(), "the master did not finish"
    return float(np.mean([reports[w]["federated"]["macro_f1"] for w in HONEST]))


@pytest.fixture(scope="module")
def clean_fedavg(tmp_path_factory: pytest.TempPathFactory, embed_cache: Path) -> float:
    """FedAvg's final F1 with every worker honest: both tests' reference, run once (the model
    depends on the config's seed, data, model and rounds, not on its ports or folder)."""
    return _final_f1(embed_cache, tmp_path_factory.mktemp("clean"), {"name": "fedavg"}, None)


def test_a_sign_flipped_update_wrecks_fedavg_and_not_the_robust_rules(
        embed_cache: Path, tmp_path: Path, clean_fedavg: float) -> None:
    clean = clean_fedavg
    wrecked = _final_f1(embed_cache, tmp_path / "fedavg", {"name": "fedavg"}, "signflip")
    assert wrecked < clean - 0.3, (clean, wrecked)
    for name, strategy in ROBUST.items():
        mine = _final_f1(embed_cache, tmp_path / f"{name}-clean", strategy, None)
        held = _final_f1(embed_cache, tmp_path / name, strategy, "signflip")
        # within 1 point of its own clean run (measured: 0.913 held, 0.891 clean, for all three)
        assert held >= mine - 0.01 and held > wrecked + 0.3, (name, mine, held, wrecked)


def test_a_shifted_update_is_left_out_by_the_master_itself(embed_cache: Path, tmp_path: Path,
                                                          clean_fedavg: float) -> None:
    from tests.conftest import events

    clean = clean_fedavg
    shifted = _final_f1(embed_cache, tmp_path / "shift", {"name": "fedavg"}, "shift")
    left_out = events(tmp_path / "shift" / "out", "left_out")
    assert {e["worker"] for e in left_out} == {"w5"} and len(left_out) == ROUNDS
    assert shifted == pytest.approx(clean, abs=0.02)
