"""Bags of words for topic models: local vocabularies, their merge, count matrices."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common import constants as C
from common.data.text import (
    bow_matrix,
    local_vocabulary,
    make_vectorizer,
    merge_vocabularies,
    vocabulary_info,
)

ROOT = Path(__file__).resolve().parents[1]
STACKOVERFLOW = ROOT / "data" / "stackoverflow" / "stackoverflow_1500.jsonl"


def _texts() -> list[str]:
    with STACKOVERFLOW.open(encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def test_local_vocabulary_counts_words_and_documents() -> None:
    texts = ["The cat sat on the mat, the CAT!", "A cat and a dog; 42 dogs x", "Nothing here"]
    vocab = local_vocabulary(texts)
    # Lowercased; stop words ("the", "on", "and", "a", "here", "nothing"), one-letter tokens
    # and numbers are gone.
    assert vocab == {"cat": (3, 2), "sat": (1, 1), "mat": (1, 1), "dog": (1, 1),
                     "dogs": (1, 1)}
    assert all(type(tf) is int and type(df) is int for tf, df in vocab.values())


def test_local_vocabulary_of_only_stop_words_is_empty() -> None:
    assert local_vocabulary(["the and of", "42 7 x"]) == {}


def test_local_vocabulary_min_df_and_max_features() -> None:
    texts = ["apple banana", "apple cherry", "apple banana durian"]
    assert set(local_vocabulary(texts, min_df=2)) == {"apple", "banana"}
    assert set(local_vocabulary(texts, max_features=1)) == {"apple"}


def test_merge_ranks_by_frequency_times_holders() -> None:
    w1 = {"apple": (10, 5), "banana": (4, 4), "cherry": (1, 1)}
    w2 = {"banana": (4, 3), "durian": (7, 7)}
    w3 = {"banana": (1, 1), "elder": (1, 1)}
    # scores: banana 9 x 3 = 27, apple 10 x 1 = 10, durian 7, cherry 1, elder 1 (ties by name)
    assert merge_vocabularies([w1, w2, w3]) == ["banana", "apple", "durian", "cherry", "elder"]
    assert merge_vocabularies([w1, w2, w3], max_size=2) == ["banana", "apple"]
    # min_df counts documents summed over workers: cherry and elder are in one each
    assert merge_vocabularies([w1, w2, w3], min_df=2) == ["banana", "apple", "durian"]
    with pytest.raises(ValueError):
        merge_vocabularies([w1], max_size=0)


def test_words_one_worker_alone_holds_fill_at_most_its_part_while_others_compete() -> None:
    loud = {f"made{i}": (10**6, 10) for i in range(6)}
    w2 = {"apple": (5, 5), "banana": (3, 3)}
    w3 = {"apple": (2, 2), "cherry": (1, 1)}
    # 6 places, 3 workers: loud's own words take 2 while the others' compete; the sixth,
    # which no other word takes, is loud's next; the list stays in rank order.
    assert merge_vocabularies([loud, w2, w3], max_size=6) == [
        "made0", "made1", "made2", "apple", "banana", "cherry"]
    assert merge_vocabularies([loud, w2, w3], max_size=5) == [
        "made0", "made1", "apple", "banana", "cherry"]
    # Places no other word takes go to the capped worker's next best.
    assert len(merge_vocabularies([loud, w2, w3], max_size=8)) == 8
    assert merge_vocabularies([loud, {}], max_size=4) == ["made0", "made1", "made2", "made3"]


def test_merge_of_shares_is_the_vocabulary_of_the_whole() -> None:
    texts = _texts()
    shares = [texts[0::3], texts[1::3], texts[2::3]]
    merged = merge_vocabularies([local_vocabulary(s) for s in shares])
    whole = local_vocabulary(texts)
    assert set(merged) == set(whole)
    # Frequencies add up: the best-ranked word carries the largest tf x holders score.
    holders = Counter(w for s in shares for w in local_vocabulary(s))
    best = max(whole, key=lambda w: (whole[w][0] * holders[w], w))
    assert merged[0] == best


def test_bow_matrix_counts_over_a_fixed_vocabulary() -> None:
    vocab = ["dog", "cat", "the", "zebra"]
    X = bow_matrix(["cat cat dog", "The dog, the DOG", "nothing known"], vocab)
    assert X.shape == (3, 4) and X.dtype == np.float32
    # "the" is a stop word: the analyzer never produces it, so its column stays zero.
    assert X.toarray().tolist() == [[1, 2, 0, 0], [2, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="duplicate"):
        bow_matrix(["a"], ["dog", "dog"])
    assert bow_matrix(["cat"], []).shape == (1, 0)


def test_bow_matrix_agrees_with_the_local_vocabulary_on_real_titles() -> None:
    texts = _texts()
    vocab = local_vocabulary(texts)
    words = sorted(vocab)
    X = bow_matrix(texts, words).tocsc()
    tf = np.asarray(X.sum(axis=0)).ravel()
    df = np.diff(X.indptr)
    assert {w: (int(tf[i]), int(df[i])) for i, w in enumerate(words)} == vocab
    assert all(len(w) >= 2 and w.isalpha() and w == w.lower() for w in words)
    assert not set(words) & set(make_vectorizer().get_stop_words())


def test_a_run_of_letters_longer_than_a_word_is_no_token():
    from common.data.text import MAX_WORD, local_vocabulary

    vocab = local_vocabulary(["plain words " + "a" * (MAX_WORD + 50), "b" * MAX_WORD + " end"])
    assert set(vocab) == {"plain", "words", "b" * MAX_WORD, "end"}


def test_every_bundled_dataset_registers_whole():
    """An honest worker holding a whole bundled dataset is not refused at registration
    (dbpedia_10k holds runs of 100+ letters: the examples' topic models failed so)."""
    import json

    from common.data.text import vocabulary_info
    from master.families.vocabulary import check_vocabulary_info
    from tests.conftest import ROOT

    for path in sorted((ROOT / "data").glob("*/*.jsonl")):
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line]
        check_vocabulary_info(vocabulary_info(texts))


def test_a_document_repeating_one_word_past_the_bound_still_registers() -> None:
    """An honest worker whose one document repeated a word 300,000 times was refused by the
    master as claiming counts no documents could give, and the whole run failed."""
    from master.families.vocabulary import check_vocabulary_info

    info = vocabulary_info(["locomotive " * 300_000, "a locomotive engine", "a train"])
    assert info["vocabulary"]["locomotive"] == [2 * C.MAX_TERM_PER_DOC, 2]
    check_vocabulary_info(info)  # (raised ProtocolError)
