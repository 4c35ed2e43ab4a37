"""iFTM master (Jiang et al. 2021): agree on a vocabulary, merge the parties' heterogeneous
topic models (Alg. 3) and compose each party's own new model (Alg. 4)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.config import ClusterConfig, build_params
from common.models.iftm import compose, merge_models
from common.models.lda_mh import TOPICS, LDAParams
from common.net import errors
from common.net.wire import ProtocolError
from master.families.base import Payload
from master.families.vocabulary import VocabularyServer, agree_vocabulary
from master.strategies import ClientResult, Strategy

log = logging.getLogger("fedctl.master")

#: Most words one worker may put in its registration; most topics one party may upload.
MAX_TOPICS = 1000
#: Tolerance on the row sums of an uploaded topic-wise normalized matrix (float32 sums).
ROW_SUM_TOL = 1e-3


class LDAServer(VocabularyServer):
    """Master side of ``model: {family: lda}`` (and ``sentencelda``).

    ``setup`` merges the vocabularies (:func:`common.data.text.merge_vocabularies`) and fixes each
    party's number of topics (``topics_per_worker`` in sorted worker-id order, else
    ``n_topics``). Every round each party uploads k_i normalized topics; ``aggregate`` merges
    the round's uploads into the global model weighted by the parties' token counts (Alg. 3,
    ``global_``, what ``model.npz`` holds) and composes each party's own model (Alg. 4), which
    :meth:`payload_for` sends to that party only. A party that did not report this round keeps
    its last composed model. The strategy from cluster.yaml is not used: iFTM's merge replaces
    it.
    """

    name = "lda"
    #: A topic per sentence (SentenceLDA), not per word.
    sentence = False
    dp_sgd_refusal = "Gibbs sampling takes no gradients: its privacy is privacy.laplace"
    client_dp_refusal = "iFTM's merge is no average: its privacy is privacy.laplace"
    own_rule = "iFTM's merge composes the workers' topics"
    compression_refusal = "its uploads are topics of each party's own, not a change of the model"
    per_worker = True
    # Each upload is a worker's own topics, rows of the simplex (check_update), built on the
    # model the merge composed for it from the others' topics: one member's topics rewrote an
    # honest member's composed model, whose own topics were then left out as far from it
    # round after round, which kept it from ever being composed again.
    distance_screened = False

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        super().__init__(cfg, strategy)
        self.params: LDAParams = build_params(LDAParams, cfg.family_params,
                                              f"{cfg.source}: model")
        self.n_topics_: dict[str, int] = {}
        self.composed_: dict[str, np.ndarray] = {}
        self.n_words_ = 0

    def _topics_for(self, wid: str) -> int:
        names = sorted({w.name for w in self.cfg.workers} | set(self.n_topics_) | {wid})
        per = self.params.topics_per_worker
        i = names.index(wid)
        return per[i] if i < len(per) else self.params.n_topics

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        p = self.params
        vocab = agree_vocabulary(registrations, p.vocab_size, p.min_df)
        self.n_words_ = len(vocab)
        self.setup_info_ = {"vocabulary": vocab}
        for wid in sorted(registrations):
            self.n_topics_[wid] = self._topics_for(wid)
            self.composed_[wid] = np.zeros((0, self.n_words_), dtype=np.float32)
        self.global_ = Payload({"n_topics": 0}, {TOPICS: np.zeros((0, self.n_words_),
                                                                  dtype=np.float32)})
        log.info("%s: %d words agreed from %d vocabularies; topics per party %s", self.name,
                 len(vocab), len(registrations), self.n_topics_)
        return self.global_

    def admit(self, worker_id: str, info: Mapping[str, Any]) -> None:
        if worker_id not in self.n_topics_:  # a late joiner starts from scratch
            self.n_topics_[worker_id] = self._topics_for(worker_id)
            self.composed_[worker_id] = np.zeros((0, self.n_words_), dtype=np.float32)

    def max_weight(self, n_samples: int, info: Mapping[str, Any]) -> int:
        # Updates are weighed by tokens: at most the occurrences of the words registered.
        return max(1, sum(int(tf) for tf, _ in info.get("vocabulary", {}).values()))

    def payload_for(self, worker_id: str) -> Payload:
        if worker_id not in self.composed_:
            return self.global_
        return Payload({"n_topics": self.n_topics_[worker_id], "worker": worker_id},
                       {TOPICS: self.composed_[worker_id]})

    def check_update(self, arrays: Mapping[str, np.ndarray]) -> None:
        if set(arrays) != {TOPICS}:
            raise ProtocolError(f"expected exactly the array {TOPICS!r}, got {sorted(arrays)}",
                                code=errors.SHAPE)
        a = arrays[TOPICS]
        if a.dtype != np.float32:
            raise ProtocolError(f"{TOPICS}: dtype {a.dtype}, expected float32", code=errors.DTYPE)
        if a.ndim != 2 or a.shape[1] != self.n_words_ or not 1 <= a.shape[0] <= MAX_TOPICS:
            raise ProtocolError(f"{TOPICS}: shape {a.shape}, expected (k, {self.n_words_}) "
                                f"with 1 <= k <= {MAX_TOPICS}", code=errors.SHAPE)
        if not np.isfinite(a).all():
            raise ProtocolError(f"{TOPICS} holds NaN or Inf", code=errors.NOT_FINITE)
        if (a < 0).any():
            raise ProtocolError(f"{TOPICS}: negative entries", code=errors.REJECTED)
        sums = a.sum(axis=1, dtype=np.float64)
        if np.abs(sums - 1).max() > ROW_SUM_TOL:
            raise ProtocolError(f"{TOPICS}: rows must sum to 1 (topic-wise normalized), "
                                f"found sums in [{sums.min():.4g}, {sums.max():.4g}]",
                                code=errors.REJECTED)

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        p = self.params
        # Each party trains the number of topics it was given (check_update cannot know
        # whose update it reads): more would weigh its own in the merge and model.npz.
        odd = [r.worker_id for r in results
               if r.arrays[TOPICS].shape[0] != self.n_topics_.get(r.worker_id)]
        if odd:
            log.warning("round %d: %s sent another number of topics than it was given: left "
                        "out of the merge", round_, ", ".join(odd))
            results = [r for r in results if r.worker_id not in odd]
            if not results:
                raise ProtocolError("no update has the number of topics its party was given",
                                    code=errors.REJECTED)
        models = [np.asarray(r.arrays[TOPICS], dtype=np.float64) for r in results]
        merged, _ = merge_models(models, [r.n_samples for r in results], p.xi, p.top_l)
        replaced = {}
        for r, m in zip(results, models, strict=True):
            composed, match = compose(m, merged, p.xi, p.top_l)
            self.composed_[r.worker_id] = composed.astype(np.float32)
            replaced[r.worker_id] = int((match >= 0).sum())
        self.global_ = Payload({"n_topics": int(merged.shape[0])},
                               {TOPICS: merged.astype(np.float32)})
        log.info("round %d: %d local topics merged into %d global ones; replaced per party %s",
                 round_, sum(m.shape[0] for m in models), merged.shape[0], replaced)
        return self.global_

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        order = sorted(self.composed_)
        meta = {"workers": order, "n_topics": dict(self.n_topics_), "n_words": self.n_words_}
        return meta, {f"composed_{i}": self.composed_[w] for i, w in enumerate(order)}

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        self.n_topics_ = {str(w): int(k) for w, k in meta.get("n_topics", {}).items()}
        self.n_words_ = int(meta.get("n_words", 0))
        self.composed_ = {w: np.array(arrays[f"composed_{i}"], dtype=np.float32)
                          for i, w in enumerate(meta.get("workers", []))}


class SentenceLDAServer(LDAServer):
    """Master side of ``model: {family: sentencelda}`` (the same merge and composition)."""

    name = "sentencelda"
    sentence = True
