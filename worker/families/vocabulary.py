"""The worker half shared by the families that count words over an agreed vocabulary (nmf,
prodlda / combinedtm, lda / sentencelda): each registers its local vocabulary and takes the
cluster's agreed one from the setup (the master half: :mod:`master.families.vocabulary`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.config import ClusterConfig
from common.data.shards import LocalData
from common.data.text import vocabulary_info
from worker.families.base import ClientFamily


class VocabularyClient(ClientFamily):
    """A worker half over word counts: :meth:`setup_vocabulary` builds what the family needs
    from the agreed vocabulary (its count matrices, corpora, model)."""

    sent_in_the_clear = ("each worker's vocabulary, every word with its term and document "
                         "counts",)

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        super().__init__(cfg, data, device, seed)
        self.train_texts, self.test_texts = data.train_texts, data.test_texts
        self.vocabulary_: list[str] | None = None

    def registration_info(self) -> dict[str, Any]:
        return vocabulary_info(self.train_texts)

    def setup(self, setup: Mapping[str, Any]) -> None:
        self.vocabulary_ = list(setup["vocabulary"])
        self.setup_vocabulary(self.vocabulary_)

    def setup_vocabulary(self, vocabulary: list[str]) -> None:
        """Build the family's state over the agreed ``vocabulary`` (in the setup)."""
