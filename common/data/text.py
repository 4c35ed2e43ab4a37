"""Bags of words for topic models: tokenization, local vocabularies, merging, count matrices.

Every topic-model family tokenizes the same way, through scikit-learn's ``CountVectorizer``:
lowercase, English stop words removed, tokens are words of at least two letters (no digits or
underscores). A federated job agrees on one vocabulary before training:

1. each worker sends :func:`local_vocabulary` of its own documents (word -> term and document
   frequency) with its registration;
2. the master :func:`merge_vocabularies` into one ordered word list;
3. each worker builds :func:`bow_matrix` of its documents over that list.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import CountVectorizer

from common import constants as C

__all__ = ["MAX_WORD", "TOKEN_PATTERN", "make_vectorizer", "local_vocabulary", "merge_vocabularies",
           "bow_matrix"]

#: Longest word, in letters: a longer run of letters (dbpedia holds some of 100+) is no word,
#: and a registration carrying one is refused (master/families/vocabulary.py).
MAX_WORD = 100
#: Words of 2 to MAX_WORD letters: ``[^\W\d_]`` is a letter in any script.
TOKEN_PATTERN = rf"(?u)\b[^\W\d_]{{2,{MAX_WORD}}}\b"

Vocabulary = Mapping[str, Sequence[int]]


def make_vectorizer(vocabulary: Sequence[str] | None = None, min_df: int = 1,
                    max_features: int | None = None, dtype: type = np.float32
                    ) -> CountVectorizer:
    """The one ``CountVectorizer`` configuration every topic model uses.

    Parameters
    ----------
    vocabulary : sequence of str or None, default None
        A fixed word list (column order); None learns one from the documents.
    min_df : int, default 1
        Ignore words in fewer documents (only when learning the vocabulary).
    max_features : int or None, default None
        Keep the most frequent words only (only when learning the vocabulary).
    dtype : numpy dtype, default numpy.float32
    """
    return CountVectorizer(lowercase=True, stop_words="english", token_pattern=TOKEN_PATTERN,
                           vocabulary=list(vocabulary) if vocabulary is not None else None,
                           min_df=min_df, max_features=max_features, dtype=dtype)


def local_vocabulary(texts: Sequence[str], min_df: int = 1, max_features: int | None = None
                     ) -> dict[str, tuple[int, int]]:
    """One worker's vocabulary with frequencies, for the pre-training exchange.

    Parameters
    ----------
    texts : sequence of str
    min_df : int, default 1
        Leave out words in fewer of this worker's documents.
    max_features : int or None, default None
        Keep only this many words, the most frequent.

    Returns
    -------
    dict of str to (int, int)
        word -> (term frequency: occurrences in all documents, document frequency: documents
        containing it). Plain Python ints, so it travels as msgpack. Empty if no document
        holds a word (e.g. only stop words).
    """
    vec = make_vectorizer(min_df=min_df, max_features=max_features, dtype=np.int64)
    try:
        X = vec.fit_transform(list(texts)).tocsc()
    except ValueError:  # "empty vocabulary": nothing but stop words, digits or punctuation
        return {}
    tf = np.asarray(X.sum(axis=0)).ravel()
    df = np.diff(X.indptr)
    return {w: (int(tf[i]), int(df[i])) for w, i in vec.vocabulary_.items()}


def merge_vocabularies(vocabs: Sequence[Vocabulary], max_size: int | None = None,
                       min_df: int = 1) -> list[str]:
    """Agree on one vocabulary from the workers' :func:`local_vocabulary` results.

    The union of the words, each with its summed term and document frequencies. Words in fewer
    than ``min_df`` documents in all are dropped. The rest are ranked by

        score(w) = (summed term frequency of w) x (number of workers that have w)

    so a word spread over many workers outranks one equally frequent but held by a single
    worker (whose topics would otherwise crowd the shared vocabulary); ties break
    alphabetically. With ``max_size`` set, the words only one worker holds fill at most
    ``ceil(max_size / len(vocabs))`` places for that worker while others' words are left to
    take them: counts are what each worker says, and one made-up set of words at huge counts
    once took every place (the honest workers' documents then had no word in the
    vocabulary). Places no other word takes still go to the best-ranked of a capped
    worker's words, so a vocabulary the others cannot fill is not left short.

    Parameters
    ----------
    vocabs : sequence of mappings word -> (term_freq, doc_freq)
    max_size : int or None, default None
        Keep the ``max_size`` best-ranked words (all if None).
    min_df : int, default 1
        Fewest documents, summed over workers, a word must appear in.

    Returns
    -------
    list of str
        The agreed words, best-ranked first: the column order of :func:`bow_matrix`.
    """
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    tf: dict[str, int] = {}
    df: dict[str, int] = {}
    holders: dict[str, int] = {}
    for vocab in vocabs:
        for word, (term_freq, doc_freq) in vocab.items():
            tf[word] = tf.get(word, 0) + int(term_freq)
            df[word] = df.get(word, 0) + int(doc_freq)
            holders[word] = holders.get(word, 0) + 1
    kept = [w for w in tf if df[w] >= min_df]
    kept.sort(key=lambda w: (-tf[w] * holders[w], w))
    if max_size is None or len(kept) <= max_size:
        return kept
    owner = {w: i for i, vocab in enumerate(vocabs) for w in vocab if holders[w] == 1}
    places = math.ceil(max_size / len(vocabs))  # a worker's at most for words its own alone
    taken: Counter[int] = Counter()
    chosen, deferred = [], []
    for rank, word in enumerate(kept):
        if len(chosen) == max_size:
            break
        alone = owner.get(word)
        if alone is not None and taken[alone] >= places:
            deferred.append(rank)
            continue
        taken[alone] += 1
        chosen.append(rank)
    chosen += deferred[:max_size - len(chosen)]
    return [kept[rank] for rank in sorted(chosen)]


def bow_matrix(texts: Sequence[str], vocabulary: Sequence[str], dtype: type = np.float32
               ) -> sp.csr_matrix:
    """Word counts of ``texts`` over a fixed ``vocabulary``.

    Parameters
    ----------
    texts : sequence of str
    vocabulary : sequence of str
        Distinct words; column ``j`` counts ``vocabulary[j]``. Words the tokenizer cannot
        produce (stop words, one letter) simply stay zero.
    dtype : numpy dtype, default numpy.float32

    Returns
    -------
    scipy.sparse.csr_matrix
        Shape (len(texts), len(vocabulary)).
    """
    if len(set(vocabulary)) != len(vocabulary):
        raise ValueError("vocabulary holds duplicate words")
    if not vocabulary:
        return sp.csr_matrix((len(texts), 0), dtype=dtype)
    return make_vectorizer(vocabulary, dtype=dtype).transform(list(texts)).tocsr()


def vocabulary_info(texts: Sequence[str]) -> dict[str, Any]:
    """A worker's half of the vocabulary consensus: its registration ``info`` (msgpack-plain),
    ``{"vocabulary": {word: [term_freq, doc_freq]}, "n_docs": N}``; checked and merged on the
    master by :mod:`master.families.vocabulary`."""
    vocab = local_vocabulary(texts)
    # (counted as at most MAX_TERM_PER_DOC a document: an honest worker whose one document
    # repeated a word 300,000 times was refused as claiming counts no documents could give)
    return {"vocabulary": {w: [min(tf, df * C.MAX_TERM_PER_DOC), df]
                           for w, (tf, df) in vocab.items()}, "n_docs": len(texts)}
