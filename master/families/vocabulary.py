"""The vocabulary-consensus half of the pre-training exchange, shared by the topic-model families
(nmf, prodlda/combinedtm, lda/sentencelda): each worker registers its local vocabulary with term
and document frequencies; the master checks it and merges them into the agreed vocabulary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common import constants as C
from common.config import ConfigError
from common.data.shards import LocalData
from common.data.text import MAX_WORD, merge_vocabularies, vocabulary_info
from common.net import errors
from common.net.wire import ProtocolError
from master.families.base import ServerFamily

#: Most distinct words a worker may register (a large English corpus has a few hundred
#: thousand; the cap keeps a registration's header cheap to decode, MAX_HEADER_CONTAINERS).
MAX_LOCAL_WORDS = 300_000


def check_vocabulary_info(info: Mapping[str, Any]) -> None:
    """Refuse a registration whose ``vocabulary`` / ``n_docs`` a merge could not use."""
    vocab, n_docs = info.get("vocabulary"), info.get("n_docs")
    if (not isinstance(n_docs, int) or isinstance(n_docs, bool)
            or not 0 <= n_docs <= C.MAX_SAMPLES):
        raise ProtocolError("register.info.n_docs: expected a document count",
                            code=errors.BAD_FIELD)
    if not isinstance(vocab, dict) or len(vocab) > MAX_LOCAL_WORDS:
        raise ProtocolError("register.info.vocabulary: expected a map word -> "
                            "[term_freq, doc_freq]", code=errors.BAD_FIELD)
    for word, freqs in vocab.items():
        if (not isinstance(word, str) or not 0 < len(word) <= MAX_WORD
                or not isinstance(freqs, (list, tuple)) or len(freqs) != 2
                or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 0
                           for f in freqs)):
            raise ProtocolError(f"register.info.vocabulary[{str(word)[:40]!r}]: expected "
                                "[term_freq, doc_freq], two counts", code=errors.BAD_FIELD)
        if not word.isprintable() or any(ch.isspace() for ch in word):
            # Words reach terminals (`fedctl topics`), logs and files: a tokenizer's words are
            # one printable run; escapes and line breaks would forge or clear what users read.
            raise ProtocolError(f"register.info.vocabulary[{word[:40]!r}]: a word is one run "
                                "of printable characters", code=errors.BAD_FIELD)
        tf, df = freqs
        # Counts the declared documents could hold: a word is in at most n_docs of them, and
        # in each of those at most C.MAX_TERM_PER_DOC times.
        if not (df <= n_docs and df <= tf <= df * C.MAX_TERM_PER_DOC):
            raise ProtocolError(f"register.info.vocabulary[{word[:40]!r}]: counts {tf}, {df} "
                                f"cannot come from {n_docs} documents", code=errors.BAD_FIELD)


def agree_vocabulary(registrations: Mapping[str, Mapping[str, Any]], max_size: int | None,
                     min_df: int) -> list[str]:
    """The agreed vocabulary (see :func:`common.data.text.merge_vocabularies`).

    Raises
    ------
    ProtocolError
        ``rejected`` when no word survives ``min_df``.
    """
    vocabs = [info["vocabulary"] for info in registrations.values()]
    vocab = merge_vocabularies(vocabs, max_size=max_size, min_df=min_df)
    if not vocab:
        raise ProtocolError(f"no word is in {min_df} or more of the workers' documents",
                            code=errors.REJECTED)
    return vocab


class VocabularyServer(ServerFamily):
    """A master half whose setup agrees on a vocabulary (``self.params`` has ``vocab_size`` and
    ``min_df``): registrations carry a local vocabulary, and ``fedctl check`` makes sure one
    survives the filters before anything starts."""

    params: Any
    info_fields = frozenset({"vocabulary", "n_docs"})

    def check_info(self, info: Mapping[str, Any]) -> None:
        check_vocabulary_info(info)

    def declared_documents(self, info: Mapping[str, Any]) -> tuple[str, float] | None:
        # The word counts are bounded by n_docs: 10 documents passed for 10^9 put 2,000
        # made-up words first in the agreed vocabulary.
        return "n_docs", info["n_docs"]

    def check_shards(self, shards: Mapping[str, LocalData]) -> None:
        """The merge the setup will do, on the workers' training texts: an agreed vocabulary
        that is empty is a one-line error naming ``model.min_df``."""
        infos = [vocabulary_info(s.train_texts)["vocabulary"] for s in shards.values()]
        if not merge_vocabularies(infos, max_size=self.params.vocab_size,
                                  min_df=self.params.min_df):
            raise ConfigError(f"{self.cfg.source}: model.min_df: no word is in "
                              f"{self.params.min_df} or more of the workers' training "
                              f"documents, so the agreed vocabulary would be empty")
