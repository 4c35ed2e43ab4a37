"""iFTM's pieces: the Laplace mechanism, topic-wise normalization, weighted Jaccard, the merge
(Alg. 3) and the composition (Alg. 4)."""

from __future__ import annotations

import numpy as np
import pytest

from common.models.iftm import compose, merge_models, topic_normalize, weighted_jaccard
from common.models.lda_mh import LDAMH, corpus_from_bow
from common.privacy import laplace_noise, privatize


def _topics(k: int, v: int, seed: int) -> np.ndarray:
    """k peaked, well-separated topics over v words."""
    rng = np.random.default_rng(seed)
    t = rng.dirichlet(np.full(v, 0.05), size=k)
    return topic_normalize(t)


@pytest.mark.parametrize("epsilon", [8.0, 11.0])
def test_laplace_noise_has_scale_one_over_epsilon(epsilon: float) -> None:
    x = laplace_noise((400_000,), epsilon, np.random.default_rng(0))
    assert abs(x.mean()) < 0.01 / epsilon * 10
    assert x.std() == pytest.approx(np.sqrt(2) / epsilon, rel=0.02)
    assert np.abs(x).mean() == pytest.approx(1 / epsilon, rel=0.02)  # E|X| = b


def test_privatize_clips_at_tau_and_adds_the_given_noise() -> None:
    counts = np.array([0, 1, 2, 5], dtype=float)
    noise = np.array([0.1, -0.85, 0.3, -0.5])
    out = privatize(counts, epsilon=None, tau=0.2, noise=noise)
    assert out.tolist() == pytest.approx([0.0, 0.0, 2.3, 4.5])
    with pytest.raises(ValueError):
        laplace_noise((3,), 0.0, np.random.default_rng(0))


def test_sampler_draws_its_noise_once_with_the_stated_scale() -> None:
    X = np.random.default_rng(0).poisson(1.0, size=(500, 30))
    model = LDAMH(n_topics=40, n_iter=1, epsilon=9.0, warm_start=True,
                  random_state=0).fit(corpus_from_bow(X))
    noise = model.noise_.copy()
    assert noise.shape == (500, 40)
    assert noise.std() == pytest.approx(np.sqrt(2) / 9.0, rel=0.03)
    model.fit(corpus_from_bow(X))  # a warm continuation keeps the once-drawn noise
    assert np.array_equal(model.noise_, noise)


def test_topic_normalization_gives_rows_summing_to_one() -> None:
    X = np.random.default_rng(1).poisson(0.5, size=(200, 50))
    model = LDAMH(n_topics=7, n_iter=5, random_state=0).fit(corpus_from_bow(X))
    counts = model.components_
    counts[3] = 0  # an empty topic becomes uniform rather than NaN
    for beta in (0.0, 0.01):
        t = topic_normalize(counts, beta)
        assert t.shape == (7, 50)
        assert np.allclose(t.sum(axis=1), 1.0)
        assert (t >= 0).all()
    assert np.allclose(topic_normalize(counts)[3], 1 / 50)
    with pytest.raises(ValueError):
        topic_normalize(-counts)


def test_weighted_jaccard_identical_disjoint_and_symmetric() -> None:
    a = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
    s = weighted_jaccard(a, a, top_l=2)
    assert np.allclose(s, np.eye(2))
    b = np.array([[0.4, 0.6, 0.0, 0.0]])
    assert weighted_jaccard(a, b, 2)[0, 0] == pytest.approx(0.9 / 1.1)
    t1, t2 = _topics(5, 100, 0), _topics(6, 100, 1)
    assert np.allclose(weighted_jaccard(t1, t2, 10), weighted_jaccard(t2, t1, 10).T)


