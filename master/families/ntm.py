"""Federated neural topic models (gFedNTM), master side: ProdLDA and CombinedTM.

Stage 1, vocabulary consensus: the workers' vocabularies with term and document frequencies
are merged (:func:`common.text.merge_vocabularies`: union, frequencies weighted by the number
of workers holding a word, ``vocab_size`` cap, ``min_df``); the master builds the network with
``cfg.seed`` and sends the agreed vocabulary once (``setup_info_``) and the initial weights.

Stage 2, ``mode: sync``: a round of the cluster is one synchronous mini-batch step. The payload
is the global weights (and batch-norm running statistics); each worker uploads the gradient of
its own batch's mean loss, named like the parameters, plus the running statistics its batch
moved. The master averages the gradients weighted by batch size, merges the running statistics
into those of the union of the workers' batches
(:meth:`common.models.ntm.NeuralTopicModel.merge_running_stats`), takes one Adam step on its
own copy and publishes the new weights. ``mode: fedavg``: ordinary rounds of local epochs
aggregated by the configured strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.config import ClusterConfig, build_params
from common.models.ntm import (
    CONTEXT_SIZE,
    NeuralTopicModel,
    NTMParams,
    relative_change,
)
from master.families.base import Payload, ServerFamily
from master.families.vocabulary import agree_vocabulary, check_vocabulary_info
from master.strategies import ClientResult, Strategy

log = logging.getLogger("fedctl.master")


class ProdLDAServer(ServerFamily):
    """Master side of ``model: {family: prodlda}`` (see the module docstring).

    The relative change of the weights ``||w_t - w_{t-1}|| / ||w_{t-1}||`` is kept per step;
    :meth:`finished` stops a synchronous run when it falls below ``tol`` or has not reached a
    new minimum for ``patience`` steps. Every ``eval_every`` steps, and at the last, the
    payload's ``meta`` asks the workers to score the model (``{"evaluate": true}``).
    """

    name = "prodlda"
    contextual_size = 0

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        super().__init__(cfg, strategy)
        self.params: NTMParams = build_params(NTMParams, cfg.family_params,
                                              f"{cfg.source}: model")
        self.model_: NeuralTopicModel | None = None
        self.changes_: list[float] = []

    def check_info(self, info: Mapping[str, Any]) -> None:
        check_vocabulary_info(info)

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        p = self.params
        vocab = agree_vocabulary(registrations, p.vocab_size, p.min_df)
        self.model_ = p.model(self.contextual_size, self.cfg.seed).initialize(len(vocab))
        self.setup_info_ = {"vocabulary": vocab, "contextual_size": self.contextual_size}
        self.global_ = Payload(self._meta(0), self.model_.get_arrays())
        log.info("%s: %d words agreed from %d vocabularies, %d topics, mode %s, %d parameters",
                 self.name, len(vocab), len(registrations), p.n_topics, p.mode,
                 sum(a.size for a in self.global_.arrays.values()))
        return self.global_

    def _meta(self, done: int) -> dict[str, Any]:
        """``evaluate``: whether workers score the payload of step ``done + 1``."""
        p = self.params
        last = done + 1 >= self.cfg.rounds or self.finished()
        ev = p.mode == "fedavg" or done % p.eval_every == 0 or last
        return {"step": done, "evaluate": bool(ev)}

    def check_update(self, arrays: Mapping[str, np.ndarray]) -> None:
        # Sync uploads are gradients, fedavg uploads weights: either way one array per
        # parameter and running statistic, of its shape and dtype, all finite.
        super().check_update(arrays)

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        assert self.model_ is not None, "setup() first"
        before = self.global_.arrays
        if self.params.mode == "sync":
            # model_ already holds the global weights (set up, stepped or restored here).
            self.model_.sync_step([r.arrays for r in results], [r.n_samples for r in results],
                                  self.params.batch_stats)
            arrays = self.model_.get_arrays()
        else:
            arrays = self.strategy.aggregate(before, results)
        if self.params.tol > 0 or self.params.patience > 0:  # only the stop rule needs it
            names = self.model_.param_names()
            self.changes_.append(relative_change({n: before[n] for n in names},
                                                 {n: arrays[n] for n in names}))
        self.global_ = Payload(self._meta(round_), arrays)
        return self.global_

    def finished(self) -> bool:
        p = self.params
        if p.mode != "sync" or not self.changes_:
            return False
        if p.tol > 0 and self.changes_[-1] < p.tol:
            return True
        if p.patience > 0 and len(self.changes_) > p.patience:
            best = int(np.argmin(self.changes_))
            return len(self.changes_) - 1 - best >= p.patience
        return False

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        if self.model_ is None:
            return {}, {}
        arrays: dict[str, np.ndarray] = {}
        opt = self.model_.optimizer_.state_dict()["state"]
        steps = {}
        for i, st in opt.items():
            arrays[f"adam.{i}.exp_avg"] = st["exp_avg"].cpu().numpy()
            arrays[f"adam.{i}.exp_avg_sq"] = st["exp_avg_sq"].cpu().numpy()
            steps[str(i)] = float(st["step"])
        return {"changes": self.changes_, "adam_steps": steps}, arrays

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        import torch

        self.changes_ = list(meta.get("changes", []))
        vocab = self.setup_info_["vocabulary"]
        self.model_ = self.params.model(self.contextual_size, self.cfg.seed)
        self.model_.initialize(len(vocab)).set_arrays(self.global_.arrays)
        sd = self.model_.optimizer_.state_dict()
        sd["state"] = {int(i): {"step": torch.tensor(s),
                                "exp_avg": torch.as_tensor(arrays[f"adam.{i}.exp_avg"]),
                                "exp_avg_sq": torch.as_tensor(arrays[f"adam.{i}.exp_avg_sq"])}
                       for i, s in meta.get("adam_steps", {}).items()}
        self.model_.optimizer_.load_state_dict(sd)


class CombinedTMServer(ProdLDAServer):
    """Master side of ``model: {family: combinedtm}``: ProdLDA with the sentence embedding
    (all-MiniLM-L6-v2, 384 wide) concatenated to the inference network's input."""

    name = "combinedtm"
    contextual_size = CONTEXT_SIZE

