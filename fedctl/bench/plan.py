"""What one ``fedctl bench`` invocation measures: the sections and their settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SECTIONS = ("centralized", "anatomy", "scaling", "compression")
THREAD_WORKERS_FROM = 30  # N at or above which workers run as threads of this process


@dataclass
class Plan:
    """What one invocation measures (``--quick`` shrinks every section).

    Attributes
    ----------
    rounds : int
        Rounds of the default-job runs (centralized, compression).
    eval_on : bool
        Also run the default job with per-round evaluation on.
    anatomy_hidden : list of int
        MLP hidden sizes (parameters = 387 h + 2).
    anatomy_rounds : int
        Rounds of the anatomy at 25 M parameters; a smaller model runs as many more as it is
        smaller, up to ``anatomy_max_rounds`` (:meth:`anatomy_rounds_for`): 20 rounds of a
        10 ms round were too few for a stable median.
    anatomy_max_rounds : int
    anatomy_limit : int
        ``data.limit`` of the anatomy runs: local work kept small, the point is communication.
    bare_reps : int
        Repetitions of the bare pyzmq exchange at 25 M parameters, scaled as the rounds.
    scaling_n : list of int
    scaling_rounds : int
    scaling_limit : int
        ``data.limit`` of the scaling runs (split iid among the N workers).
    scaling_threads_from : int
        N from which workers run as threads.
    scaling_threads_per_process : int
        Threads a process at most (:mod:`fedctl.bench.worker_pool`); 0: all of them threads
        of this process.
    profile : bool
        Profile the master of each anatomy run (cProfile).
    compression : list of dict
        ``compression`` sections to compare (``none`` is the centralized section's run).
    """

    rounds: int = 20
    eval_on: bool = True
    anatomy_hidden: list[int] = field(default_factory=lambda: [256, 4096, 65000])
    anatomy_rounds: int = 20
    anatomy_max_rounds: int = 300
    anatomy_limit: int = 600
    bare_reps: int = 7
    scaling_n: list[int] = field(default_factory=lambda: [1, 3, 10, 30, 100])
    scaling_rounds: int = 5
    scaling_limit: int = 2000
    scaling_threads_from: int = THREAD_WORKERS_FROM
    scaling_threads_per_process: int = 0
    profile: bool = False
    compression: list[dict[str, Any]] = field(default_factory=lambda: [
        {"kind": "float16"}, {"kind": "int8"}, {"kind": "topk", "fraction": 0.01},
        {"kind": "topk", "fraction": 0.1}])

    @classmethod
    def quick(cls) -> Plan:
        """A smoke run: every code path, a few rounds, small models."""
        return cls(rounds=3, eval_on=False, anatomy_hidden=[256, 4096], anatomy_rounds=3,
                   anatomy_max_rounds=3, bare_reps=3, scaling_n=[1, 4], scaling_rounds=2,
                   scaling_threads_from=2, compression=[{"kind": "int8"}])

    def anatomy_rounds_for(self, params: int) -> tuple[int, int]:
        """(cluster rounds, bare exchanges) of the anatomy at ``params`` parameters: as many
        more than at 25 M as the model is smaller, at most ``anatomy_max_rounds``."""
        scale = max(1.0, 25e6 / max(params, 1))
        rounds, reps = (max(n, min(self.anatomy_max_rounds, round(n * scale)))
                        for n in (self.anatomy_rounds, self.bare_reps))
        return rounds, reps
