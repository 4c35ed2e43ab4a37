"""Federated neural topic models (gFedNTM), master side: ProdLDA and CombinedTM.

Stage 1, vocabulary consensus: the workers' vocabularies with term and document frequencies
are merged (:func:`common.data.text.merge_vocabularies`: union, frequencies weighted by the number
of workers holding a word, ``vocab_size`` cap, ``min_df``); the master builds the network with
``cfg.seed`` and sends the agreed vocabulary once (``setup_info_``) and the initial weights.

Stage 2, ``mode: sync``: a round of the cluster is one synchronous mini-batch step. The payload
is the global weights (and batch-norm running statistics); each worker uploads the gradient of
its own batch's mean loss, named like the parameters, plus the running statistics its batch
moved. The master averages the gradients weighted by batch size, merges the running statistics
into those of the union of the workers' batches
(:meth:`common.models.ntm.NeuralTopicModel.merge_running_stats`), takes one Adam step on its
own copy and publishes the new weights. With ``sync_batch_norm`` (the default) batch norm
runs over the union of the workers' batches and a step takes five rounds, the phases of
:mod:`common.models.ntm_sync_bn`: the master merges what the workers upload in each
(:class:`~common.models.ntm_sync_bn.SyncBNReducer`) and keeps the step's participants for all
five; a step a participant drops out of, or abstains from, is redone from its first phase at
the same weights. ``mode: fedavg``: ordinary rounds of local epochs aggregated by the
configured strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from common.aggregate import weighted_average
from common.config import ClusterConfig, ConfigError, build_params
from common.models import ntm_secure
from common.models.ntm import (
    CONTEXT_SIZE,
    NeuralTopicModel,
    NTMParams,
    relative_change,
)
from common.models.ntm_sync_bn import ABSTAIN, N_PHASES, SyncBNReducer
from common.models.optim_copy import OptimizerCopy
from common.net import errors
from common.net.wire import ProtocolError
from master.families.base import Payload, check_arrays
from master.families.vocabulary import VocabularyServer, agree_vocabulary
from master.screening import aggregate_problem, largest_value
from master.strategies import ClientResult, Strategy
from master.strategies.fedopt import FedOpt

log = logging.getLogger("fedctl.master")

#: A synchronous run whose steps keep being redone stops after this many times ``rounds``.
MAX_ROUNDS_PER_BUDGET = 2
#: How a batch norm's running variance is named among the arrays (``<layer>.running_var``).
RUNNING_VAR = ".running_var"
PRIOR_VARIANCE = "prior_variance"
#: The least variance an aggregate's learned prior keeps (its logarithm is in the KL term).
PRIOR_VARIANCE_FLOOR = 1e-4


def _variances_clamped(arrays: Mapping[str, np.ndarray], weights: bool = False
                       ) -> dict[str, np.ndarray]:
    """``arrays`` with every running variance at least zero and, where they are the model's
    ``weights`` (not a step's gradients), the prior's variance at least
    ``PRIOR_VARIANCE_FLOOR`` (an aggregate's, not an upload's: a rounding, a server optimizer's
    step or DP-FedAvg's noise may take an honest one below; a prior variance of -0.25 made every
    score NaN and every document one topic)."""
    def floor(name: str) -> float | None:
        return 0.0 if name.endswith(RUNNING_VAR) else (
            PRIOR_VARIANCE_FLOOR if weights and name == PRIOR_VARIANCE else None)

    return {k: a if (f := floor(k)) is None else np.maximum(a, f, dtype=a.dtype)
            for k, a in arrays.items()}


class ProdLDAServer(VocabularyServer):
    """Master side of ``model: {family: prodlda}`` (see the module docstring).

    The relative change of the weights ``||w_t - w_{t-1}|| / ||w_{t-1}||`` is kept per step;
    :meth:`finished` stops a synchronous run when it falls below ``tol`` or has not reached a
    new minimum for ``patience`` steps. Every ``eval_every`` steps, and at the last, the
    payload's ``meta`` asks the workers to score the model (``{"evaluate": true}``).
    """

    name = "prodlda"
    dp_sgd_refusal = ("its batch norm mixes the documents of a batch, so no document has a "
                      "gradient of its own to clip")
    client_dp_refusal = None
    secure_aggregation_refusal = None

    client_settings = frozenset({"proximal_mu"})
    contextual_size = 0
    compression_refusal = ("its workers send gradients, batch statistics or weights "
                           "uncompressed")

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        super().__init__(cfg, strategy)
        self.params: NTMParams = build_params(NTMParams, cfg.family_params,
                                              f"{cfg.source}: model")
        if self.params.mode == "sync" and strategy.name != "fedavg":
            # Neither a server strategy nor a client one (FedProx's local term) has anything
            # to act on: it used to be ignored without a word.
            raise ConfigError(f"{cfg.source}: strategy: {strategy.name} would not be used in "
                              f"mode sync: the master takes one Adam step on the union's "
                              f"gradient each step; remove `strategy`, or use model.mode: "
                              f"fedavg")
        if self.params.mode == "sync" and cfg.privacy.client_dp is not None:
            raise ConfigError(f"{cfg.source}: privacy.client_dp: mode sync uploads one step's "
                              f"gradients, not a model FedAvg averages: use model.mode: fedavg")
        per_step = self.params.rounds_per_step
        if cfg.rounds < per_step:  # the run would end having trained nothing
            raise ConfigError(f"{cfg.source}: rounds: {cfg.rounds} round(s) cannot complete one "
                              f"synchronized step of {self.name}, which takes {per_step} rounds "
                              f"(set rounds to at least {per_step}, or model.mode: fedavg)")
        if cfg.rounds % per_step:
            steps = cfg.rounds // per_step
            self.notes.append(f"rounds {cfg.rounds} is not a multiple of {per_step} (rounds per "
                              f"synchronized step of {self.name}): the run stops after "
                              f"{steps} step(s), {steps * per_step} rounds")
        self.model_: NeuralTopicModel | None = None
        self._adam_copy = OptimizerCopy()  # the savepoint's, reused step after step
        self.changes_: list[float] = []
        self.steps_ = 0  # steps completed (one a round unless the batch norm is synchronized)
        self.phase_ = 0  # of the step under way, with sync_batch_norm
        self.step_workers_: list[str] = []  # who took part in its phase 0, in worker order
        self.step_sizes_: list[int] = []  # their batch sizes
        self.reducer_: SyncBNReducer | None = None
        self.step_start_: dict[str, np.ndarray] = {}  # the weights the step started from
        self.step_round_ = 1  # the round the step under way began in (its phase 0)
        #: The run's budget, in steps: a step redone after a dropout costs none of it.
        self.total_steps = cfg.rounds // per_step

    # ------------------------------------------------------------------ secure rounds
    @classmethod
    def secure_clip_text(cls, params: Mapping[str, Any], clip: float) -> str:
        if params.get("mode", "sync") != "sync":
            return super().secure_clip_text(params, clip)
        return ("the synchronous steps' sums in a 64-bit ring, clipped by phase "
                "(common/models/ntm_secure.py)")

    def _secure_phase(self) -> int:
        """The round's phase in :mod:`common.models.ntm_secure`'s terms."""
        return self.phase_ if self.params.synced_batch_norm else ntm_secure.STEP

    def secure_kind(self) -> int | None:
        # (two phases' sums can have one length: with V = 2T, 1 + 4T and 1 + 2V)
        return self._secure_phase() if self.params.mode == "sync" else None

    def secure_ring(self, bits: int) -> tuple[int, float]:
        # A synchronous step's sums go in the 64-bit ring, clipped by phase (ntm_secure).
        if self.params.mode != "sync":
            return super().secure_ring(bits)
        return ntm_secure.RING_BITS, ntm_secure.CLIPS[self._secure_phase()]

    def secure_size(self) -> int:
        if self.params.mode != "sync":
            return super().secure_size()
        assert self.model_ is not None
        return ntm_secure.vector_size(self.model_, self._secure_phase(), self.params.batch_stats)

    def secure_result(self, total: np.ndarray, n_max: int, members: int,
                      weights_sent: float | None = None, tolerance: float = 0.0
                      ) -> dict[str, np.ndarray]:
        if self.params.mode != "sync":
            out = super().secure_result(total, n_max, members, weights_sent, tolerance)
        else:
            assert self.model_ is not None
            # Each member's terms are clipped to the phase's range: a sum past what they can
            # make was a ring value past the top level, wrapped (one member's gradient of 2.5e7
            # a coordinate where the clip is 4,096).
            clip = ntm_secure.CLIPS[self._secure_phase()]
            largest = largest_value({"sum": total})
            if largest > members * clip * (1 + tolerance):
                raise ValueError(f"a value of the secure sum is {largest:.4g}, past the "
                                 f"{members * clip:.4g} that {members} members clipped to "
                                 f"{clip:g} can send: a member's input was forged")
            out = ntm_secure.read_sum(self.model_, self._secure_phase(), total,
                                      self.params.batch_stats)
        # The ring's rounding (16 bits with float16 or int8 compression: about 4e-4 at clip 8)
        # can take honest small variances below zero; only a single upload's are refused.
        return _variances_clamped(out)

    def secure_refused(self) -> None:
        # The workers have gone past the refused phase (its state is spent): asked for it
        # again, every one abstained, was counted for it, and all were excluded. The step
        # starts again, as after a dropout.
        if self.params.mode == "sync" and self.phase_ > 0:
            log.warning("step %d: its secure sum in phase %d was refused; redoing the step",
                        self.steps_ + 1, self.phase_)
            self._start_step()

    def secure_distance(self, result: Mapping[str, np.ndarray]) -> float | None:
        # A step's gradient: Adam's step is bounded by lr however large it is, and its moments
        # keep a forged one for thousands of steps (attack review: every weight then moved the
        # way one member's single step at the clip pushed it).
        if self.params.mode != "sync" or self._secure_phase() not in (4, ntm_secure.STEP):
            return None
        assert self.model_ is not None
        return float(np.sqrt(sum(float(np.sum(np.square(result[n], dtype=np.float64)))
                                 for n in self.model_.param_names())))

    def trained(self, version: int) -> dict[str, int]:
        return {"steps": self.steps_, "rounds": version}

    def budget_spent(self, round_: int) -> bool:
        if self.params.mode != "sync":
            return super().budget_spent(round_)
        # Steps redone after dropouts take rounds beyond `rounds`; not without end, though.
        return (self.steps_ >= self.total_steps
                or round_ >= MAX_ROUNDS_PER_BUDGET * self.cfg.rounds)

    def base_round(self, round_: int) -> int:
        # A step's first phase builds on the workers' state at the step's start, also when the
        # step is redone (they go back there and draw the same mini-batches again); its later
        # phases on the phase before.
        if self.reducer_ is not None and self.phase_ == 0:
            return self.step_round_ - 1
        return round_ - 1

    def resume_base(self, round_: int) -> int:
        # A resumed master redoes a step its checkpoint caught midway from the step's start.
        return self.step_round_ - 1 if self.reducer_ is not None else round_ - 1

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        p = self.params
        vocab = agree_vocabulary(registrations, p.vocab_size, p.min_df)
        self.model_ = p.model(self.contextual_size, self.cfg.seed).initialize(len(vocab))
        if p.mode == "sync":  # its Adam (torch's compiler import, ~1 s) now, at set-up, not in
            self.model_.optimizer_.zero_grad()  # round 1's timed aggregation
        self.setup_info_ = {"vocabulary": vocab, "contextual_size": self.contextual_size}
        self._start_step(round_=1)
        log.info("%s: %d words agreed from %d vocabularies, %d topics, mode %s%s, %d parameters",
                 self.name, len(vocab), len(registrations), p.n_topics, p.mode,
                 f", batch norm over the union batch ({N_PHASES} rounds a step)"
                 if p.synced_batch_norm else "",
                 sum(a.size for a in self.global_.arrays.values()))
        return self.global_

    def _meta(self) -> dict[str, Any]:
        """``step``: steps completed; ``evaluate``: whether workers score this payload (the
        weights that step ``step + 1`` starts from); ``phase`` with a synchronized batch norm."""
        p = self.params
        last = self.steps_ + 1 >= self.total_steps or self.finished()
        ev = p.mode == "fedavg" or self.steps_ % p.eval_every == 0 or last
        meta: dict[str, Any] = {"step": self.steps_, "evaluate": bool(ev)}
        if p.synced_batch_norm:
            meta["phase"] = 0
        return meta

    def _start_step(self, weights: dict[str, np.ndarray] | None = None,
                    round_: int | None = None) -> Payload:
        """Publish the weights (``model_``'s, unless already read out as ``weights``): the
        first phase of a step (or the whole of it), in round ``round_`` (None: the step under
        way, started again)."""
        assert self.model_ is not None
        if round_ is not None:
            self.step_round_ = round_
        self.phase_, self.step_workers_, self.step_sizes_ = 0, [], []
        if self.params.synced_batch_norm and self.reducer_ is None:
            # One for the run: phases 0 and 1 of every step rewrite what its phase 4 reads.
            self.reducer_ = SyncBNReducer(self.model_)
        self.global_ = Payload(self._meta(),
                               self.model_.get_arrays() if weights is None else weights)
        self.step_start_ = self.global_.arrays
        return self.global_

    def participants(self) -> list[str] | None:
        # A synchronized step's later phases go to the workers that began it.
        return list(self.step_workers_) if self.phase_ > 0 else None

    def abstained(self, result: ClientResult) -> bool:
        return ABSTAIN in result.arrays

    def check_update(self, arrays: Mapping[str, np.ndarray]) -> None:
        # Sync uploads are gradients, fedavg uploads weights: either way one array per
        # parameter and running statistic, of its shape and dtype, all finite. With a
        # synchronized batch norm each phase has its own arrays (or the abstention).
        if self.reducer_ is None:
            super().check_update(arrays)
            # A variance below zero passes every other check, and a batch norm that averages
            # it in gives NaN on every worker that evaluates the model.
            for name, a in arrays.items():
                if name.endswith(RUNNING_VAR) and (a < 0).any():
                    raise ProtocolError(f"array {name!r} (a variance) holds negative values",
                                        code=errors.REJECTED)
        elif set(arrays) == {ABSTAIN}:
            check_arrays(arrays, {ABSTAIN: ((0,), np.dtype(np.float64))})  # empty, as sent
        else:
            check_arrays(arrays, self.reducer_.expected_upload(self.phase_))
            if "m2" in arrays and (arrays["m2"] < 0).any():  # a sum of squares
                raise ProtocolError("array 'm2' (a sum of squares) holds negative values",
                                    code=errors.REJECTED)

    def savepoint(self) -> Callable[[], None]:
        back = super().savepoint()
        fields = {k: getattr(self, k) for k in ("steps_", "phase_", "step_workers_",
                                                "step_sizes_", "step_start_", "step_round_")}
        n_changes = len(self.changes_)  # only ever appended to: no copy a round
        reducer = self.reducer_
        stats = None if reducer is None else (reducer.enc_, reducer.dec_)  # replaced, not edited
        model = None
        if self.model_ is not None and self.params.mode == "sync" and (
                reducer is None or self.phase_ == N_PHASES - 1):
            # This round steps Adam: the weights, running statistics and moments it moves.
            model = (self.model_.get_arrays(), self._adam_copy.take(self.model_.optimizer_))

        def restore() -> None:
            back()
            for k, v in fields.items():
                setattr(self, k, v)
            del self.changes_[n_changes:]
            self.reducer_ = reducer
            if reducer is not None and stats is not None:
                reducer.enc_, reducer.dec_ = stats
            if model is not None and self.model_ is not None:
                self.model_.set_arrays(model[0])
                model[1]()

        return restore

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        assert self.model_ is not None, "setup() first"
        if self.reducer_ is not None:
            return self._aggregate_phase(round_, results)
        before = self.global_.arrays
        if self.params.mode == "sync" and results and results[0].members:
            # A secure sum: already the step's update (common/models/ntm_secure.py).
            self.model_.apply_gradients(results[0].arrays)
            arrays = self.model_.get_arrays()
        elif self.params.mode == "sync":
            # model_ already holds the global weights (set up, stepped or restored here).
            self.model_.sync_step([r.arrays for r in results], [r.n_samples for r in results],
                                  self.params.batch_stats)
            arrays = self.model_.get_arrays()
        else:
            arrays = self.strategy.aggregate(before, results)
            if isinstance(self.strategy, FedOpt):
                # Batch norm's running statistics are measurements, not weights: stepped by
                # FedAdam as if they were, the decoder's variances went from 4e-4 to 0.77 and
                # the perplexity to 1e11. They are the workers' average.
                names = [n for n in self.model_.buffer_names() if n in arrays]
                arrays.update(weighted_average([{n: r.arrays[n] for n in names} for r in results],
                                               [r.n_samples for r in results]))
            # A server optimizer's step, or DP-FedAvg's noise, may take a variance past zero.
            arrays = _variances_clamped(arrays, weights=True)
        if self.params.tol > 0 or self.params.patience > 0:  # only the stop rule needs it
            names = self.model_.param_names()
            self.changes_.append(relative_change({n: before[n] for n in names},
                                                 {n: arrays[n] for n in names}))
        self.steps_ += 1
        self.global_ = Payload(self._meta(), arrays)
        return self.global_

    def _aggregate_phase(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        """One phase of a synchronized-batch-norm step (see the module docstring)."""
        assert self.model_ is not None and self.reducer_ is not None
        # A secure round gives one result, the sum of its members' uploads, and who of them
        # abstained (they say so in the clear).
        secure = bool(results) and bool(results[0].members)
        who = list(results[0].members) if secure else [r.worker_id for r in results]
        abstained = (list(results[0].abstained) if secure
                     else [r.worker_id for r in results if ABSTAIN in r.arrays])
        if self.phase_ > 0 and (abstained or who != self.step_workers_):
            gone = sorted(set(self.step_workers_) - set(who)) + abstained
            log.warning("step %d: %s dropped out in phase %d; redoing the step", self.steps_ + 1,
                        ", ".join(gone), self.phase_)
            return self._start_step()
        if self.phase_ == 0:
            kept = [r for r in results if ABSTAIN not in r.arrays and not r.abstained]
            if not kept:
                return self._start_step(round_=round_ + 1)
            self.step_workers_ = who if secure else [r.worker_id for r in kept]
            self.step_sizes_ = [r.n_samples for r in kept]
            results = kept
        out = self.reducer_.reduce(self.phase_, [r.arrays for r in results], self.step_sizes_)
        if self.phase_ in (0, 1):
            # Each phase's aggregate is only checked for NaN (its arrays are not the model's):
            # the running statistics these moments move are held to the growth limit here,
            # where the members' own moments are still at hand to find one far off.
            problem = aggregate_problem(*self.reducer_.running_stats_move(self.phase_))
            if problem is not None:
                raise ValueError(f"step {self.steps_ + 1}, phase {self.phase_}: the batch "
                                 f"norms' running statistics: {problem}")
        self.phase_ += 1
        if self.phase_ < N_PHASES:
            if self.budget_spent(round_):  # the rounds' hard cap ends it mid-step
                log.info("the last round ended step %d in phase %d: it is dropped",
                         self.steps_ + 1, self.phase_)
                return self._start_step()
            self.global_ = Payload({"step": self.steps_, "phase": self.phase_,
                                    "evaluate": False}, out)
            return self.global_
        # The step as a whole is held to the growth limit too (the gradients' phase alone would
        # be compared with the statistics it replaces, not with the model).
        problem = aggregate_problem(self.step_start_, out)
        if problem is not None:
            raise ValueError(f"step {self.steps_ + 1}: {problem}")
        if self.params.tol > 0 or self.params.patience > 0:
            names = self.model_.param_names()
            start = self.step_start_
            self.changes_.append(relative_change({n: start[n] for n in names},
                                                 {n: out[n] for n in names}))
        self.steps_ += 1
        # The reducer's last phase returned the new weights.
        return self._start_step(out, round_=round_ + 1)

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
        # Only a synchronous run steps the master's optimizer (a fedavg run never builds it).
        opt = self.model_.optimizer_.state_dict()["state"] if self.params.mode == "sync" else {}
        steps = {}
        for i, st in opt.items():
            # Copies: on the CPU .numpy() shares the tensor's memory, which Adam updates in
            # place, and the checkpoint writer's thread serializes this after later steps.
            arrays[f"adam.{i}.exp_avg"] = st["exp_avg"].cpu().numpy().copy()
            arrays[f"adam.{i}.exp_avg_sq"] = st["exp_avg_sq"].cpu().numpy().copy()
            steps[str(i)] = float(st["step"])
        if self.phase_ > 0:  # mid-step, the payload is statistics: keep the weights too
            arrays.update({f"weights.{n}": a for n, a in self.model_.get_arrays().items()})
        return {"changes": list(self.changes_), "adam_steps": steps, "steps": self.steps_,
                "step_round": self.step_round_}, arrays

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        import torch

        self.changes_ = list(meta.get("changes", []))
        self.steps_ = int(meta.get("steps", 0))
        self.step_round_ = int(meta.get("step_round", 1))
        vocab = self.setup_info_["vocabulary"]
        self.model_ = self.params.model(self.contextual_size, self.cfg.seed)
        self.reducer_ = None  # rebuilt on the restored model
        weights = {n[len("weights."):]: a for n, a in arrays.items() if n.startswith("weights.")}
        self.model_.initialize(len(vocab)).set_arrays(weights or self.global_.arrays)
        if meta.get("adam_steps"):
            sd = self.model_.optimizer_.state_dict()
            sd["state"] = {int(i): {"step": torch.tensor(s),
                                    "exp_avg": torch.as_tensor(arrays[f"adam.{i}.exp_avg"]),
                                    "exp_avg_sq": torch.as_tensor(arrays[f"adam.{i}.exp_avg_sq"])}
                           for i, s in meta["adam_steps"].items()}
            self.model_.optimizer_.load_state_dict(sd)
        # A step the checkpoint caught mid-way is redone: its statistics were not kept.
        self._start_step()


class CombinedTMServer(ProdLDAServer):
    """Master side of ``model: {family: combinedtm}``: ProdLDA with the sentence embedding
    (all-MiniLM-L6-v2, 384 wide) concatenated to the inference network's input."""

    name = "combinedtm"
    contextual_size = CONTEXT_SIZE
    embeds_text = True

