"""A tiny fedctl plug-in, the example of docs/FAMILIES.md.

``toy`` learns the letter frequencies of the workers' documents: each worker moves the global
frequencies halfway towards its own, the strategy of cluster.yaml combines the moves. ``median``
is a strategy: the coordinate-wise median of the workers' parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedctl import ClientFamily, ClientResult, Family, FitResult, Payload, ServerFamily, Strategy

LETTERS = "abcdefghijklmnopqrstuvwxyz"
FREQ = "freq"  # the one array that travels


def letter_frequencies(texts: Sequence[str]) -> np.ndarray:
    """Share of each of a-z among the letters of ``texts`` (float32, sums to 1)."""
    counts = np.zeros(len(LETTERS), dtype=np.float64)
    for text in texts:
        for ch in text.lower():
            i = LETTERS.find(ch)
            if i >= 0:
                counts[i] += 1
    return (counts / max(counts.sum(), 1.0)).astype(np.float32)


class ToyServer(ServerFamily):
    """Master half: starts from uniform frequencies; aggregation is the strategy's."""

    name = "toy"

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        self.setup_info_ = {"letters": LETTERS}
        uniform = np.full(len(LETTERS), 1 / len(LETTERS), dtype=np.float32)
        self.global_ = Payload({}, {FREQ: uniform})
        return self.global_


class ToyClient(ClientFamily):
    """Worker half: moves the global frequencies halfway towards this worker's own."""

    name = "toy"

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        own = letter_frequencies(self.data.train_texts)
        new = (0.5 * arrays[FREQ] + 0.5 * own).astype(np.float32)
        return FitResult({FREQ: new}, self.n_samples,
                         {"train_time": 0.0, "l1_to_own": float(np.abs(new - own).sum())})

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        own = letter_frequencies(self.data.test_texts)
        return {"l1_to_own": float(np.abs(arrays[FREQ] - own).sum())}


class Median(Strategy):
    """Coordinate-wise median of the clients' parameters (unweighted)."""

    name = "median"

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        return {k: np.median(np.stack([r.arrays[k] for r in results]), axis=0).astype(v.dtype)
                for k, v in current.items()}


#: What the entry point ``fedctl.families: toy`` names.
TOY = Family("toy", server=ToyServer, client=ToyClient)
