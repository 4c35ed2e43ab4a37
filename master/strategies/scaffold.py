"""SCAFFOLD (Karimireddy et al. 2020): control variates that correct the workers' drift."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.aggregate import weighted_average
from common.constants import SCAFFOLD_CHANGE as CHANGE
from common.constants import SCAFFOLD_CONTROL as CONTROL
from master.strategies.base import ClientResult, Strategy


class Scaffold(Strategy):
    """The server keeps a control variate ``c`` (one array per parameter, zero at first) and
    sends it with every round. Each worker keeps its own ``c_i`` (in its snapshots, so a
    restart keeps it), corrects every local step by ``c − c_i`` and returns its new weights
    and ``Δc_i = c_i⁺ − c_i`` with ``c_i⁺ = c_i − c + (x − y) / (K·η)`` (the paper's option II;
    K steps at learning rate η). The server then takes

        x = x + η_g · (mean_i y_i − x)        (sample-weighted, FedAvg's at η_g = 1)
        c = c + |S| / N · mean_i Δc_i

    with N the workers that ever reported. Flower's core has no SCAFFOLD; this follows the
    paper, with the correction applied after each optimizer step, as NVFlare's does (so that it
    also serves workers training with Adam).

    Parameters
    ----------
    server_learning_rate : float, default 1.0
        η_g.

    Attributes
    ----------
    control_ : dict of str to numpy.ndarray
        c, float32, empty before the first round.
    seen_ : set of str
        The workers that have reported (N).
    """

    name = "scaffold"
    secure_aggregation_refusal = ("its control variates are per worker, not a sum (not built "
                                  "for secure rounds)")

    def __init__(self, server_learning_rate: float = 1.0) -> None:
        if not server_learning_rate > 0:
            raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate}")
        self.server_learning_rate = server_learning_rate
        self.control_: dict[str, np.ndarray] = {}
        self.seen_: set[str] = set()

    def client_settings(self) -> dict[str, Any]:
        return {"scaffold": True}

    def client_arrays(self, current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.control_:
            self.control_ = {k: np.zeros(np.shape(v), np.float32) for k, v in current.items()}
        return {CONTROL + k: v for k, v in self.control_.items()}

    def upload_arrays(self, current: Mapping[str, np.ndarray]
                      ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {CHANGE + k: (tuple(np.shape(v)), np.dtype(np.float32))
                for k, v in current.items()}

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        mean = weighted_average([r.arrays for r in results], [r.n_samples for r in results],
                                accumulate=np.float64)
        changes = weighted_average([{k: r.extra[CHANGE + k] for k in current}
                                    for r in results], [1.0] * len(results),
                                   accumulate=np.float64)
        self.seen_ |= {r.worker_id for r in results}
        share = len(results) / len(self.seen_)
        control = self.control_ or {k: np.zeros(np.shape(v), np.float32)
                                    for k, v in current.items()}
        out = {}
        for name, x in current.items():
            x64 = np.asarray(x, dtype=np.float64)
            out[name] = (x64 + self.server_learning_rate * (mean[name] - x64)).astype(x.dtype)
        self.control_ = {k: (c + share * changes[k]).astype(np.float32)
                         for k, c in control.items()}
        return out

    def state(self) -> dict[str, np.ndarray]:
        return {**{f"c/{k}": v for k, v in self.control_.items()},
                "seen": np.array(sorted(self.seen_), dtype=str)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.control_ = {k[2:]: np.array(v) for k, v in state.items() if k.startswith("c/")}
        self.seen_ = {str(w) for w in state.get("seen", np.array([], dtype=str))}
