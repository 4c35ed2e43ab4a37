"""Federated neural topic models (gFedNTM), worker side: ProdLDA and CombinedTM.

Registration sends this worker's vocabulary with term and document frequencies
(:func:`common.data.text.vocabulary_info`), as the NMF family does; the setup brings the agreed
vocabulary, over which the worker counts its documents (:func:`common.data.text.bow_matrix`).

``mode: sync``: each round is one step. The worker loads the global weights, takes its next
mini-batch (its own seeded order, a fresh permutation every epoch) and uploads the gradient of
the batch's mean loss, by parameter name, with the batch-norm running statistics that batch
moved. It scores the model only when the payload asks (``meta["evaluate"]``), so that a step
stays cheap. With ``sync_batch_norm`` (the default) a step takes five rounds: in the first the
worker loads the weights and draws its batch, and in each it uploads what that phase of
:class:`common.models.ntm_sync_bn.SyncBNStep` asks from what the master published; a worker
that holds no state of the step (it restarted mid-step) abstains, and the master redoes the
step. ``mode: fedavg``: ``local_epochs`` local epochs from the global weights with a local Adam
whose state persists across rounds; the weights travel.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.config import ClusterConfig, build_params
from common.data.shards import LocalData, sentence_features
from common.data.text import bow_matrix
from common.eval.topics import neural_topic_scores
from common.models import ntm_secure
from common.models.ntm import CONTEXT_SIZE, NeuralTopicModel, NTMParams, batch_schedule
from common.models.ntm_sync_bn import ABSTAIN, N_PHASES, SyncBNStep
from common.models.proximal import anchor_of
from worker.families.base import FitResult
from worker.families.vocabulary import VocabularyClient


class ProdLDAClient(VocabularyClient):
    """Worker side of ``model: {family: prodlda}`` (see the module docstring)."""

    name = "prodlda"
    contextual_size = 0
    #: Sync uploads are gradients, not parameters: a delta against the weights is meaningless.
    compressible = False

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        super().__init__(cfg, data, device, seed)
        self.params: NTMParams = build_params(NTMParams, cfg.family_params,
                                              f"{cfg.source}: model")
        self.y_train, self.y_test = data.y_train, data.y_test
        # Global row numbers: the per-document noise seed, the same in a centralized run.
        self.doc_ids = np.asarray(data.train_index)
        self.model: NeuralTopicModel | None = None
        self.c_train: np.ndarray | None = None
        self.c_test: np.ndarray | None = None
        self.step_: SyncBNStep | None = None  # the synchronized step under way
        self.phase_ = ntm_secure.STEP  # of the last round fitted (secure rounds' terms)

    def setup_vocabulary(self, vocabulary: list[str]) -> None:
        self.x_train = bow_matrix(self.train_texts, self.vocabulary_)
        self.x_test = bow_matrix(self.test_texts, self.vocabulary_)
        if self.contextual_size:
            emb = sentence_features(self.cfg, self.data.dataset, device=self.device)
            self.c_train = emb[self.data.train_index]
            self.c_test = emb[self.data.test_index]
        self.model = self._fresh()
        if self.params.mode == "fedavg":  # its Adam (torch's compiler import, ~1 s) now, not
            self.model.optimizer_.zero_grad()  # in round 1's timed training
        self.batches = batch_schedule(self.x_train.shape[0], self.params.batch_size, self.seed)

    def _fresh(self) -> NeuralTopicModel:
        assert self.vocabulary_ is not None, "setup() first"
        model = self.params.model(self.contextual_size, self.seed, self.device,
                                  noise_seed=self.cfg.seed)
        model.initialize(len(self.vocabulary_))
        model.vocabulary_ = self.vocabulary_
        return model

    def local_state(self) -> dict[str, Any]:
        # The synchronized step under way is not kept: a worker that comes back mid-step
        # abstains, and the master redoes the step from its start (docs/RECOVERY.md).
        if self.model is None:
            return {}
        # A synchronous step loads the global weights in its first round: they are not this
        # worker's state (and at 325 k parameters writing them cost 4 ms a step, measured).
        weights = self.params.mode != "sync"
        return {"model": self.model.local_state(weights), "batches": self.batches.state()}

    def snapshot_due(self, meta: Mapping[str, Any]) -> bool:
        # A step the worker leaves mid-way is redone from its start, which a resumed master
        # or a restarted worker finds in the snapshot after the step before: the phases
        # before the last are never gone back to (1.9 ms a round each, measured).
        return (not self.params.synced_batch_norm
                or int(meta.get("phase", 0)) == N_PHASES - 1)

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        if self.model is not None and state:
            self.model.load_local_state(state["model"])
            self.batches.load_state(state["batches"])
            self.step_ = None

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        assert self.model is not None, "setup() first"
        if self.params.synced_batch_norm:
            return self._fit_phase(round_, meta, arrays)
        self.model.set_arrays(arrays)
        t0 = time.perf_counter()
        if self.params.mode == "sync":
            rows = next(self.batches)
            out = self.model.gradients(self.x_train, self.c_train, rows, self.doc_ids[rows],
                                       step=int(meta.get("step", round_ - 1)))
            n = len(rows)
        else:
            # Local Adam (its state persists across rounds) along the worker's own endless
            # batch order, so that every round sees a fresh permutation.
            n = self.x_train.shape[0]
            mu = float(meta.get("proximal_mu", 0.0))  # FedProx
            anchor = anchor_of(self.model._trainable(), mu)
            for _ in range(self.params.local_epochs * -(-n // self.params.batch_size)):
                rows = next(self.batches)
                self.model.step(self.x_train, self.c_train, rows, self.doc_ids[rows], anchor, mu)
            out = self.model.get_arrays()
        metrics = {"train_loss": self.model.last_loss_, "train_time": time.perf_counter() - t0}
        return FitResult(out, n, metrics)

    def _fit_phase(self, round_: int, meta: Mapping[str, Any],
                   arrays: Mapping[str, np.ndarray]) -> FitResult:
        """One phase of a synchronized-batch-norm step."""
        assert self.model is not None
        t0 = time.perf_counter()
        phase, step = int(meta.get("phase", 0)), int(meta.get("step", round_ - 1))
        self.phase_ = phase
        if phase == 0:
            self.model.set_arrays(arrays)
            rows = next(self.batches)
            self.step_ = SyncBNStep(self.model, self.x_train, self.c_train, rows,
                                    self.doc_ids[rows], step)
        elif self.step_ is None or self.step_.step != step or self.step_.phase != phase:
            # Nothing of this step here (a restart, or a phase missed): the master redoes it.
            return FitResult({ABSTAIN: np.zeros(0)}, 1, {"abstain": 1.0})
        out = self.step_.upload(phase, arrays)
        metrics = {"train_time": time.perf_counter() - t0}
        if phase == 2:  # the loss is known once the decoder's statistics are
            metrics["train_loss"] = self.step_.loss_
        return FitResult(out, self.step_.n_local, metrics)

    def secure_vector(self, arrays: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray],
                      n_samples: int, n_max: int, clip: float) -> tuple[np.ndarray, float]:
        """``mode: sync``: the round's upload as the terms whose sum the master needs
        (:mod:`common.models.ntm_secure`); ``mode: fedavg``: the weighted change, as every
        family sends it."""
        if self.params.mode != "sync":
            return super().secure_vector(arrays, model, n_samples, n_max, clip)
        assert self.model is not None
        phase = self.phase_ if self.params.synced_batch_norm else ntm_secure.STEP
        n_union = self.step_.n_union if phase == 4 and self.step_ is not None else 0.0
        vector = ntm_secure.worker_vector(self.model, phase, arrays, n_samples, model, n_union,
                                          self.params.batch_stats)
        clipped = int(np.count_nonzero(np.abs(vector) > clip))
        return vector, clipped / vector.size

    def _scores(self, model: NeuralTopicModel, final: bool = True) -> dict[str, float]:
        assert self.vocabulary_ is not None
        return neural_topic_scores(model, self.vocabulary_, self.x_train, self.c_train,
                                   self.y_train, self.x_test, self.c_test, self.y_test,
                                   self.seed,
                                   [*self.train_texts, *self.test_texts] if final else None)

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        if not meta.get("evaluate", True):  # a sync step: training only
            return {}
        return self._scores(self._fresh().set_arrays(arrays), final=False)

    def final_scores(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                     ) -> dict[str, float]:
        return self._scores(self._fresh().set_arrays(arrays))

    def local_baseline(self) -> dict[str, float]:
        """The same model on this worker's documents alone, same budget: as many steps as the
        rounds gave (sync) or ``rounds x local_epochs`` epochs (fedavg)."""
        model = self._fresh()
        if self.params.mode == "sync":
            model.fit(self.x_train, self.c_train, steps=self.cfg.rounds // self.params
                      .rounds_per_step, doc_ids=self.doc_ids)
        else:
            model.fit(self.x_train, self.c_train,
                      epochs=self.cfg.rounds * self.params.local_epochs, doc_ids=self.doc_ids)
        return self._scores(model)


class CombinedTMClient(ProdLDAClient):
    """Worker side of ``model: {family: combinedtm}``: the inference network also reads each
    document's sentence embedding (:func:`common.data.shards.sentence_features`, cached)."""

    name = "combinedtm"
    contextual_size = CONTEXT_SIZE
