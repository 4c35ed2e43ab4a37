"""iFTM party (Jiang et al. 2021), worker side: a private local LDA / SentenceLDA sampler that
uploads its topic-wise normalized word–topic matrix and learns from its composed model."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common.config import ClusterConfig, build_params
from common.data.shards import LocalData
from common.data.text import bow_matrix
from common.eval.topics import lda_topic_scores
from common.models.iftm import topic_normalize
from common.models.lda_mh import (
    LDAMH,
    TOPICS,
    Corpus,
    LDAParams,
    corpus_from_texts,
)
from worker.families.base import FitResult
from worker.families.vocabulary import VocabularyClient


class LDAClient(VocabularyClient):
    """Worker side of ``model: {family: lda}`` (and ``sentencelda``).

    Registration sends the local vocabulary (:func:`common.data.text.local_vocabulary`) and the
    document count; the setup brings the agreed vocabulary, over which the worker tokenizes its
    documents (sentence by sentence). Each round's payload is this party's own composed model
    (``"topics"``, k_i x V, rows summing to one; empty in round 1) and ``meta["n_topics"]``.
    The party continues its sampler from its previous state (assignments and its once-drawn
    privacy noise stay) with the composed topics as a word–topic prior
    (β_kw = β + prior_weight · N/k · composed_kw; on the first round with topics, the
    assignment is drawn from them), runs ``sweeps`` MH sweeps, and uploads its word–topic
    counts topic-wise normalized (with β smoothing) as float32 and its token count as
    ``n_samples`` (the merge weight).
    """

    sent_in_the_clear = (*VocabularyClient.sent_in_the_clear,
                         "the word–topic counts, exactly (the Laplace noise is on the "
                         "document–topic counts)")
    name = "lda"
    sentence = False
    #: Uploads are normalized topics of the party's own k, not a delta of what it received.
    compressible = False

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        super().__init__(cfg, data, device, seed)
        self.params: LDAParams = build_params(LDAParams, cfg.family_params,
                                              f"{cfg.source}: model")
        self.train_: Corpus | None = None
        self.test_: Corpus | None = None
        self.model_: LDAMH | None = None

    def setup_vocabulary(self, vocabulary: list[str]) -> None:
        self.train_ = corpus_from_texts(self.train_texts, self.vocabulary_)
        self.test_ = corpus_from_texts(self.test_texts, self.vocabulary_)
        self.reference_ = bow_matrix(self.train_texts, self.vocabulary_)

    @property
    def n_tokens(self) -> int:
        """An update's weight: this party's tokens (the registration counts documents, and
        must say the same at every registration, before and after the setup)."""
        assert self.train_ is not None, "setup() first"
        return max(1, self.train_.n_tokens)

    def local_state(self) -> dict[str, Any]:
        if self.model_ is None:
            return {}
        return {"n_topics": self.model_.n_topics, "model": self.model_.local_state()}

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        self.model_ = None
        if state:
            self.model_ = self.params.model(int(state["n_topics"]), self.sentence, self.seed)
            self.model_.load_local_state(state["model"])

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        assert self.train_ is not None, "setup() first"
        k = int(meta["n_topics"])
        received = np.asarray(arrays[TOPICS], dtype=np.float64)
        if self.model_ is None or self.model_.n_topics != k:
            self.model_ = self.params.model(k, self.sentence, self.seed)
        prior = received if received.shape == (k, self.train_.n_words) else None
        t0 = time.perf_counter()
        self.model_.fit(self.train_, topic_prior=prior)
        train_time = time.perf_counter() - t0
        topics = topic_normalize(self.model_.components_, self.params.beta).astype(np.float32)
        units = len(self.model_.z_)
        return FitResult({TOPICS: topics}, self.n_tokens,
                         {"train_time": train_time, "acceptance": self.model_.acceptance_,
                          "tokens_per_s": self.params.sweeps * self.train_.n_tokens
                          / max(train_time, 1e-9), "n_units": float(units)})

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        return self._evaluate(arrays, reference_texts=None)

    def final_scores(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                     ) -> dict[str, float]:
        return self._evaluate(arrays, reference_texts=self.train_texts)

    def _evaluate(self, arrays: Mapping[str, np.ndarray],
                  reference_texts: Sequence[str] | None) -> dict[str, float]:
        assert self.test_ is not None and self.vocabulary_ is not None, "setup() first"
        topics = np.asarray(arrays[TOPICS], dtype=np.float64)
        if topics.shape[0] == 0:  # round 1: nothing composed yet
            return {"n_topics": 0.0}
        scores = lda_topic_scores(topics, self.test_, self.reference_, self.vocabulary_,
                                  self.params.alpha, self.params.eval_iter, self.seed,
                                  reference_texts)
        # identifies the payload in metrics.jsonl: each party's composed model differs
        scores["payload_fingerprint"] = float(
            (topics * np.arange(1, topics.shape[1] + 1)).sum() / topics.shape[0])
        return scores

    def local_baseline(self) -> dict[str, float]:
        """The same sampler, k and total sweeps (rounds x sweeps) on this party's data alone."""
        assert self.train_ is not None and self.vocabulary_ is not None, "setup() first"
        k = self.model_.n_topics if self.model_ is not None else self.params.n_topics
        model = self.params.model(k, self.sentence, self.seed,
                                  n_iter=self.cfg.rounds * self.params.sweeps,
                                  warm_start=False).fit(self.train_)
        return lda_topic_scores(topic_normalize(model.components_, self.params.beta),
                                self.test_, self.reference_, self.vocabulary_,
                                self.params.alpha, self.params.eval_iter, self.seed,
                                self.train_texts)


class SentenceLDAClient(LDAClient):
    """Worker side of ``model: {family: sentencelda}``: one topic per sentence."""

    name = "sentencelda"
    sentence = True
