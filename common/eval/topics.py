"""Scores of a topic model's topics: coherence, diversity, embedding coherence.

A topic is a list of words, best first (see :func:`top_words`). All scores take a list of
topics, so they work the same for NMF, LDA or any other family.

Two kinds of NPMI coherence:

* :func:`npmi_coherence` — document co-occurrence NPMI (reported as ``npmi_doc``): two words
  co-occur when one document holds both, from a bag-of-words reference;
* :func:`gensim_coherence` — gensim's ``CoherenceModel`` (Röder et al. 2015): ``c_npmi``
  (sliding windows of 10 tokens) and ``c_v`` (windows of 110), the scores most topic-model
  papers report, from tokenized reference texts (:func:`reference_tokens`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp
from sklearn.svm import LinearSVC

from common.data.text import make_vectorizer
from common.eval.classification import classification_metrics

if TYPE_CHECKING:
    from common.models.lda_mh import Corpus
    from common.models.ntm import NeuralTopicModel

__all__ = ["top_words", "npmi_coherence", "npmi_per_topic", "reference_tokens",
           "gensim_coherence", "window_coherence", "topic_diversity", "rbo", "inverted_rbo",
           "embedding_coherence", "svm_scores", "neural_topic_scores", "lda_topic_scores"]

log = logging.getLogger("fedctl.eval")

#: The measures :func:`gensim_coherence` computes by default.
GENSIM_MEASURES = ("c_npmi", "c_v")

Topics = Sequence[Sequence[str]]


# hand-written: a stable argsort of a bare matrix; gensim's show_topic needs a gensim model
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


# hand-written: document co-occurrence from a bag of words, -1 unsmoothed; gensim counts windows
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


# hand-written: the mean of npmi_per_topic (document co-occurrence NPMI, see there)
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


def reference_tokens(texts: Sequence[str], vocabulary: Sequence[str]) -> list[list[str]]:
    """Each text as its tokens in order, for :func:`gensim_coherence`.

    The topic models' own tokenizer (:func:`common.data.text.make_vectorizer`: lowercase,
    English stop words out, words of two or more letters), keeping only words of
    ``vocabulary``: the texts as the models saw them, in their word order.
    """
    analyze = make_vectorizer().build_analyzer()
    keep = set(vocabulary)
    return [[w for w in analyze(text) if w in keep] for text in texts]


def gensim_coherence(topics: Topics, reference: Sequence[Sequence[str]],
                     measures: Sequence[str] = GENSIM_MEASURES, top_n: int = 10
                     ) -> dict[str, float]:
    """Topic coherence as gensim's ``CoherenceModel`` computes it, e.g. ``c_npmi`` and ``c_v``.

    Probabilities come from boolean sliding windows over the reference texts (gensim's
    default sizes: 10 tokens for ``c_npmi``, 110 for ``c_v``), over a gensim ``Dictionary``
    built from those texts. Each topic's first ``top_n`` words are scored; words the reference
    never holds are left out of their topic (gensim cannot score them), and a topic with fewer
    than two words left gets no score. The result is the mean over the topics scored.

    Parameters
    ----------
    topics : sequence of sequences of str
        Each topic's words, best first.
    reference : sequence of sequences of str
        Tokenized reference documents (see :func:`reference_tokens`).
    measures : sequence of str, default ("c_npmi", "c_v")
        Any of gensim's sliding-window measures (``c_npmi``, ``c_uci``, ``c_v``).
    top_n : int, default 10

    Returns
    -------
    dict of str to float
        Measure -> mean over the scored topics; NaN when no topic could be scored.
    """
    # Lazy: gensim takes about two seconds to import, and only topic evaluation needs it.
    from gensim.corpora import Dictionary
    from gensim.models.coherencemodel import CoherenceModel

    texts = [list(doc) for doc in reference]
    dictionary = Dictionary(texts)
    known = [[w for w in list(t)[:top_n] if w in dictionary.token2id] for t in topics]
    scorable = [t for t in known if len(t) >= 2]
    out: dict[str, float] = {}
    for measure in measures:
        if not scorable:
            out[measure] = float("nan")
            continue
        # processes=1: no worker pool inside a cluster process (gensim's default forks).
        model = CoherenceModel(topics=scorable, texts=texts, dictionary=dictionary,
                               coherence=measure, topn=top_n, processes=1)
        out[measure] = float(np.nanmean(model.get_coherence_per_topic()))
    return out


_gensim_warned = False  # window_coherence's warning is said once a process


def window_coherence(topics: Topics, reference_texts: Sequence[str] | None,
                     vocab: Sequence[str]) -> dict[str, float]:
    """:func:`gensim_coherence` of ``topics`` on ``reference_texts`` (tokenized over
    ``vocab``) for a run's report: empty without reference texts, and empty, with a warning
    (once), where gensim cannot be imported (not installed, or built for another numpy). A
    node without it (a GPU image, say) then finishes its run without those two scores rather
    than failing at the very end of it."""
    global _gensim_warned
    if reference_texts is None:
        return {}
    try:
        return gensim_coherence(topics, reference_tokens(reference_texts, vocab))
    except ImportError as exc:
        if not _gensim_warned:
            _gensim_warned = True
            log.warning("topic coherence: %s (gensim cannot be imported here): %s are left out "
                        "of the scores; `pip install gensim` puts them back", exc,
                        " and ".join(GENSIM_MEASURES))
        return {}


# hand-written: one set count (Dieng et al.'s TD); not worth a topic-model toolkit
def topic_diversity(topics: Topics, top_n: int = 10) -> float:
    """Fraction of unique words among all topics' ``top_n`` words (Dieng et al. 2020).

    1 when no word is shared; 1/k for k identical topics.
    """
    heads = [list(t)[:top_n] for t in topics]
    total = sum(len(h) for h in heads)
    if total == 0:
        raise ValueError("no topic words")
    return len({w for h in heads for w in h}) / total


# hand-written: a dozen lines of Webber et al.'s eq. 32, tested by hand; not worth a dependency
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


# hand-written: 1 - mean rbo over topic pairs (Bianchi et al.), on top of rbo above
def inverted_rbo(topics: Topics, top_n: int = 10, p: float = 0.9) -> float:
    """1 - mean extrapolated RBO (:func:`rbo`) over all pairs of topics' ``top_n`` words.

    0 when every topic is the same ranking, 1 when no two topics share a word (Bianchi et al.
    2021's topic-diversity score).
    """
    heads = [list(t)[:top_n] for t in topics]
    if len(heads) < 2:
        raise ValueError("need at least two topics")
    return 1.0 - float(np.mean([rbo(a, b, p) for a, b in itertools.combinations(heads, 2)]))


# hand-written: mean pairwise cosine under any caller-given encoder; no library call takes one
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


def neural_topic_scores(model: NeuralTopicModel, vocab: list[str], x_train: sp.csr_matrix,
                 c_train: np.ndarray | None, y_train: np.ndarray, x_test: sp.csr_matrix,
                 c_test: np.ndarray | None, y_test: np.ndarray, seed: int,
                 reference_texts: Sequence[str] | None = None) -> dict[str, float]:
    """A neural topic model's scores on a worker's split (or any split): held-out
    perplexity; coherence with the split's own documents as reference (those of
    ``x_train`` and ``x_test``, ``reference_texts`` in the same order): document co-occurrence
    NPMI (``npmi_doc``) and gensim's sliding-window ``c_npmi`` and ``c_v`` (skipped without
    ``reference_texts``: seconds, so for the closing report only); topic diversity,
    inverted RBO, and a linear SVM on the topic proportions (macro-F1, accuracy)."""
    topics = model.get_topics(10, vocab)
    out: dict[str, float] = {}
    if x_test.shape[0]:
        out["perplexity"] = model.perplexity(x_test, c_test)
    out["npmi_doc"] = npmi_coherence(topics, sp.vstack([x_train, x_test]), vocab)
    out.update(window_coherence(topics, reference_texts, vocab))
    out["topic_diversity"] = topic_diversity(topics)
    out["inverted_rbo"] = inverted_rbo(topics)
    out.update(svm_scores(model.transform(x_train, c_train), y_train,
                          model.transform(x_test, c_test), y_test, seed))
    return {k: float(v) for k, v in out.items() if np.isfinite(v)}


def lda_topic_scores(topic_word: np.ndarray, test: Corpus,
                     reference_bow: sp.spmatrix | np.ndarray, vocab: list[str], alpha: float,
                     eval_iter: int, seed: int, reference_texts: Sequence[str] | None = None
                     ) -> dict[str, float]:
    """An LDA model's scores (iFTM's parties and baselines): held-out log-likelihood per
    token and perplexity (document completion) on ``test``; coherence of the top-10 words:
    document co-occurrence NPMI on ``reference_bow`` (``npmi_doc``) and gensim's
    sliding-window ``c_npmi`` and ``c_v`` on ``reference_texts`` (the same documents,
    tokenized; skipped without them: seconds, so for the closing report only); topic
    diversity of the top-10 words."""
    from common.models.lda_mh import heldout_log_likelihood  # (numba: only where LDA runs)

    ll = heldout_log_likelihood(topic_word, test, alpha, eval_iter, seed)
    heads = top_words(topic_word, vocab, 10)
    windows = window_coherence(heads, reference_texts, vocab)
    return {"heldout_ll": ll["loglik"], "heldout_ll_per_token": ll["loglik_per_token"],
            "perplexity": ll["perplexity"],
            "npmi_doc": npmi_coherence(heads, reference_bow, vocab),
            **{k: v for k, v in windows.items() if np.isfinite(v)},
            "diversity": topic_diversity(heads), "n_topics": float(topic_word.shape[0])}
