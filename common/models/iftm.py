"""iFTM's master computation (Jiang et al., "Industrial Federated Topic Modeling", ACM TIST
2021): merge heterogeneous local topic models into a global one, and compose for each party a
new local model from it. NumPy and SciPy.

* :func:`topic_normalize` — a party's word–topic counts, each topic row scaled to sum to one
  (what leaves a party).
* :func:`weighted_jaccard` — similarity of two topics over the union of their top-L words
  (eq. 29): Σ_w min(φ_aw, φ_bw) / Σ_w max(φ_aw, φ_bw).
* :func:`merge_models` — Alg. 3: topics of different parties whose similarity exceeds ξ are
  joined with a disjoint-set forest (``scipy.cluster.hierarchy.DisjointSet``); each connected
  group becomes one global topic, the average of its members weighted by their parties' data
  sizes. Parties may have different numbers of topics.
* :func:`compose` — Alg. 4: each of a party's topics is replaced by its most similar global
  topic when that similarity exceeds ξ, and kept otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.cluster.hierarchy import DisjointSet

__all__ = ["topic_normalize", "weighted_jaccard", "merge_models", "compose"]


# hand-written: sklearn's l1 normalize keeps zero rows zero and adds no beta; iFTM needs both
def topic_normalize(counts: np.ndarray, beta: float = 0.0) -> np.ndarray:
    """Topic-wise normalization: ``(counts + beta)`` with each row (topic) summing to one.

    Parameters
    ----------
    counts : numpy.ndarray of shape (n_topics, n_words)
        Non-negative word–topic counts.
    beta : float, default 0.0
        Smoothing added to every count first (the sampler's β gives the posterior mean).

    Returns
    -------
    numpy.ndarray of float64
        Rows summing to one; an all-zero row becomes uniform.
    """
    c = np.asarray(counts, dtype=np.float64) + beta
    if c.ndim != 2 or (c < 0).any():
        raise ValueError("counts must be a non-negative 2-D matrix")
    sums = c.sum(axis=1, keepdims=True)
    return np.where(sums > 0, c / np.where(sums > 0, sums, 1.0), 1.0 / c.shape[1])


# hand-written: numpy has no top-k mask; a stable argsort keeps ties in column order
def _top_mask(topics: np.ndarray, top_l: int) -> np.ndarray:
    top = np.argsort(-topics, axis=1, kind="stable")[:, :top_l]
    mask = np.zeros(topics.shape, dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    return mask


# hand-written: eq. 29: weighted Jaccard on the top-L words' union; scipy's jaccard is binary
def weighted_jaccard(a: np.ndarray, b: np.ndarray, top_l: int = 20) -> np.ndarray:
    """Weighted Jaccard similarity of every topic of ``a`` with every topic of ``b`` over the
    union of the two topics' top-``top_l`` words (eq. 29).

    Parameters
    ----------
    a : numpy.ndarray of shape (k_a, n_words)
    b : numpy.ndarray of shape (k_b, n_words)
        Normalized topics.
    top_l : int, default 20

    Returns
    -------
    numpy.ndarray of shape (k_a, k_b), values in [0, 1]
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    ma, mb = _top_mask(a, top_l), _top_mask(b, top_l)
    cols = np.flatnonzero(ma.any(axis=0) | mb.any(axis=0))  # only words in some top-L count
    a, b, ma, mb = a[:, cols], b[:, cols], ma[:, cols], mb[:, cols]
    out = np.zeros((a.shape[0], b.shape[0]))
    for i in range(a.shape[0]):
        union = ma[i][None, :] | mb
        lo = np.where(union, np.minimum(a[i][None, :], b), 0.0).sum(axis=1)
        hi = np.where(union, np.maximum(a[i][None, :], b), 0.0).sum(axis=1)
        out[i] = np.where(hi > 0, lo / np.where(hi > 0, hi, 1.0), 0.0)
    return out


# hand-written: iFTM's Alg. 3 (size-weighted group means); the grouping is scipy's DisjointSet
def merge_models(models: Sequence[np.ndarray], sizes: Sequence[float], xi: float = 0.3,
                 top_l: int = 20) -> tuple[np.ndarray, list[np.ndarray]]:
    """Alg. 3: integrate the parties' local models into one global model.

    Parameters
    ----------
    models : sequence of numpy.ndarray, shapes (k_i, n_words)
        Each party's normalized topics; the k_i may differ.
    sizes : sequence of float
        Each party's data size (its tokens), the weight of its topics.
    xi : float, default 0.3
        Topics of two different parties with weighted Jaccard similarity above ξ are merged.
    top_l : int, default 20
        Words per topic the similarity looks at.

    Returns
    -------
    global_topics : numpy.ndarray of shape (k_global, n_words)
        Rows summing to one, in the order each group's first topic appears (party by party).
    assignment : list of numpy.ndarray
        For each party, the global topic each of its topics went into.
    """
    if len(models) != len(sizes) or not models:
        raise ValueError("need one size per model and at least one model")
    models = [np.asarray(m, dtype=np.float64) for m in models]
    offsets = np.concatenate([[0], np.cumsum([m.shape[0] for m in models])])
    n_nodes = int(offsets[-1])
    groups = DisjointSet(range(n_nodes))  # node offsets[p] + a is party p's topic a
    for i in range(len(models)):
        for j in range(i + 1, len(models)):
            sim = weighted_jaccard(models[i], models[j], top_l)
            for a, b in zip(*np.nonzero(sim > xi), strict=True):
                groups.merge(int(offsets[i] + a), int(offsets[j] + b))
    # Global topic g is the g-th group to appear party by party (numbered by first node, not by
    # whichever node the forest made the group's root).
    roots: dict[int, int] = {}
    label = np.array([roots.setdefault(groups[node], len(roots)) for node in range(n_nodes)],
                     dtype=np.int64)
    n_words = models[0].shape[1]
    acc = np.zeros((len(roots), n_words))
    weight = np.zeros(len(roots))
    assignment = []
    for p, (m, size) in enumerate(zip(models, sizes, strict=True)):
        g = label[offsets[p]:offsets[p + 1]]
        np.add.at(acc, g, float(size) * m)
        np.add.at(weight, g, float(size))
        assignment.append(g)
    return topic_normalize(acc / np.maximum(weight, 1e-300)[:, None]), assignment


# hand-written: iFTM's Alg. 4, a thresholded argmax over weighted_jaccard; no library has it
def compose(local: np.ndarray, global_topics: np.ndarray, xi: float = 0.3, top_l: int = 20
            ) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 4: a party's new local model from the global one.

    Parameters
    ----------
    local : numpy.ndarray of shape (k_i, n_words)
    global_topics : numpy.ndarray of shape (k_global, n_words)
    xi : float, default 0.3
    top_l : int, default 20

    Returns
    -------
    composed : numpy.ndarray of shape (k_i, n_words)
        Topic t is the global topic most similar to local topic t when that similarity
        exceeds ξ, else local topic t itself (slots keep their positions, so the party's own
        state stays aligned).
    match : numpy.ndarray of int64, shape (k_i,)
        The global topic used for each slot, -1 where the local topic was kept.
    """
    sim = weighted_jaccard(local, global_topics, top_l)
    best = sim.argmax(axis=1)
    ok = sim[np.arange(len(best)), best] > xi
    composed = np.where(ok[:, None], np.asarray(global_topics)[best], local)
    return composed, np.where(ok, best, -1)