def test_merging_two_copies_of_one_model_gives_that_model_back() -> None:
    t = _topics(12, 300, 2)
    merged, assignment = merge_models([t, t.copy()], sizes=[100, 300], xi=0.3, top_l=20)
    assert merged.shape == t.shape
    assert np.allclose(merged, t)
    assert [a.tolist() for a in assignment] == [list(range(12))] * 2
    composed, match = compose(t, merged, xi=0.3)
    assert np.allclose(composed, t) and match.tolist() == list(range(12))


def test_merge_weights_by_data_size_and_handles_different_numbers_of_topics() -> None:
    shared = _topics(1, 200, 3)[0]
    near = topic_normalize((shared + 0.2 * _topics(1, 200, 4)[0])[None])[0]
    a = np.vstack([shared, _topics(3, 200, 5)])          # party 1: 4 topics
    b = np.vstack([_topics(5, 200, 6), near])             # party 2: 6 topics
    merged, (ga, gb) = merge_models([a, b], sizes=[1, 3], xi=0.5, top_l=20)
    assert merged.shape == (4 + 6 - 1, 200)               # only the shared pair merged
    assert ga[0] == gb[5]
    assert np.allclose(merged[ga[0]], topic_normalize(((1 * shared + 3 * near) / 4)[None])[0])
    assert np.allclose(merged.sum(axis=1), 1.0)
    # party 1's composed model: the shared slot now holds the merged topic, the others stay
    composed, match = compose(a, merged, xi=0.5)
    assert composed.shape == a.shape
    assert np.allclose(composed[0], merged[ga[0]]) and not np.allclose(composed[0], a[0])
    assert np.allclose(composed[1:], a[1:])
    assert (match >= 0).all()
    # nothing above a threshold of 1: everything stays apart
    apart, _ = merge_models([a, b], sizes=[1, 3], xi=1.0)
    assert apart.shape == (10, 200)


def _chained_parties() -> tuple[list[np.ndarray], list[float]]:
    """Four parties (5, 7, 4, 6 topics), each topic a noisy copy of one of eight base topics,
    so that some groups chain across parties and hold two topics of one party."""
    rng = np.random.default_rng(7)
    base = rng.dirichlet(np.full(150, 0.05), size=8)
    models, sizes = [], []
    for k in (5, 7, 4, 6):
        picks = rng.choice(8, size=k, replace=True)
        noise = rng.dirichlet(np.full(150, 0.05), size=k)
        mix = rng.uniform(0.0, 0.9, size=(k, 1))
        models.append(topic_normalize((1 - mix) * base[picks] + mix * noise))
        sizes.append(float(rng.integers(50, 500)))
    return models, sizes


def test_merge_groups_and_orders_global_topics_as_before() -> None:
    # The result of the earlier hand-written union-find merge on this case: global topics are
    # numbered in the order each group's first topic appears, party by party.
    models, sizes = _chained_parties()
    merged, assignment = merge_models(models, sizes, xi=0.3, top_l=20)
    assert [a.tolist() for a in assignment] == [
        [0, 1, 2, 3, 4], [5, 6, 7, 7, 8, 9, 10], [7, 11, 12, 13], [14, 8, 7, 15, 1, 7]]
    fingerprint = (merged * np.arange(1, merged.shape[1] + 1)).sum(axis=1)
    np.testing.assert_allclose(fingerprint, [
        77.8060124577, 62.3559983136, 71.9114372768, 90.5809819817, 87.1956506577,
        92.11198502, 81.6683536157, 77.036792524, 76.5857865794, 68.943597116,
        94.8921453237, 68.9713835764, 82.0170365477, 70.8021091733, 73.3728949281,
        64.1359203546], rtol=0, atol=1e-9)
    # each global topic: its members' size-weighted mean
    for g in range(merged.shape[0]):
        members = [(sizes[p], models[p][a]) for p in range(4)
                   for a in np.flatnonzero(assignment[p] == g)]
        mean = sum(w * t for w, t in members) / sum(w for w, _ in members)
        np.testing.assert_allclose(merged[g], topic_normalize(mean[None])[0], atol=1e-15)
