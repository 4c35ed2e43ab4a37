"""Topic scores against hand computations, and on real titles with the real embedding model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from common.data.text import bow_matrix, local_vocabulary
from common.eval.topics import (
    embedding_coherence,
    gensim_coherence,
    inverted_rbo,
    npmi_coherence,
    npmi_per_topic,
    rbo,
    reference_tokens,
    svm_scores,
    top_words,
    topic_diversity,
)

ROOT = Path(__file__).resolve().parents[1]
STACKOVERFLOW = ROOT / "data" / "stackoverflow" / "stackoverflow_1500.jsonl"

# Six reference documents over five words (rows: documents, columns: VOCAB).
VOCAB = ["apple", "banana", "cherry", "durian", "elder"]
REF = sp.csr_matrix(np.array([
    # apple banana cherry durian elder
    [1, 1, 0, 0, 1],
    [2, 1, 1, 0, 1],
    [0, 0, 1, 0, 1],
    [0, 0, 0, 1, 1],
    [0, 0, 1, 1, 1],
    [0, 0, 0, 0, 1],
]))


def test_npmi_of_words_always_together_is_one() -> None:
    # apple and banana: both in exactly documents 0 and 1.
    assert npmi_coherence([["apple", "banana"]], REF, VOCAB) == pytest.approx(1.0)


def test_npmi_of_words_never_together_is_minus_one() -> None:
    assert npmi_coherence([["apple", "durian"]], REF, VOCAB) == -1.0
    # a word the reference never holds co-occurs with nothing
    assert npmi_coherence([["apple", "kiwi"]], REF, VOCAB) == -1.0


def test_npmi_by_hand() -> None:
    # cherry in 3 of 6 documents, durian in 2, both in 1: log((1/6)/(3/6 * 2/6)) / -log(1/6)
    expected = math.log((1 / 6) / (3 / 6 * 2 / 6)) / -math.log(1 / 6)
    assert npmi_coherence([["cherry", "durian"]], REF, VOCAB) == pytest.approx(expected)
    # elder is in every document: independent of apple, NPMI 0; apple-banana is 1
    assert npmi_coherence([["apple", "elder"]], REF, VOCAB) == pytest.approx(0.0, abs=1e-12)
    # a topic is the mean over its pairs, the score the mean over topics
    per = npmi_per_topic([["apple", "banana", "durian"], ["cherry", "durian"]], REF, VOCAB)
    assert per == pytest.approx([(1 - 1 - 1) / 3, expected])
    assert npmi_coherence([["apple", "banana", "durian"], ["cherry", "durian"]], REF,
                          VOCAB) == pytest.approx(np.mean(per))
    # only the top_n words of a topic count
    assert npmi_coherence([["apple", "banana", "durian"]], REF, VOCAB, top_n=2) == \
        pytest.approx(1.0)


def test_npmi_counts_presence_not_occurrences() -> None:
    dense = REF.toarray()
    dense[1, 0] = 50
    assert npmi_coherence([["apple", "cherry"]], sp.csr_matrix(dense), VOCAB) == \
        npmi_coherence([["apple", "cherry"]], REF, VOCAB)


# Six tokenized reference documents, all shorter than gensim's windows (10 and 110 tokens), so
# that every document is one window: apple and banana always together, apple and elder never.
TEXTS = [["apple", "banana", "cherry"], ["banana", "apple", "durian"], ["apple", "banana"],
         ["cherry", "durian", "elder"], ["elder", "cherry"], ["durian", "elder"]]


def _gensim(topics: list[list[str]], measure: str, texts: list[list[str]] = TEXTS) -> float:
    from gensim.corpora import Dictionary
    from gensim.models.coherencemodel import CoherenceModel

    return CoherenceModel(topics=topics, texts=texts, dictionary=Dictionary(texts),
                          coherence=measure, topn=10, processes=1).get_coherence()


def test_gensim_coherence_is_gensims_and_ranks_together_over_never() -> None:
    together, never = ["apple", "banana"], ["apple", "elder"]
    mixed = [["apple", "banana", "cherry"], ["durian", "elder", "cherry", "banana"]]
    for measure in ("c_npmi", "c_v"):
        got = gensim_coherence(mixed, TEXTS, measures=[measure])
        assert got == {measure: pytest.approx(_gensim(mixed, measure), abs=1e-12)}
    both = gensim_coherence([together], TEXTS)
    assert set(both) == {"c_npmi", "c_v"}
    # always in the same window: NPMI 1 (up to gensim's 1e-12 smoothing of P(wi, wj))
    assert both["c_npmi"] == pytest.approx(1.0, abs=1e-9)
    # never: log(eps / (P(apple) P(elder))) / -log(eps), both words in 3 of 6 windows
    eps = 1e-12
    apart = gensim_coherence([never], TEXTS)
    assert apart["c_npmi"] == pytest.approx(math.log(eps / 0.25) / -math.log(eps), abs=1e-9)
    assert both["c_npmi"] > apart["c_npmi"] and both["c_v"] > apart["c_v"]
    assert both["c_v"] == pytest.approx(1.0)  # identical context vectors


def test_gensim_coherence_leaves_out_words_the_reference_lacks() -> None:
    plain = gensim_coherence([["apple", "banana"]], TEXTS)
    assert gensim_coherence([["kiwi", "apple", "mango", "banana"]], TEXTS) == \
        {k: pytest.approx(v) for k, v in plain.items()}
    # a topic with fewer than two known words gets no score; the mean is over the others
    assert gensim_coherence([["apple", "banana"], ["kiwi", "elder"]], TEXTS) == \
        {k: pytest.approx(v) for k, v in plain.items()}
    nothing = gensim_coherence([["kiwi", "mango"], ["apple"]], TEXTS)
    assert set(nothing) == {"c_npmi", "c_v"} and all(math.isnan(v) for v in nothing.values())
    # only the top_n words count
    assert gensim_coherence([["apple", "banana", "elder"]], TEXTS, top_n=2) == \
        {k: pytest.approx(v) for k, v in plain.items()}


def test_gensim_npmi_counts_windows_where_npmi_doc_counts_documents() -> None:
    # apple opens and banana closes every document, 15 tokens apart: together in every
    # document (document NPMI 1), never within one 10-token window (c_npmi near -1).
    texts = [["apple", *[f"w{d}x{i}" for i in range(14)], "banana"] for d in range(4)]
    texts += [[f"other{d}", f"more{d}"] for d in range(4)]
    vocab = sorted({w for t in texts for w in t})
    bow = sp.csr_matrix([[t.count(w) for w in vocab] for t in texts])
    assert npmi_coherence([["apple", "banana"]], bow, vocab) == pytest.approx(1.0)
    windowed = gensim_coherence([["apple", "banana"]], texts, measures=["c_npmi"])["c_npmi"]
    assert windowed == pytest.approx(_gensim([["apple", "banana"]], "c_npmi", texts))
    assert windowed < -0.5


def test_reference_tokens_keep_order_and_the_vocabulary() -> None:
    texts = ["The apple, and 2 bananas; APPLE again!", "", "nothing known here"]
    assert reference_tokens(texts, ["apple", "bananas"]) == [["apple", "bananas", "apple"], [],
                                                             []]


def test_diversity() -> None:
    topic = ["a", "b", "c"]
    assert topic_diversity([topic] * 4) == pytest.approx(1 / 4)
    assert topic_diversity([["a", "b"], ["c", "d"]]) == 1.0
    assert topic_diversity([["a", "b"], ["b", "c"]]) == pytest.approx(3 / 4)
    assert topic_diversity([list("abcdefghijkl"), list("mnopqrstuvwx")], top_n=10) == 1.0


def test_rbo_by_hand() -> None:
    p = 0.9
    assert rbo(list("abcde"), list("abcde"), p) == pytest.approx(1.0)
    assert rbo(list("abcde"), list("fghij"), p) == 0.0
    # a swap at the top: X_1 = 0, X_d = d after; (1-p)/p * sum_{d=2..5} p^d + p^5 = p
    assert rbo(list("abcde"), list("bacde"), p) == pytest.approx(0.9)
    # one shared head: X_d = 1 for d = 1..3
    expected = (1 - p) / p * (p + p**2 / 2 + p**3 / 3) + p**3 / 3
    assert rbo(list("abc"), list("ade"), p) == pytest.approx(expected)
    assert rbo(list("abc"), list("ade"), p) == rbo(list("ade"), list("abc"), p)


def test_inverted_rbo() -> None:
    topic = list("abcdefghij")
    assert inverted_rbo([topic, topic, topic]) == pytest.approx(0.0)
    assert inverted_rbo([list("abcdefghij"), list("klmnopqrst")]) == pytest.approx(1.0)
    mixed = inverted_rbo([topic, list("bacdefghij"), list("klmnopqrst")])
    assert mixed == pytest.approx(1 - (0.9 + 0 + 0) / 3)
    with pytest.raises(ValueError):
        inverted_rbo([topic])


def test_top_words() -> None:
    weights = np.array([[0.1, 0.9, 0.5], [3.0, 0.0, 1.0]])
    assert top_words(weights, ["x", "y", "z"], 2) == [["y", "z"], ["x", "z"]]
    with pytest.raises(ValueError):
        top_words(weights, ["x", "y"], 2)


def test_embedding_coherence_with_given_vectors() -> None:
    vectors = {"a": [1.0, 0.0], "b": [2.0, 0.0], "c": [0.0, 1.0], "d": [0.0, 3.0]}

    def embed(words: list[str]) -> np.ndarray:
        return np.array([vectors[w] for w in words])

    assert embedding_coherence([["a", "b"]], embed) == pytest.approx(1.0)
    assert embedding_coherence([["a", "c"]], embed) == pytest.approx(0.0)
    # three words: pairs (a,b)=1, (a,c)=0, (b,c)=0 -> 1/3; averaged with the (c,d) topic = 1
    assert embedding_coherence([["a", "b", "c"], ["c", "d"]], embed) == \
        pytest.approx((1 / 3 + 1) / 2)


def test_npmi_on_real_titles_prefers_topics_of_one_tag() -> None:
    with STACKOVERFLOW.open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    texts = [r["text"] for r in rows]
    vocab = sorted(local_vocabulary(texts))
    X = bow_matrix(texts, vocab)
    labels = np.array([r["label"] for r in rows])
    # A "topic" per tag: its 5 most frequent words in that tag's titles; against it, topics
    # of 5 words drawn at random from the whole vocabulary.
    by_tag = []
    for tag in np.unique(labels):
        counts = np.asarray(X[labels == tag].sum(axis=0)).ravel()
        by_tag.append([vocab[j] for j in np.argsort(-counts, kind="stable")[:5]])
    rng = np.random.default_rng(0)
    random_topics = [list(rng.choice(vocab, 5, replace=False)) for _ in by_tag]
    tagged, scattered = npmi_coherence(by_tag, X, vocab), npmi_coherence(random_topics, X, vocab)
    # Titles are short, so many pairs never meet (-1) even within a tag.
    assert scattered < -0.8
    assert tagged > scattered + 0.5
    # gensim's sliding-window NPMI agrees (titles are shorter than its 10-token window)
    tokens = reference_tokens(texts, vocab)
    windowed = gensim_coherence(by_tag, tokens, measures=["c_npmi"])["c_npmi"]
    assert windowed > gensim_coherence(random_topics, tokens, measures=["c_npmi"])["c_npmi"] + 0.2


def test_svm_scores() -> None:
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1], 50)
    X = rng.normal(size=(100, 3)) + y[:, None] * 4.0
    scores = svm_scores(X[::2], y[::2], X[1::2], y[1::2])
    assert scores["accuracy"] > 0.95 and scores["macro_f1"] > 0.95
    assert svm_scores(X[:10], np.zeros(10), X[10:], y[10:]) == {}  # one class: nothing to fit
