"""FedNMF / FedNMF+MI topic model, master side: agree on a vocabulary, start the topics,
aggregate them with the strategy, keep them non-negative."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.aggregate import weighted_average
from common.config import ClusterConfig, build_params
from common.models.nmf import COMPONENTS, MI_STABLE_EPOCHS, NMFParams
from master.families.base import Payload
from master.families.vocabulary import VocabularyServer, agree_vocabulary
from master.strategies import ClientResult, Strategy

log = logging.getLogger("fedctl.master")

#: Most words one worker may put in its registration.


class NMFServer(VocabularyServer):
    """Master side of ``model: {family: nmf}``.

    The pre-training exchange merges the workers' vocabularies
    (:func:`common.data.text.merge_vocabularies`, ``vocab_size`` words in at least ``min_df``
    documents) and draws the initial topics C with ``cfg.seed``, non-negative and scaled to
    the average count the workers reported. The payload is C (``"components"``) and, with
    ``mi_weight`` > 0, the critic (``"critic.*"``). C follows the strategy (FedAvg weighted by
    the workers' document counts, mean pooling, or a FedOpt server optimizer); the critic
    follows ``critic_aggregation`` (below).

    A server optimizer (FedAdagrad, FedYogi, FedAdam) steps along the pseudo-gradient and can
    leave C with negative entries, which NMF does not allow: after aggregation C is projected
    back onto C >= 0 (clipped at 0), as the clients do after every local step.

    The critic is averaged (weighted by the workers' document counts) whatever the strategy,
    unless ``critic_aggregation: strategy``. A FedOpt step moves every coordinate by up to
    about eta (0.1 for FedAdam) per round, while the critic's weights start near
    1/sqrt(V) ~ 0.02: stepped like C, the critic is scrambled every round and its gradients
    then push H anywhere. On 3,000 stackoverflow titles (K = 10, alpha = 1, C = 0.2, 50
    rounds of 2 local epochs, k = 50; benchmarks/results/fednmf_tables_paper_update.md), with
    the paper's update of the MI term, FedAdam+MI with the critic stepped by FedAdam collapsed
    the topics (diversity 0.27, macro-F1 0.54) where the averaged critic kept them (diversity
    0.78, macro-F1 0.77; FedAdam without MI: 0.72, 0.79). With the default
    ``mi_keeps_scale: true`` the scrambled critic can only move weight between a title's
    topics, not grow it, and both critics give 0.79 (benchmarks/results/fednmf_tables.md).
    ``critic_aggregation: local`` sends no critic at all: the payload is C alone and
    each worker keeps the critic it trains, which nearly halves the bytes of a +MI round.
    """

    name = "nmf"
    dp_sgd_refusal = ("its local solver updates the topics from every document's factors at "
                      "once, not by per-document gradient steps")
    client_dp_refusal = None
    secure_aggregation_refusal = None
    client_settings = frozenset({"proximal_mu"})

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        super().__init__(cfg, strategy)
        self.params: NMFParams = build_params(NMFParams, cfg.family_params,
                                              f"{cfg.source}: model")
        p = self.params
        epochs = cfg.rounds * p.local_epochs
        if p.mi_weight > 0 and not p.mi_keeps_scale and epochs > MI_STABLE_EPOCHS:
            log.warning("nmf: %d rounds x %d local epochs with mi_weight %g and the paper's "
                        "update (mi_keeps_scale: false): long training with it grows H and "
                        "shrinks the topics until they collapse, the centralized baseline "
                        "(%d epochs at once) first; the default mi_keeps_scale: true prevents "
                        "it (docs/FEDNMF.md)",
                        cfg.rounds, p.local_epochs, p.mi_weight, epochs)

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        p = self.params
        vocabs = [info["vocabulary"] for info in registrations.values()]
        vocab = agree_vocabulary(registrations, p.vocab_size, p.min_df)
        kept = set(vocab)
        counts = sum(int(tf) for v in vocabs for w, (tf, _) in v.items() if w in kept)
        n_docs = sum(int(info["n_docs"]) for info in registrations.values())
        mean = counts / max(n_docs * len(vocab), 1)
        model = p.model(random_state=self.cfg.seed).initialize(len(vocab), mean)
        self.setup_info_ = {"vocabulary": vocab}
        self.global_ = Payload({}, model.get_arrays(critic=p.critic_travels))
        log.info("nmf: %d words agreed from %d vocabularies, %d topics, MI weight %g, "
                 "%d parameters", len(vocab), len(vocabs), p.n_topics, p.mi_weight,
                 sum(a.size for a in self.global_.arrays.values()))
        return self.global_

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        if self.params.critic_aggregation == "strategy" or len(self.global_.arrays) == 1:
            arrays = self.strategy.aggregate(self.global_.arrays, results)
        else:
            # The strategy steps the topics; the critic is averaged (see the class notes).
            arrays = self.strategy.aggregate(
                {COMPONENTS: self.global_.arrays[COMPONENTS]},
                [ClientResult(r.worker_id, {COMPONENTS: r.arrays[COMPONENTS]}, r.n_samples)
                 for r in results])
            arrays.update(weighted_average(
                [{k: v for k, v in r.arrays.items() if k != COMPONENTS} for r in results],
                [r.n_samples for r in results]))
        arrays[COMPONENTS] = np.maximum(arrays[COMPONENTS], 0)  # FedOpt may step below 0
        self.global_ = Payload(self.global_.meta, arrays)
        return self.global_

