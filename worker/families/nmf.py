"""FedNMF / FedNMF+MI topic model, worker side: local vocabulary, local H, local SGD epochs."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import scipy.sparse as sp

from common.config import ClusterConfig, build_params
from common.data.shards import LocalData
from common.data.text import bow_matrix
from common.models.nmf import SGDNMF, NMFParams, heldout_scores
from worker.families.base import FitResult
from worker.families.vocabulary import VocabularyClient


class NMFClient(VocabularyClient):
    """Worker side of ``model: {family: nmf}``.

    Registration sends this worker's vocabulary with term and document frequencies
    (:func:`common.data.text.local_vocabulary`); the setup brings the agreed vocabulary
    (``setup["vocabulary"]``), over which the worker counts its documents. Each round it loads
    the topics C (and the MI critic) from the payload, runs the local epochs on its own
    documents with its own topic weights H, which persist across rounds and never leave the
    worker, and returns C (and the critic, unless ``critic_aggregation: local`` keeps it here
    with H).
    """

    name = "nmf"

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        super().__init__(cfg, data, device, seed)
        self.params: NMFParams = build_params(NMFParams, cfg.family_params,
                                              f"{cfg.source}: model")
        self.y_train, self.y_test = data.y_train, data.y_test
        self.x_train: sp.csr_matrix | None = None
        self.x_test: sp.csr_matrix | None = None
        self.model: SGDNMF | None = None
        # torch and scikit-learn pay a one-off cost on their first calls (seconds on a busy
        # CPU); pay it now, before joining, so it does not count as round 1's training time.
        dummy = sp.random(16, 8, density=0.3, random_state=0, format="csr", dtype=np.float32)
        warm = self.params.model(device=device)
        warm.fit(dummy, epochs=1)
        heldout_scores(warm, dummy, np.arange(16) % 2, dummy, np.arange(16) % 2)

    def setup_vocabulary(self, vocabulary: list[str]) -> None:
        self.x_train = bow_matrix(self.train_texts, self.vocabulary_)
        self.x_test = bow_matrix(self.test_texts, self.vocabulary_)
        self.model = self.params.model(device=self.device, random_state=self.seed)

    def local_state(self) -> dict[str, Any]:
        return {} if self.model is None else self.model.local_state()

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        if self.model is not None and state:
            self.model.load_local_state(state)

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        assert self.model is not None, "setup() first"
        self.model.set_arrays(arrays)
        t0 = time.perf_counter()
        self.model.fit(self.x_train, proximal_mu=float(meta.get("proximal_mu", 0.0)))
        train_time = time.perf_counter() - t0
        metrics = {"train_loss": self.model.last_loss_, "train_time": train_time}
        if math.isfinite(self.model.last_mi_):
            metrics["train_mi"] = self.model.last_mi_
        return FitResult(self.model.get_arrays(critic=self.params.critic_travels),
                         self.x_train.shape[0], metrics)

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        assert self.model is not None, "setup() first"
        scorer = self.params.model(device=self.device)
        scorer.set_arrays(arrays)
        return heldout_scores(scorer, self.x_train, self.y_train, self.x_test, self.y_test,
                              self.seed)

    def local_baseline(self) -> dict[str, float]:
        """The same model and epochs (rounds x local epochs) on this worker's documents alone,
        over the agreed vocabulary."""
        assert self.x_train is not None, "setup() first"
        model = self.params.model(device=self.device, random_state=self.seed)
        model.fit(self.x_train, epochs=self.cfg.rounds * self.params.local_epochs)
        return heldout_scores(model, self.x_train, self.y_train, self.x_test, self.y_test,
                              self.seed)
