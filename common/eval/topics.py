"""Scores of a topic model's topics: coherence, diversity, embedding coherence.

A topic is a list of words, best first (see :func:`top_words`). All scores take a list of
topics, so they work the same for NMF, LDA or any other family.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.svm import LinearSVC

from common.eval.classification import classification_metrics

__all__ = ["top_words", "npmi_coherence", "npmi_per_topic", "topic_diversity", "rbo",
           "inverted_rbo", "embedding_coherence", "svm_scores"]

Topics = Sequence[Sequence[str]]


def top_words(topic_word: np.ndarray, vocab: Sequence[str], n: int = 10) -> list[list[str]]:
    """The ``n`` heaviest words of each topic.

    Parameters
    ----------
    topic_word : array of shape (n_topics, n_words)
        Topic-word weights (an NMF's ``components_``, an LDA's topic-word matrix).
    vocab : sequence of str
        The word of each column.
    n : int, default 10

    Returns
    -------
    list of list of str
        One list per topic, heaviest word first (ties: lower column first).
    """
    topic_word = np.asarray(topic_word)
    if topic_word.ndim != 2 or topic_word.shape[1] != len(vocab):
        raise ValueError(f"topic_word has shape {topic_word.shape}, expected (k, {len(vocab)})")
    order = np.argsort(-topic_word, axis=1, kind="stable")[:, :n]
    return [[vocab[j] for j in row] for row in order]


def npmi_per_topic(topics: Topics, reference_bow: sp.spmatrix | np.ndarray,
                   vocab: Sequence[str], top_n: int = 10) -> np.ndarray:
    """NPMI coherence of each topic (see :func:`npmi_coherence`)."""
    index = {w: i for i, w in enumerate(vocab)}
    heads = [list(t)[:top_n] for t in topics]
    words = sorted({w for t in heads for w in t if w in index})
    n_docs = reference_bow.shape[0]
    if n_docs == 0:
        raise ValueError("the reference corpus holds no documents")
    cols = [index[w] for w in words]
    X = sp.csc_matrix(reference_bow)[:, cols]
    X = (X > 0).astype(np.float64)  # document co-occurrence: presence, not counts
    joint = (X.T @ X).toarray() / n_docs  # P(wi, wj); the diagonal is P(wi)
    p = np.diag(joint).copy()
    pos = {w: i for i, w in enumerate(words)}

    def npmi(a: str, b: str) -> float:
        if a not in pos or b not in pos:  # a word the reference never saw co-occurs with none
            return -1.0
        i, j = pos[a], pos[b]
        pij = joint[i, j]
        if pij <= 0:
            return -1.0
        if pij >= 1:  # both in every document: perfectly associated
            return 1.0
        return float(np.log(pij / (p[i] * p[j])) / -np.log(pij))

    out = []
    for head in heads:
        pairs = list(itertools.combinations(head, 2))
        out.append(np.mean([npmi(a, b) for a, b in pairs]) if pairs else np.nan)
    return np.asarray(out, dtype=np.float64)


def npmi_coherence(topics_top_words: Topics, reference_bow: sp.spmatrix | np.ndarray,
                   vocab: Sequence[str], top_n: int = 10) -> float:
    """Mean NPMI coherence of the topics on a reference corpus.

    For each topic, the mean over pairs of its ``top_n`` words of the normalized pointwise
    mutual information (Bouma 2009; as a topic score, Aletras & Stevenson 2013, Lau et al.
    2014), with probabilities from document co-occurrence in the reference corpus:

        NPMI(wi, wj) = log(P(wi, wj) / (P(wi) P(wj))) / -log P(wi, wj)

    where P(w) is the fraction of documents containing w. It ranges from -1 (never together)
    through 0 (independent) to 1 (always together). Pairs that never co-occur (or hold a word
    missing from the reference) count as -1, with no smoothing. The score is the mean over
    topics.

    Parameters
    ----------
    topics_top_words : sequence of sequences of str
        Each topic's words, best first.
    reference_bow : sparse or dense matrix of shape (n_docs, n_words)
        Word counts of the reference corpus (only presence matters).
    vocab : sequence of str
        The word of each column of ``reference_bow``.
    top_n : int, default 10
        Words per topic scored.
    """
    return float(np.nanmean(npmi_per_topic(topics_top_words, reference_bow, vocab, top_n)))


def topic_diversity(topics: Topics, top_n: int = 10) -> float:
    """Fraction of unique words among all topics' ``top_n`` words (Dieng et al. 2020).

    1 when no word is shared; 1/k for k identical topics.
    """
    heads = [list(t)[:top_n] for t in topics]
    total = sum(len(h) for h in heads)
    if total == 0:
        raise ValueError("no topic words")
    return len({w for h in heads for w in h}) / total


def rbo(a: Sequence[str], b: Sequence[str], p: float = 0.9) -> float:
    """Extrapolated rank-biased overlap of two rankings of equal depth (Webber et al. 2010).

    RBO_ext = (X_k / k) p^k + (1 - p)/p * sum_{d=1..k} (X_d / d) p^d   (their eq. 32),

    where X_d is the number of items the two lists share in their first d places and k is the
    depth: it assumes the agreement seen at depth k continues below it. Identical lists
    score 1, disjoint ones 0. Longer lists are cut to the shorter's depth.
    """
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    k = min(len(a), len(b))
    if k == 0:
        raise ValueError("empty ranking")
    seen_a: set[str] = set()
    seen_b: set[str] = set()
    overlap = 0
    total = 0.0
    for d in range(1, k + 1):
        x, y = a[d - 1], b[d - 1]
        if x == y:
            overlap += 1
        else:
            overlap += (x in seen_b) + (y in seen_a)
        seen_a.add(x)
        seen_b.add(y)
        total += overlap / d * p**d
    return overlap / k * p**k + (1 - p) / p * total


def inverted_rbo(topics: Topics, top_n: int = 10, p: float = 0.9) -> float:
    """1 - mean extrapolated RBO (:func:`rbo`) over all pairs of topics' ``top_n`` words.

    0 when every topic is the same ranking, 1 when no two topics share a word (Bianchi et al.
    2021's topic-diversity score).
    """
    heads = [list(t)[:top_n] for t in topics]
    if len(heads) < 2:
        raise ValueError("need at least two topics")
    return 1.0 - float(np.mean([rbo(a, b, p) for a, b in itertools.combinations(heads, 2)]))


def embedding_coherence(topics: Topics, embed_fn: Callable[[list[str]], np.ndarray],
                        top_n: int = 10) -> float:
    """Mean pairwise cosine similarity of each topic's top words' embeddings, over topics.

    Parameters
    ----------
    topics : sequence of sequences of str
    embed_fn : callable
        Maps a list of words to an array of shape (len(words), dim), e.g.
        ``lambda ws: common.data.embedding.embed_texts(ws, progress=False)``. Called once with every
        distinct word.
    top_n : int, default 10
    """
    heads = [list(t)[:top_n] for t in topics]
    words = sorted({w for h in heads for w in h})
    vectors = np.asarray(embed_fn(words), dtype=np.float64)
    if vectors.shape[0] != len(words):
        raise ValueError(f"embed_fn returned {vectors.shape[0]} vectors for {len(words)} words")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = vectors / np.where(norms > 0, norms, 1.0)
    pos = {w: i for i, w in enumerate(words)}
    scores = []
    for head in heads:
        if len(head) < 2:
            continue
        v = unit[[pos[w] for w in head]]
        sim = v @ v.T
        n = len(head)
        scores.append((sim.sum() - np.trace(sim)) / (n * (n - 1)))
    if not scores:
        raise ValueError("need topics of at least two words")
    return float(np.mean(scores))


def svm_scores(train_features: np.ndarray, y_train: np.ndarray, test_features: np.ndarray,
               y_test: np.ndarray, random_state: int = 0) -> dict[str, float]:
    """Downstream classification on topic weights: a linear SVM (scikit-learn ``LinearSVC``,
    default settings) trained on the training documents' weights, scored on the test ones.

    Returns
    -------
    dict
        ``macro_f1`` and ``accuracy``
        (:func:`common.eval.classification.classification_metrics`); empty when the training
        labels hold fewer than two classes or there is nothing to test.
    """
    if len(np.unique(y_train)) < 2 or len(y_test) == 0:
        return {}
    svm = LinearSVC(random_state=random_state).fit(train_features, y_train)
    return classification_metrics(np.asarray(y_test), svm.predict(test_features))
