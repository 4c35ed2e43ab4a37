"""FSTC: federated robust short-text clustering (Hu et al., "Federated Learning for Short Text
Clustering", 2023), with its ablations FSTC-STC and FSTC-RSTC.

Per client, an embedding network Φ (all-MiniLM-L6-v2) and a fully connected clustering head F
give the assignment scores of a batch; P = softmax(F(Φ(x))). Training is unsupervised:

1. **Pseudo-labels by optimal transport** (:func:`sinkhorn`, :func:`pseudo_labels`): with the
   cost M = −log P and the equal-partition constraint (rows sum to 1/N, columns to 1/K), entropic
   Sinkhorn with ε = 0.1 gives the transport ξ, sharpened into Q_ik = ξ_ik² / Σ_k' ξ_ik'².
   Q is refreshed on a logarithmic schedule (:func:`refresh_schedule`), dense early on.
   Here the columns' sums are by default *learned* with the transport (``marginal="learned"``,
   a self-adaptive marginal under a log barrier, as in RSTC, Zheng et al. 2023): the paper's
   equal partition tears large clusters apart and merges small ones, which on unequal data
   ended below the k-means start (issue 29); ``marginal="equal"`` is the paper's.
2. **Robust weighting** (:class:`GaussianUniformMixture`, :func:`robust_weights`): the
   residual e_i = Q_i − P_i is either a correct pseudo-label (Gaussian) or a wrong one
   (uniform); the posterior r_i of "correct" gives w_i = r_i if r_i ≥ 0.5 else 0 and the loss
   L_C = Σ_i w_i ‖Q_i − P_i‖² / Σ_i w_i.
3. **Cluster-centre alignment**: every round the clients send their local centres (mean
   representation of the rows whose pseudo-label is k, and how many rows that is); the server
   combines them weighted by those counts (:func:`aggregate_centers`, the paper's eq. 16) and
   sends the global centres C̃ back; each client adds λ ‖C − C̃‖² to its loss. At the end the
   global model is the sample-weighted average of the client models.
4. **Initialization**: the head starts as the nearest-centre classifier of k-means centres
   (:meth:`FSTCClusterer.init_from_centers`): k-means on every client's representations pooled
   (the paper's, simulation only) or k-FED (:mod:`common.models.kfed`, no representation shared).

Where this code departs from the paper, and why:

* A **neighbour-consistency term** (on by default, ``neighbors=0`` is the paper's FSTC): each
  client mines the nearest neighbours of its own rows once (:func:`nearest_neighbors`) and adds
  −log ⟨P_i, P_j⟩ for one neighbour j of each batch row (SCAN, Van Gansbeke et al. 2020). The
  paper moves the representation (a fine-tuned Φ); with a frozen one, only the head moves, and
  neighbours are the one signal it has besides the transport. Nothing more travels.
  The neighbours are found on a **joined view** (:func:`neighbor_view`): the representation
  beside a 32-dimensional LSA of the client's own TF-IDF (weight 0.5), so that titles naming the
  same rare keyword (a product, a library) are neighbours even where the sentence embedding
  places them by what they ask. The head still reads Φ alone; the view only picks the pairs.
  With it comes SCAN's other half, a **balance term** (``balance_weight=5``, SCAN's weight):
  KL(mean P of the batch ‖ b), b the transport's marginal (uniform under the equal prior): the
  sizes the transport asks for, restated where the mixture weighting otherwise undoes them by
  dropping the very rows the transport moves.

* P (the softmax) stands for the paper's O in the loss and in the mixture: Q and P both live on
  the probability simplex, which is what gives the uniform outlier density a bounded support.
* The mixture's Gaussian has a mean, and one mixture is fit per pseudo-label; the reasons,
  measured, are in :class:`GaussianUniformMixture` and :func:`robust_weights`.
* The batch centres C of the alignment loss are *soft* (C_k = Σ_i P_ik h_i / Σ_i P_ik): with a
  frozen encoder the hard mean of the rows labelled k has no gradient at all, so the alignment
  could not act. The centres a client *uploads* are the paper's hard ones.
* The pseudo-labels are computed over all of a client's rows at each refresh (not per batch),
  which makes the equal-partition marginals exact; on a GPU with a fine-tuned encoder this is
  one forward pass over the local data per refresh.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.special import lambertw
from sklearn.cluster import KMeans
from threadpoolctl import threadpool_limits
from torch import nn

from common.eval.classification import classification_metrics
from common.eval.clustering import cluster_mapping, cluster_sizes, clustering_metrics
from common.models.kfed import combine_centers, local_kmeans
from common.state import generator_state, set_generator_state

#: Names of the arrays a worker uploads and the master publishes.
CENTERS, COUNTS = "centers", "counts"

__all__ = ["CENTERS", "COUNTS", "VARIANTS", "MARGINALS", "ENCODERS", "INITS", "sinkhorn", "sharpen",
           "pseudo_labels",
           "refresh_schedule", "GaussianUniformMixture", "robust_weights", "hard_centers",
           "nearest_neighbors", "neighbor_view",
           "aggregate_centers", "FSTCParams", "FSTCClusterer", "FederatedFSTC",
           "score_clustering"]

VARIANTS = ("stc", "rstc", "fstc")
MARGINALS = ("learned", "equal")
ENCODERS = ("frozen", "finetune")
INITS = ("kfed", "pooled")


# --------------------------------------------------------------------------------------------
# Pseudo-labels by optimal transport
# --------------------------------------------------------------------------------------------


def sinkhorn(log_p: np.ndarray, epsilon: float = 0.1, max_iter: int = 10000, tol: float = 1e-6,
             marginal_weight: float | None = None) -> np.ndarray:
    """Entropic optimal transport of N rows onto K clusters, cost M = −log P.

    With ``marginal_weight`` None (the paper's), the clusters are equal: min_ξ ⟨ξ, M⟩ − ε H(ξ)
    subject to ξ 1 = 1/N and ξᵀ 1 = 1/K, whose solution is ξ = diag(u) P^(1/ε) diag(v), u and v
    from alternating scalings (Cuturi 2013).

    With a weight τ, the cluster sizes are learned with the transport (a self-adaptive marginal,
    as in RSTC, Zheng et al. 2023): min over ξ and b of ⟨ξ, M⟩ − ε H(ξ) − τ Σ_k log b_k subject
    to ξ 1 = 1/N and ξᵀ 1 = b. The log barrier keeps every cluster alive (b_k → 0 costs ∞) but
    lets the sizes follow the data: the larger τ, the nearer b stays to equal (τ → ∞ is the
    equal partition, τ → 0 the rows' own argmax). Its dual is concave; exact coordinate ascent
    on the column potential g_k solves g_k e^(g_k/ε) (Kᵀu)_k = τ, so the column scaling is
    v_k = exp(W(τ / (ε (Kᵀu)_k))), W the Lambert function, and b_k = τ / (ε log v_k): one line
    of Sinkhorn changes. (RSTC updates b by Newton steps on a different penalty; this is our
    own derivation.)

    Each row of P^(1/ε) is first divided by its largest entry — a factor u absorbs — so that
    P^10 of a confident row does not underflow.

    Parameters
    ----------
    log_p : numpy.ndarray of shape (N, K)
        Log-probabilities log P (rows of P sum to 1).
    epsilon : float, default 0.1
        Entropic regularization ε.
    max_iter : int, default 10000
        Most scaling iterations (each one row and one column scaling).
    tol : float, default 1e-6
        Stop once, right after a column scaling, every row sum is within a relative ``tol`` of
        1/N. A last row scaling makes the rows exact; the columns stay within about ``tol``.
    marginal_weight : float or None, default None
        τ of the learned marginal; None: equal clusters.

    Returns
    -------
    numpy.ndarray of shape (N, K), float64
        The transport ξ: rows sum to 1/N, columns to 1/K (or to the learned b).
    """
    log_kernel = np.asarray(log_p, dtype=np.float64) / epsilon
    kernel = np.exp(log_kernel - log_kernel.max(axis=1, keepdims=True))
    n, k = kernel.shape
    # v is kept as log v: with a learned marginal it is exp(τ / (ε b_k)), far beyond float64
    # for τ of 1 or more. u is kept as ũ = u · max(v), which stays in range.
    log_v = np.zeros(k)
    for it in range(max_iter):
        shift = log_v.max()
        u = (1.0 / n) / (kernel @ np.exp(log_v - shift))
        # A cluster no row can reach has a zero column; the floor keeps v finite.
        column = np.maximum(kernel.T @ u, 1e-300)  # (Kᵀu)_k · e^shift
        if marginal_weight is None:
            log_v = np.log(1.0 / k) - np.log(column) + shift
        else:
            log_v = _log_lambertw(np.log(marginal_weight / epsilon) - np.log(column) + shift)
        if it % 10 == 9 and np.abs(n * (kernel @ np.exp(log_v - log_v.max())) * u
                                   * np.exp(log_v.max() - shift) - 1.0).max() < tol:
            break
    v = np.exp(log_v - log_v.max())
    u = (1.0 / n) / (kernel @ v)
    return u[:, None] * kernel * v[None, :]


def _log_lambertw(log_x: np.ndarray) -> np.ndarray:
    """W(x) of x = exp(log_x), for x beyond float64 too: W + log W = log x by Newton's method
    where scipy's ``lambertw`` would overflow."""
    log_x = np.asarray(log_x, dtype=np.float64)
    small = log_x < 500
    w = np.empty_like(log_x)
    w[small] = lambertw(np.exp(log_x[small])).real
    big = log_x[~small]
    if big.size:
        wb = big - np.log(big)
        for _ in range(8):  # quadratic convergence from an error of log(log x)/log x
            wb -= (wb + np.log(wb) - big) / (1.0 + 1.0 / wb)
        w[~small] = wb
    return w


def sharpen(xi: np.ndarray) -> np.ndarray:
    """Q_ik = ξ_ik² / Σ_k' ξ_ik'²: rows on the simplex, confident rows more so."""
    sq = np.square(xi / xi.max(axis=1, keepdims=True))  # scaled first: ξ² underflows
    return sq / sq.sum(axis=1, keepdims=True)


def pseudo_labels(log_p: np.ndarray, epsilon: float = 0.1,
                  marginal_weight: float | None = None) -> np.ndarray:
    """The pseudo-labels Q of rows with log-probabilities ``log_p`` (:func:`sinkhorn`, then
    :func:`sharpen`)."""
    return sharpen(sinkhorn(log_p, epsilon, marginal_weight=marginal_weight))


def refresh_schedule(total_iterations: int, n_refresh: int = 40) -> np.ndarray:
    """Iterations (from 0) at which the pseudo-labels are recomputed: log-spaced over the run.

    Dense while the head moves fast, sparse once it settles, as in self-labelling (Asano et al.
    2020). Always includes iteration 0; at most ``n_refresh`` distinct iterations.
    """
    if total_iterations < 1 or n_refresh < 1:
        raise ValueError("total_iterations and n_refresh must be >= 1")
    steps = np.floor(np.geomspace(1, total_iterations, n_refresh)).astype(np.int64) - 1
    return np.unique(steps)


# --------------------------------------------------------------------------------------------
# Robust weighting: a Gaussian-uniform mixture over the residuals Q - P
# --------------------------------------------------------------------------------------------


class GaussianUniformMixture:
    """Is a pseudo-label right? A two-component mixture over the residuals e_i = Q_i − P_i.

    A right pseudo-label agrees with the model up to a typical gap: e_i ~ N(μ, Σ),
    Σ = diag(σ²_1, …, σ²_K). A wrong one can be anything: e_i ~ U, uniform with density γ over
    the box the residuals span. With π the share of right labels, EM runs

    * E-step (eq. 9):  r_i = π N(e_i; μ, Σ) / (π N(e_i; μ, Σ) + (1 − π) γ)
    * π  (eq. 10):     π = (1/N) Σ_i r_i
    * μ, Σ (eq. 11):   μ = Σ_i r_i e_i / Σ_i r_i,   σ²_k = Σ_i r_i (e_ik − μ_k)² / Σ_i r_i
    * γ  (eq. 12):     γ = Π_k 1 / (max_i e_ik − min_i e_ik)

    The Gaussian has a mean, where the paper's is centred on the model's output (μ = 0): the
    sharpened Q is systematically more confident than P (early on, P's top probability averages
    0.46 and Q's 0.96 on AG News), so no residual lies near 0 and a zero-mean Gaussian loses
    every row to the uniform (π → 0, nothing kept, nothing learned). Densities are handled as
    logarithms (K factors of small variances overflow).

    Parameters
    ----------
    n_iter : int, default 50
        Most EM iterations.
    tol : float, default 1e-5
        Stop when π changes by less than this.
    init_pi : float, default 0.5
    var_floor : float, default 1e-6
        Smallest σ²_k and box side, so that a component cannot collapse onto a point.

    Attributes
    ----------
    pi_ : float
    mean_ : numpy.ndarray of shape (K,)
        μ.
    var_ : numpy.ndarray of shape (K,)
        The σ²_k.
    log_gamma_ : float
        log γ.
    posterior_ : numpy.ndarray of shape (N,)
        r_i of the rows passed to :meth:`fit`.
    n_iter_ : int
    """

    def __init__(self, n_iter: int = 50, tol: float = 1e-5, init_pi: float = 0.5,
                 var_floor: float = 1e-6) -> None:
        self.n_iter = n_iter
        self.tol = tol
        self.init_pi = init_pi
        self.var_floor = var_floor

    def _log_gauss(self, e: np.ndarray) -> np.ndarray:
        return -0.5 * (np.log(2 * np.pi * self.var_).sum()
                       + ((e - self.mean_) ** 2 / self.var_).sum(axis=1))

    def posterior(self, e: np.ndarray) -> np.ndarray:
        """r_i of residuals ``e`` under the fitted parameters (eq. 9)."""
        e = np.asarray(e, dtype=np.float64)
        right = np.log(self.pi_) + self._log_gauss(e)
        wrong = np.log1p(-self.pi_) + self.log_gamma_
        return np.exp(right - np.logaddexp(right, wrong))

    def fit(self, e: np.ndarray) -> GaussianUniformMixture:
        """EM on residuals ``e`` of shape (N, K)."""
        e = np.asarray(e, dtype=np.float64)
        if e.ndim != 2 or len(e) < 2:
            raise ValueError(f"expected residuals of shape (N >= 2, K), got {e.shape}")
        side = np.maximum(e.max(axis=0) - e.min(axis=0), np.sqrt(self.var_floor))
        self.log_gamma_ = float(-np.log(side).sum())
        self.pi_ = float(self.init_pi)
        self.mean_ = e.mean(axis=0)
        self.var_ = np.maximum(e.var(axis=0), self.var_floor)
        for it in range(1, self.n_iter + 1):
            self.n_iter_ = it
            r = self.posterior(e)
            total = max(r.sum(), 1e-12)
            pi = float(np.clip(r.mean(), 1e-6, 1 - 1e-6))
            self.mean_ = (r @ e) / total
            self.var_ = np.maximum((r @ (e - self.mean_) ** 2) / total, self.var_floor)
            done = abs(pi - self.pi_) < self.tol
            self.pi_ = pi
            if done:
                break
        self.posterior_ = self.posterior(e)
        return self

    def weights(self, e: np.ndarray | None = None, threshold: float = 0.5) -> np.ndarray:
        """w_i = r_i where r_i ≥ ``threshold``, else 0 (of the fitted rows by default)."""
        r = self.posterior_ if e is None else self.posterior(e)
        return np.where(r >= threshold, r, 0.0)


def robust_weights(Q: np.ndarray, P: np.ndarray, min_rows: int = 10) -> tuple[np.ndarray, float]:
    """The weights w of the rows of one client: a :class:`GaussianUniformMixture` per
    pseudo-label (rows whose argmax Q is k), over e = Q − P.

    Per pseudo-label, because one mixture over all rows starves the clusters the head
    under-predicts: there the transport moves rows against the head, their residuals look
    wrong, they are dropped, and the cluster shrinks further (on AG News a shared mixture
    took ACC from 78% to 52% in 2,000 iterations).

    Parameters
    ----------
    Q, P : numpy.ndarray of shape (N, K)
        Pseudo-labels and the head's probabilities.
    min_rows : int, default 10
        A pseudo-label with fewer rows keeps them all (w = 1): too few to fit a mixture.

    Returns
    -------
    w : numpy.ndarray of shape (N,)
    pi : float
        The mixtures' π, weighted by their rows.
    """
    labels = Q.argmax(axis=1)
    w = np.ones(len(Q))
    pis = np.ones(Q.shape[1])
    sizes = np.bincount(labels, minlength=Q.shape[1])
    for k in np.flatnonzero(sizes >= min_rows):
        rows = np.flatnonzero(labels == k)
        gum = GaussianUniformMixture().fit(Q[rows] - P[rows])
        w[rows], pis[k] = gum.weights(), gum.pi_
    return w, float(pis @ sizes / max(sizes.sum(), 1))


# --------------------------------------------------------------------------------------------
# Cluster centres
# --------------------------------------------------------------------------------------------


def nearest_neighbors(H: np.ndarray, n_neighbors: int) -> np.ndarray:
    """The ``n_neighbors`` nearest rows of every row of ``H`` (itself excluded), by cosine."""
    from sklearn.neighbors import NearestNeighbors

    k = min(n_neighbors, H.shape[0] - 1)
    nn_ = NearestNeighbors(n_neighbors=k + 1, metric="cosine").fit(H)
    return nn_.kneighbors(H, return_distance=False)[:, 1:]


def neighbor_view(H: np.ndarray, texts: Sequence[str] | None = None, lsa_dims: int = 32,
                  lsa_weight: float = 0.5, random_state: int = 0) -> np.ndarray:
    """The rows a client mines its neighbours on: ``H`` (L2-normalized), joined, when
    ``texts`` are given, with ``lsa_weight`` × the L2-normalized ``lsa_dims``-component LSA of
    their TF-IDF.

    Everything is fit on these texts alone (one client's): no vocabulary is agreed and nothing
    leaves the client. Few dimensions on purpose: on one StackOverflow client, 10 neighbours
    share their tag 72.6 % of the time on the embedding alone, 82.3 % beside a 32-dimensional
    LSA and 76.7 % beside a 128-dimensional one (docs/FSTC.md).

    Parameters
    ----------
    H : numpy.ndarray of shape (n, d)
        The representations.
    texts : sequence of str or None, default None
        The same n documents; None (or ``lsa_dims=0``, ``lsa_weight=0``) gives ``H`` alone.
    lsa_dims : int, default 32
        LSA components; fewer when the vocabulary or the rows are fewer.
    lsa_weight : float, default 0.5
    random_state : int, default 0
        Seeds the randomized SVD.

    Returns
    -------
    numpy.ndarray of shape (n, d) or (n, d + components)
    """
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    U = normalize(np.asarray(H, dtype=np.float64))
    if texts is None or lsa_dims < 1 or lsa_weight <= 0:
        return U
    if len(texts) != len(U):
        raise ValueError(f"texts: expected {len(U)} (one per row), got {len(texts)}")
    try:
        T = TfidfVectorizer(stop_words="english", min_df=2, sublinear_tf=True
                            ).fit_transform(texts)
    except ValueError:  # no word in two documents: nothing for LSA to add
        return U
    dims = min(lsa_dims, T.shape[1] - 1, T.shape[0] - 1)
    if dims < 1:
        return U
    L = TruncatedSVD(dims, random_state=random_state).fit_transform(T)
    return np.hstack([U, lsa_weight * normalize(L)])


def hard_centers(H: np.ndarray, labels: np.ndarray, n_clusters: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """C_k = mean of the rows of ``H`` labelled k, and the counts n_k (zeros for empty k).

    Returns
    -------
    centers : numpy.ndarray of shape (n_clusters, d), float32
    counts : numpy.ndarray of shape (n_clusters,), float32
    """
    H = np.asarray(H, dtype=np.float64)
    counts = np.bincount(labels, minlength=n_clusters).astype(np.float64)
    sums = np.zeros((n_clusters, H.shape[1]))
    np.add.at(sums, labels, H)
    centers = sums / np.maximum(counts, 1)[:, None]
    return centers.astype(np.float32), counts.astype(np.float32)


def aggregate_centers(centers: Sequence[np.ndarray], counts: Sequence[np.ndarray],
                      previous: np.ndarray | None = None) -> np.ndarray:
    """The server's eq. 16: C̃_k = Σ_m n_k^m C_k^m / Σ_m n_k^m.

    A cluster no client holds keeps its ``previous`` centre (zeros without one).
    """
    C = np.stack([np.asarray(c, dtype=np.float64) for c in centers])
    n = np.stack([np.asarray(c, dtype=np.float64) for c in counts])
    total = n.sum(axis=0)
    out = np.einsum("mk,mkd->kd", n, C) / np.maximum(total, 1e-12)[:, None]
    if previous is not None:
        out[total <= 0] = np.asarray(previous, dtype=np.float64)[total <= 0]
    else:
        out[total <= 0] = 0.0
    return out.astype(np.float32)


def centers_as_sum(arrays: Mapping[str, np.ndarray], n_samples: int, n_max: int, clip: float
                   ) -> tuple[np.ndarray, float]:
    """A worker's eq. 16 terms as one vector for secure aggregation (whose sum is all the
    server sees): ``n_k / n_max · C_k`` for each centre, then ``clip · n_k / n_max``; with the
    final round's head, ``n / n_max`` times each of its values, then ``clip · n / n_max``.
    Values are clipped to ``[-clip, clip]`` (the weights, at most 1, are scaled by ``clip`` to
    fit it however small it is); returns the vector and the share of values clipped."""
    C = np.asarray(arrays[CENTERS], dtype=np.float64)
    w = np.asarray(arrays[COUNTS], dtype=np.float64) / n_max
    parts = [(w[:, None] * np.clip(C, -clip, clip)).ravel(), w * clip]
    clipped, total = int(np.count_nonzero(np.abs(C) > clip)), C.size
    r = n_samples / n_max
    for name in ("head.weight", "head.bias") if "head.weight" in arrays else ():
        a = np.asarray(arrays[name], dtype=np.float64).ravel()
        clipped, total = clipped + int(np.count_nonzero(np.abs(a) > clip)), total + a.size
        parts.append(r * np.clip(a, -clip, clip))
    parts.append(np.array([r * clip]))
    return np.concatenate(parts), clipped / total


def centers_size(k: int, dim: int, with_head: bool) -> int:
    """Length of :func:`centers_as_sum`'s vector."""
    return k * dim + k + (k * dim + k if with_head else 0) + 1


#: Most clusters a job may ask for (the master refuses a registration past it).
MAX_CLUSTERS = 10_000
#: How far past the clip a value of :func:`centers_from_sum` may be from the secure sum's
#: fixed-point rounding alone, divided by small weights (relative to the clip).
CLIP_SLACK = 1e-3
HEAD = ("head.weight", "head.bias")


def centers_from_sum(total: np.ndarray, k: int, dim: int, with_head: bool, n_max: int,
                     previous: np.ndarray, clip: float) -> dict[str, np.ndarray]:
    """Eq. 16 from the sum of the workers' :func:`centers_as_sum` vectors: the centres (a
    cluster no worker holds keeps ``previous``), their counts, and the head's sample-weighted
    average when it came."""
    s = np.asarray(total, dtype=np.float64).copy()
    s[k * dim:k * dim + k] /= clip  # the weights back from their scaled form
    s[-1] /= clip
    counts = np.rint(np.maximum(s[k * dim:k * dim + k] * n_max, 0.0))  # whole documents
    held = counts > 0
    centers = np.asarray(previous, dtype=np.float64).copy()
    centers[held] = (s[:k * dim].reshape(k, dim)[held]
                     / (s[k * dim:k * dim + k][held, None]))
    out = {CENTERS: centers.astype(np.float32), COUNTS: counts.astype(np.float32)}
    if with_head:
        at, r = k * dim + k, s[-1]
        out["head.weight"] = (s[at:at + k * dim] / r).reshape(k, dim).astype(np.float32)
        out["head.bias"] = (s[at + k * dim:at + k * dim + k] / r).astype(np.float32)
    # Each value is a weighted mean of values every member clipped to [-clip, clip]: one past
    # it (beyond the sum's rounding) was forged, e.g. centres at the clip weighed as one
    # document, which the division by the counts would carry to clip × n_max.
    # (A centre no member holds keeps its previous value, which was never clipped.)
    for name, a in ((CENTERS, out[CENTERS][held]), *((n, out[n]) for n in HEAD if n in out)):
        top = float(np.abs(a).max()) if a.size else 0.0
        if top > clip * (1 + CLIP_SLACK):
            raise ValueError(f"{name}: a value of {top:.3g} past the clip {clip:g}, which no "
                             f"member's clipped input can give: a secure input was forged")
    return out


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


def _thread_limit(encoder: str, device: str) -> AbstractContextManager:
    """One thread for a frozen encoder on a CPU, else the thread pools as they are.

    A K × 384 head on 200 rows (and k-means on a few thousand) is far too small for thread
    pools: on a shared CPU their threads spin more than they compute (measured: 20 s of CPU for
    a run that takes 4 s on one thread). A fine-tuned encoder, or a GPU, keeps them.
    """
    if encoder == "frozen" and device == "cpu":
        return threadpool_limits(1)
    return nullcontext()



@dataclass
class FSTCParams:
    """Hyperparameters of the ``fstc`` family (the ``model`` section of cluster.yaml).

    Parameters
    ----------
    n_clusters : int, default 0
        K; 0 means the number of classes of the task (as in the paper).
    variant : {"fstc", "rstc", "stc"}, default "fstc"
        ``stc``: optimal-transport pseudo-labels only; ``rstc``: plus the mixture weighting;
        ``fstc``: plus the cluster-centre alignment.
    align_weight : float, default 1.0
        λ of the alignment loss (the paper: 0.01 on StackOverflow, 1 elsewhere).
    lr_head : float, default 2e-3
        Adam learning rate of the head F (the paper: 5e-4, beside a fine-tuned encoder; with a
        frozen one and the neighbour term, 2e-3 scores higher on both benchmark datasets).
    lr_encoder : float, default 5e-6
        Adam learning rate of the encoder Φ (``encoder: finetune`` only).
    iterations : int, default 100
        Local iterations (mini-batches) per round.
    batch_size : int, default 200
    epsilon : float, default 0.1
        Sinkhorn's entropic regularization.
    n_refresh : int, default 40
        Pseudo-label refreshes over the whole run (log-spaced).
    temperature : float, default 0.1
        τ of the head's nearest-centre initialization.
    encoder : {"frozen", "finetune"}, default "frozen"
        ``frozen``: the cached sentence embeddings, only the head trains (fast on a CPU);
        ``finetune``: Φ trains too, from the texts (meant for a GPU).
    max_length : int, default 32
        Token limit of the fine-tuned encoder.
    init : {"kfed", "pooled"}, default "kfed"
        ``kfed``: k-means on each client, the server clusters the local centres (nothing else
        shared); ``pooled``: k-means on all clients' representations (the paper's; only where
        the master can see all the data, a simulated cluster).
    neighbors : int, default 10
        Nearest neighbours per row (among the client's own rows, cosine on Φ at the start) for
        the neighbour-consistency term −log ⟨P_i, P_j⟩; 0 turns it off (the paper's FSTC).
    neighbor_weight : float, default 1.0
        Weight of that term.
    neighbor_lsa_dims : int, default 32
        The neighbours are found on Φ joined with this many LSA components of the client's own
        TF-IDF (:func:`neighbor_view`); 0 finds them on Φ alone.
    neighbor_lsa_weight : float, default 0.5
        Weight of the LSA part of that view (against Φ's, 1).
    balance_weight : float, default 5.0
        Weight of KL(mean P of the batch ‖ b), b the transport's marginal (uniform when
        ``marginal="equal"``): it keeps the head's cluster sizes where the transport puts them;
        0 turns it off (the paper's FSTC).
    marginal : {"learned", "equal"}, default "learned"
        The transport's cluster sizes: ``learned`` with the transport (a self-adaptive
        marginal under a log barrier, :func:`sinkhorn`), ``equal`` the paper's N/K each, for
        data known to have equal clusters.
    marginal_weight : float, default 0.01
        τ of the learned marginal's barrier: larger keeps the sizes nearer equal.
    """

    n_clusters: int = 0
    variant: str = "fstc"
    align_weight: float = 1.0
    lr_head: float = 2e-3
    lr_encoder: float = 5e-6
    iterations: int = 100
    batch_size: int = 200
    epsilon: float = 0.1
    n_refresh: int = 40
    temperature: float = 0.1
    encoder: str = "frozen"
    max_length: int = 32
    init: str = "kfed"
    neighbors: int = 10
    neighbor_weight: float = 1.0
    neighbor_lsa_dims: int = 32
    neighbor_lsa_weight: float = 0.5
    balance_weight: float = 5.0
    marginal: str = "learned"
    marginal_weight: float = 0.01

    def __post_init__(self) -> None:
        for name, allowed in (("variant", VARIANTS), ("encoder", ENCODERS), ("init", INITS),
                              ("marginal", MARGINALS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        if self.n_clusters < 0 or self.n_clusters == 1 or self.n_clusters > MAX_CLUSTERS:
            raise ValueError(f"n_clusters: expected 0 (the number of classes) or 2 to "
                             f"{MAX_CLUSTERS:,}")
        for name in ("iterations", "batch_size", "n_refresh", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1")
        for name, off in (("neighbors", "no neighbour term"), ("neighbor_lsa_dims", "Φ alone")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an integer >= 0 (0: {off})")
        for name in ("align_weight", "neighbor_weight", "neighbor_lsa_weight", "balance_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a number >= 0")
        for name in ("lr_head", "lr_encoder", "epsilon", "temperature", "marginal_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a number > 0")

    def clusterer(self, n_clusters: int, total_iterations: int | None = None,
                  random_state: int = 0, device: str = "cpu", iterations: int | None = None
                  ) -> FSTCClusterer:
        """A fresh :class:`FSTCClusterer` with these hyperparameters (``iterations`` overrides
        the per-round count, e.g. for a whole run in one call)."""
        return FSTCClusterer(n_clusters, variant=self.variant, align_weight=self.align_weight,
                             lr_head=self.lr_head, lr_encoder=self.lr_encoder,
                             iterations=iterations or self.iterations,
                             batch_size=self.batch_size,
                             epsilon=self.epsilon, n_refresh=self.n_refresh,
                             total_iterations=total_iterations, temperature=self.temperature,
                             encoder=self.encoder, max_length=self.max_length,
                             neighbors=self.neighbors, neighbor_weight=self.neighbor_weight,
                             neighbor_lsa_dims=self.neighbor_lsa_dims,
                             neighbor_lsa_weight=self.neighbor_lsa_weight,
                             balance_weight=self.balance_weight, marginal=self.marginal,
                             marginal_weight=self.marginal_weight,
                             random_state=random_state, device=device)


class FSTCClusterer:
    """One client's FSTC model: encoder Φ, clustering head F, and its training state.

    Parameters
    ----------
    n_clusters : int, default 8
        K.
    variant : {"fstc", "rstc", "stc"}, default "fstc"
        See :class:`FSTCParams`.
    align_weight : float, default 1.0
        λ; used by ``fstc`` when :meth:`fit` is given global centres.
    lr_head : float, default 2e-3
    lr_encoder : float, default 5e-6
    iterations : int, default 100
        Mini-batch iterations per call to :meth:`fit` (one round).
    batch_size : int, default 200
    epsilon : float, default 0.1
    n_refresh : int, default 40
    total_iterations : int or None, default None
        Length of the whole run, for the refresh schedule (rounds × iterations on a cluster);
        None means ``iterations`` (one call to :meth:`fit` is the run).
    temperature : float, default 0.1
    encoder : {"frozen", "finetune"}, default "frozen"
        ``frozen``: :meth:`fit` and :meth:`predict` take sentence embeddings (n, d);
        ``finetune``: they take the texts (list of str) and Φ trains.
    max_length : int, default 32
    neighbors : int, default 10
    neighbor_weight : float, default 1.0
    neighbor_lsa_dims : int, default 32
    neighbor_lsa_weight : float, default 0.5
        See :class:`FSTCParams`; the LSA part needs the texts (:meth:`fit`'s ``texts``).
    balance_weight : float, default 5.0
    marginal : {"learned", "equal"}, default "learned"
    marginal_weight : float, default 0.01
        See :class:`FSTCParams`.
    model_path : str or None, default None
        The sentence-transformers folder for ``finetune`` (None: the bundled all-MiniLM-L6-v2).
    random_state : int, default 0
        Seeds the k-means initialization and the batch order.
    device : str, default "cpu"

    Attributes
    ----------
    head_ : torch.nn.Linear
        F: representation -> K scores.
    encoder_ : torch.nn.Module or None
        Φ when fine-tuned.
    cluster_centers_ : numpy.ndarray of shape (K, d)
        Hard local centres after the last :meth:`fit` (mean representation per pseudo-label).
    counts_ : numpy.ndarray of shape (K,)
        Rows behind each of them.
    predicted_counts_ : numpy.ndarray of shape (K,)
        Rows the head itself puts in each cluster (argmax P) after the last :meth:`fit`, read
        off the same forward pass as the centres.
    pseudo_labels_ : numpy.ndarray of shape (n, K)
        The current Q.
    weights_ : numpy.ndarray of shape (n,)
        The current w (ones for ``stc``).
    marginal_ : numpy.ndarray of shape (K,)
        The transport's cluster sizes at the last refresh, as shares (1/K each when
        ``marginal="equal"``).
    neighbors_ : numpy.ndarray of shape (n, neighbors)
        Each row's nearest neighbours (row indices), when the neighbour term is on.
    neighbor_view_ : {"embedding+lsa", "embedding"}
        What they were found on: Φ joined with the texts' LSA, or Φ alone (no texts given,
        or ``neighbor_lsa_dims=0``).
    n_iter_ : int
        Iterations run so far, over all calls to :meth:`fit`.
    last_loss_ : float
        Mean total loss of the last :meth:`fit`.
    history_ : list of dict
        Per call to :meth:`fit`: loss, clustering, alignment, neighbour and balance losses,
        kept share, π.
    """

    def __init__(self, n_clusters: int = 8, variant: str = "fstc", align_weight: float = 1.0,
                 lr_head: float = 2e-3, lr_encoder: float = 5e-6, iterations: int = 100,
                 batch_size: int = 200, epsilon: float = 0.1, n_refresh: int = 40,
                 total_iterations: int | None = None, temperature: float = 0.1,
                 encoder: str = "frozen", max_length: int = 32, model_path: str | None = None,
                 neighbors: int = 10, neighbor_weight: float = 1.0,
                 neighbor_lsa_dims: int = 32, neighbor_lsa_weight: float = 0.5,
                 balance_weight: float = 5.0, marginal: str = "learned",
                 marginal_weight: float = 0.01,
                 random_state: int = 0, device: str = "cpu") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
        if marginal not in MARGINALS:
            raise ValueError(f"marginal must be one of {MARGINALS}, got {marginal!r}")
        self.n_clusters = n_clusters
        self.variant = variant
        self.align_weight = align_weight
        self.lr_head = lr_head
        self.lr_encoder = lr_encoder
        self.iterations = iterations
        self.batch_size = batch_size
        self.epsilon = epsilon
        self.n_refresh = n_refresh
        self.total_iterations = total_iterations
        self.temperature = temperature
        self.encoder = encoder
        self.max_length = max_length
        self.model_path = model_path
        self.neighbors = neighbors
        self.neighbor_weight = neighbor_weight
        self.neighbor_lsa_dims = neighbor_lsa_dims
        self.neighbor_lsa_weight = neighbor_lsa_weight
        self.balance_weight = balance_weight
        self.marginal = marginal
        self.marginal_weight = marginal_weight
        self.random_state = random_state
        self.device = device
        self.head_: nn.Linear | None = None
        self.encoder_: nn.Module | None = None
        self.n_iter_ = 0
        self.history_: list[dict[str, float]] = []
        self.last_loss_ = float("nan")
        self._rng = np.random.default_rng(random_state)
        self._schedule = set(refresh_schedule(total_iterations or iterations, n_refresh).tolist())
        self._optimizer: torch.optim.Optimizer | None = None

    # -- representations -------------------------------------------------------------------
    def _load_encoder(self) -> nn.Module:
        if self.encoder_ is None:
            import os

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            from common.data.embedding import default_model_path

            st = SentenceTransformer(self.model_path or default_model_path(), device=self.device)
            st.max_seq_length = self.max_length
            self.encoder_ = st
        return self.encoder_

    def _embed(self, X: Any, rows: np.ndarray | None = None, grad: bool = False
               ) -> torch.Tensor:
        """Φ of the given rows: the embeddings themselves (frozen) or the encoder's output."""
        if self.encoder == "frozen":
            A = np.asarray(X if rows is None else X[rows], dtype=np.float32)
            return torch.as_tensor(A, device=self.device)
        st = self._load_encoder()
        texts = list(X) if rows is None else [X[i] for i in rows]
        # sentence-transformers >= 6 names it preprocess (tokenize is deprecated there); its
        # output also holds non-tensor entries (the modality), which stay as they are.
        prepare = getattr(st, "preprocess", None) or st.tokenize

        def features(batch: list[str]) -> dict[str, Any]:
            return {k: v.to(self.device) if torch.is_tensor(v) else v
                    for k, v in prepare(batch).items()}

        if grad:
            st.train()
            return st(features(texts))["sentence_embedding"]
        st.eval()
        with torch.no_grad():
            out = [st(features(texts[i:i + 256]))["sentence_embedding"]
                   for i in range(0, len(texts), 256)]
        return torch.cat(out)

    def transform(self, X: Any) -> np.ndarray:
        """The representations Φ(x) (the input itself for a frozen encoder)."""
        return self._embed(X).cpu().numpy()

    # -- initialization --------------------------------------------------------------------
    def init_from_centers(self, centers: np.ndarray) -> FSTCClusterer:
        """Start F as the nearest-centre classifier of ``centers`` (K × d), at temperature τ:
        F_k(h) = (h·c_k − ‖c_k‖²/2) / τ = −‖h − c_k‖² / 2τ + const."""
        C = torch.as_tensor(np.asarray(centers, dtype=np.float32))
        if C.shape[0] != self.n_clusters:
            raise ValueError(f"expected {self.n_clusters} centres, got {C.shape[0]}")
        self.head_ = nn.Linear(C.shape[1], self.n_clusters).to(self.device)
        with torch.no_grad():
            self.head_.weight.copy_(C / self.temperature)
            self.head_.bias.copy_(-(C**2).sum(dim=1) / (2 * self.temperature))
        self._optimizer = None
        return self

    def _init_kmeans(self, X: Any) -> None:
        km = KMeans(self.n_clusters, n_init=10, random_state=self.random_state)
        self.init_from_centers(km.fit(self.transform(X)).cluster_centers_)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        groups = [{"params": self.head_.parameters(), "lr": self.lr_head}]
        if self.encoder == "finetune":
            groups.append({"params": self._load_encoder().parameters(), "lr": self.lr_encoder})
        # Not fused: its one-ulp differences move FSTC's chaotic seeds (the committed tables
        # reproduce to the digit), and the head's few thousand weights gain nothing from it.
        return torch.optim.Adam(groups)

    # -- training --------------------------------------------------------------------------
    @property
    def _tau(self) -> float | None:
        """τ of the transport's learned marginal; None: equal sizes."""
        return self.marginal_weight if self.marginal == "learned" else None

    def _set_marginal(self, b: np.ndarray) -> None:
        """Keep the transport's sizes b, and log b on the device for the balance term."""
        self.marginal_ = np.asarray(b, dtype=np.float64)
        self._log_marginal = torch.as_tensor(np.log(np.maximum(self.marginal_, 1e-12)),
                                             dtype=torch.float32, device=self.device)

    def _refresh(self, X: Any) -> None:
        """Recompute Q, the transport's marginal (and, for rstc/fstc, the mixture weights w)
        over all rows."""
        with torch.no_grad():
            log_p = torch.log_softmax(self.head_(self._embed(X)), dim=1).double().cpu().numpy()
        xi = sinkhorn(log_p, self.epsilon, marginal_weight=self._tau)
        Q = sharpen(xi)
        self._set_marginal(xi.sum(axis=0) / xi.sum())
        if self.variant == "stc":
            w, self._pi = np.ones(len(Q)), 1.0
        else:
            w, self._pi = robust_weights(Q, np.exp(log_p))
        self.pseudo_labels_, self.weights_ = Q, w
        self._q = torch.as_tensor(Q, dtype=torch.float32, device=self.device)
        self._w = torch.as_tensor(w, dtype=torch.float32, device=self.device)

    def fit(self, X: Any, global_centers: np.ndarray | None = None,
            texts: Sequence[str] | None = None) -> FSTCClusterer:
        """Run ``iterations`` mini-batch iterations on ``X`` (continuing any earlier call).

        Parameters
        ----------
        X : numpy.ndarray of shape (n, d), or list of str
            Sentence embeddings (``encoder="frozen"``) or texts (``"finetune"``).
        global_centers : numpy.ndarray of shape (K, d) or None, default None
            C̃ of the alignment loss (``variant="fstc"`` only).
        texts : sequence of str or None, default None
            The documents behind ``X``'s rows, for the neighbours' LSA view (read on the call
            that mines them, the first); with a frozen encoder and no texts, the neighbours are
            found on Φ alone. A fine-tuned encoder's ``X`` are the texts.

        Returns
        -------
        self
        """
        with _thread_limit(self.encoder, self.device):
            return self._fit(X, global_centers, texts)

    def _mine_neighbors(self, X: Any, texts: Sequence[str] | None) -> None:
        if texts is None and self.encoder == "finetune":
            texts = X
        H = self.transform(X)
        view = neighbor_view(H, texts, self.neighbor_lsa_dims, self.neighbor_lsa_weight,
                             self.random_state)
        self.neighbors_ = nearest_neighbors(view, self.neighbors)
        self.neighbor_view_ = "embedding+lsa" if view.shape[1] > H.shape[1] else "embedding"

    def _fit(self, X: Any, global_centers: np.ndarray | None,
             texts: Sequence[str] | None = None) -> FSTCClusterer:
        n = len(X)
        if texts is not None and len(texts) != n:
            raise ValueError(f"texts: expected {n} (one per row of X), got {len(texts)}")
        if self.head_ is None:
            self._init_kmeans(X)
        if self._optimizer is None:
            self._optimizer = self._make_optimizer()
        align = self.variant == "fstc" and global_centers is not None and self.align_weight > 0
        target = (torch.tensor(np.asarray(global_centers, dtype=np.float32),
                               device=self.device) if align else None)  # a copy: read-only in
        use_neighbors = self.neighbors > 0 and self.neighbor_weight > 0 and n > 1
        if use_neighbors and getattr(self, "neighbors_", np.empty((0, 0))).shape[0] != n:
            # Mined once, on the representations as they start (SCAN's choice): with a frozen
            # encoder they never change, and a fine-tuned one should not chase its own drift.
            self._mine_neighbors(X, texts)
        if getattr(self, "pseudo_labels_", None) is None or len(self.pseudo_labels_) != n:
            self._refresh(X)
        sums = np.zeros(5)
        for _ in range(self.iterations):
            if self.n_iter_ in self._schedule and self.n_iter_ > 0:
                self._refresh(X)
            rows = self._rng.choice(n, size=min(self.batch_size, n), replace=False)
            idx = torch.as_tensor(rows, device=self.device)
            h = self._embed(X, rows, grad=True)
            P = torch.softmax(self.head_(h), dim=1)
            w = self._w[idx]
            sq = ((self._q[idx] - P) ** 2).sum(dim=1)
            loss_c = (w * sq).sum() / w.sum() if w.sum() > 0 else sq.sum() * 0.0
            loss_a = torch.zeros((), device=self.device)
            if align:
                soft = P / P.sum(dim=0, keepdim=True).clamp_min(1e-8)
                loss_a = ((soft.T @ h - target) ** 2).sum()
            loss_n = torch.zeros((), device=self.device)
            if use_neighbors:
                pick = self.neighbors_[rows, self._rng.integers(self.neighbors_.shape[1],
                                                                size=len(rows))]
                P_n = torch.softmax(self.head_(self._embed(X, pick, grad=True)), dim=1)
                loss_n = -torch.log((P * P_n).sum(dim=1).clamp_min(1e-8)).mean()
            loss_b = torch.zeros((), device=self.device)
            if self.balance_weight > 0:
                mean_p = P.mean(dim=0)  # KL(mean P ‖ b), b the transport's marginal
                loss_b = (mean_p * (torch.log(mean_p.clamp_min(1e-8))
                                    - self._log_marginal)).sum()
            loss = (loss_c + self.align_weight * loss_a + self.neighbor_weight * loss_n
                    + self.balance_weight * loss_b)
            self._optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self._optimizer.step()
            sums += [loss.item(), loss_c.item(), loss_a.item(), loss_n.item(), loss_b.item()]
            self.n_iter_ += 1
        sums /= max(self.iterations, 1)
        self.last_loss_ = float(sums[0])
        self.cluster_centers_, self.counts_ = self.local_centers(X)
        self.history_.append({"loss": float(sums[0]), "loss_c": float(sums[1]),
                              "loss_align": float(sums[2]),
                              "loss_neighbor": float(sums[3]),
                              "loss_balance": float(sums[4]),
                              "kept": float(np.mean(self.weights_ > 0)),
                              "pi": float(self._pi)})
        return self

    # -- outputs ---------------------------------------------------------------------------
    def local_centers(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """The hard local centres: mean Φ(x) of the rows whose pseudo-label (fresh OT labels of
        the current model) is k, and their counts (also sets ``predicted_counts_``)."""
        H = self._embed(X)
        with torch.no_grad():
            log_p = torch.log_softmax(self.head_(H), dim=1).double().cpu().numpy()
        self.predicted_counts_ = np.bincount(log_p.argmax(axis=1), minlength=self.n_clusters)
        labels = pseudo_labels(log_p, self.epsilon, self._tau).argmax(axis=1)
        return hard_centers(H.detach().cpu().numpy(), labels, self.n_clusters)

    def predict_proba(self, X: Any) -> np.ndarray:
        """P = softmax(F(Φ(x)))."""
        if self.head_ is None:
            raise RuntimeError("fit() or init_from_centers() first")
        with torch.no_grad():
            return torch.softmax(self.head_(self._embed(X)), dim=1).cpu().numpy()

    def predict(self, X: Any) -> np.ndarray:
        """The cluster of every row: argmax of P."""
        return self.predict_proba(X).argmax(axis=1)

    def score(self, X: Any, y: np.ndarray | None) -> dict[str, float]:
        """:func:`score_clustering` of :meth:`predict` against labels ``y`` (scoring only)."""
        return score_clustering(y, self.predict(X))

    # -- what a worker keeps between rounds -------------------------------------------------
    def local_state(self) -> dict[str, Any]:
        """Everything :meth:`fit` carries from one call to the next, as a state tree
        (:mod:`common.state`): F (and a fine-tuned Φ: its whole encoder, so a fine-tuning
        worker's snapshots are large), the optimizer, the batch generator, the iteration count,
        the pseudo-labels and mixture weights of the last refresh, and the mined neighbours."""
        fine = self.encoder == "finetune" and self.encoder_ is not None
        return {"head": None if self.head_ is None else self.head_.state_dict(),
                "encoder": self.encoder_.state_dict() if fine else None,
                "optimizer": None if self._optimizer is None else self._optimizer.state_dict(),
                "rng": generator_state(self._rng), "n_iter": self.n_iter_,
                "history": self.history_, "last_loss": self.last_loss_,
                "pseudo_labels": getattr(self, "pseudo_labels_", None),
                "weights": getattr(self, "weights_", None), "pi": getattr(self, "_pi", None),
                "marginal": getattr(self, "marginal_", None),
                "neighbors": getattr(self, "neighbors_", None),
                "neighbor_view": getattr(self, "neighbor_view_", None)}

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`local_state` returned."""
        self.head_, self._optimizer = None, None
        if state["head"] is not None:
            w = state["head"]["weight"]
            self.head_ = nn.Linear(w.shape[1], w.shape[0]).to(self.device)
            self.head_.load_state_dict(state["head"])
        if state["encoder"] is not None:
            self._load_encoder().load_state_dict(state["encoder"])
        if state["optimizer"] is not None:
            self._optimizer = self._make_optimizer()
            self._optimizer.load_state_dict(state["optimizer"])
        set_generator_state(self._rng, state["rng"])
        self.n_iter_, self.last_loss_ = int(state["n_iter"]), float(state["last_loss"])
        self.history_ = [dict(h) for h in state["history"]]
        for name in ("pseudo_labels_", "weights_", "_pi", "neighbors_", "neighbor_view_",
                     "marginal_"):
            if hasattr(self, name):
                delattr(self, name)
        if state["neighbors"] is not None:
            self.neighbors_, self.neighbor_view_ = state["neighbors"], state["neighbor_view"]
        if state["pseudo_labels"] is not None:
            Q, w = state["pseudo_labels"], state["weights"]
            self.pseudo_labels_, self.weights_, self._pi = Q, w, float(state["pi"])
            b = state.get("marginal")  # absent from snapshots of the equal-only versions
            self._set_marginal(np.full(Q.shape[1], 1.0 / Q.shape[1]) if b is None else b)
            self._q = torch.as_tensor(Q, dtype=torch.float32, device=self.device)
            self._w = torch.as_tensor(w, dtype=torch.float32, device=self.device)

    # -- parameters as named arrays (what travels at the end of a federated run) -------------
    def get_arrays(self) -> dict[str, np.ndarray]:
        """F as ``head.weight`` / ``head.bias`` (and Φ as ``encoder.*`` when fine-tuned)."""
        out = {f"head.{k}": v.detach().cpu().numpy().copy()
               for k, v in self.head_.state_dict().items()}
        if self.encoder == "finetune":
            out.update({f"encoder.{k}": v.detach().cpu().numpy().copy()
                        for k, v in self._load_encoder().state_dict().items()
                        if v.dtype.is_floating_point})
        return out

    def set_arrays(self, arrays: Mapping[str, np.ndarray]) -> FSTCClusterer:
        """Load F (and Φ) from named arrays, e.g. the averaged global model."""
        w = np.asarray(arrays["head.weight"])
        if self.head_ is None or tuple(self.head_.weight.shape) != w.shape:
            self.head_ = nn.Linear(w.shape[1], w.shape[0]).to(self.device)
        self.head_.load_state_dict({k[5:]: torch.as_tensor(np.array(v, copy=True))
                                    for k, v in arrays.items() if k.startswith("head.")})
        enc = {k[8:]: torch.as_tensor(np.array(v, copy=True))
               for k, v in arrays.items() if k.startswith("encoder.")}
        if enc:
            self._load_encoder().load_state_dict(enc, strict=False)
        self._optimizer = None
        return self


def score_clustering(y_true: np.ndarray | None, y_pred: np.ndarray) -> dict[str, float]:
    """ACC (Hungarian), NMI, and macro-F1 after the same mapping, as ``accuracy``, ``nmi`` and
    ``macro_f1`` (the names fedctl's reports and round logs read). Without labels
    (``y_true`` None): :func:`~common.eval.clustering.cluster_sizes` instead."""
    if y_true is None:
        return cluster_sizes(y_pred)
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    scores = clustering_metrics(y_true, y_pred)
    mapping = cluster_mapping(y_true, y_pred) if len(y_true) else {}
    mapped = np.array([mapping.get(int(c), -1) for c in y_pred], dtype=np.int64)
    f1 = classification_metrics(y_true, mapped)["macro_f1"]
    return {"accuracy": scores["acc"], "nmi": scores["nmi"], "macro_f1": f1}


# --------------------------------------------------------------------------------------------
# The federated algorithm in one process (benchmarks; the cluster runs the same steps)
# --------------------------------------------------------------------------------------------


class FederatedFSTC:
    """FSTC over a list of clients, simulated in one process with the cluster's exact steps.

    Initialization (k-FED or pooled k-means) → ``rounds`` × (each client: ``iterations`` local
    iterations against the global centres, then its hard centres and counts; the server: eq. 16)
    → the sample-weighted average of the client heads.

    Parameters
    ----------
    params : FSTCParams
    n_clusters : int
    rounds : int, default 40
    random_state : int, default 0
        Client ``m`` uses ``random_state + 1000 + m``.
    device : str, default "cpu"
    verbose : int, default 0
        1: a line per round on stdout (its seconds, the run's so far): a fine-tuned encoder's
        run at the paper's budget takes minutes even on a GPU.

    Attributes
    ----------
    init_centers_ : numpy.ndarray of shape (K, d)
    global_centers_ : numpy.ndarray of shape (K, d)
    clients_ : list of FSTCClusterer
    model_ : FSTCClusterer
        The global model (averaged heads).
    """

    def __init__(self, params: FSTCParams, n_clusters: int, rounds: int = 40,
                 random_state: int = 0, device: str = "cpu", verbose: int = 0) -> None:
        self.params = params
        self.n_clusters = n_clusters
        self.rounds = rounds
        self.random_state = random_state
        self.device = device
        self.verbose = verbose

    def initial_centers(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """k-FED on the clients' representations, or k-means on them pooled."""
        k, seed = self.n_clusters, self.random_state
        if self.params.init == "pooled":
            pooled = np.concatenate([np.asarray(X) for X in parts])
            return KMeans(k, n_init=10, random_state=seed).fit(pooled).cluster_centers_
        local = [local_kmeans(X, k, random_state=seed + 1000 + m) for m, X in enumerate(parts)]
        return combine_centers([c for c, _ in local], [n for _, n in local], k,
                               random_state=seed)

    def fit(self, parts: Sequence[Any], init_centers: np.ndarray | None = None,
            texts: Sequence[Sequence[str]] | None = None) -> FederatedFSTC:
        """Train on one feature matrix (or text list, when fine-tuned) per client.

        ``init_centers`` (K × d) skips the initialization, e.g. to share one k-FED run among
        the variants of a benchmark. ``texts``, one list per client, are the documents behind
        the features, for the neighbours' LSA view (:meth:`FSTCClusterer.fit`).
        """
        if texts is not None and len(texts) != len(parts):
            raise ValueError(f"texts: expected one list per client ({len(parts)}), "
                             f"got {len(texts)}")
        with _thread_limit(self.params.encoder, self.device):
            return self._fit(parts, init_centers, texts)

    def _fit(self, parts: Sequence[Any], init_centers: np.ndarray | None,
             texts: Sequence[Sequence[str]] | None = None) -> FederatedFSTC:
        p, k = self.params, self.n_clusters
        clients = [p.clusterer(k, self.rounds * p.iterations, self.random_state + 1000 + m,
                               self.device) for m in range(len(parts))]
        if init_centers is None:
            reps = (list(parts) if p.encoder == "frozen"
                    else [c.transform(X) for c, X in zip(clients, parts, strict=True)])
            init_centers = self.initial_centers(reps)
        self.init_centers_ = np.asarray(init_centers, dtype=np.float32)
        for c in clients:
            c.init_from_centers(self.init_centers_)
        centers = self.init_centers_
        started = time.perf_counter()
        for r in range(self.rounds):
            t = time.perf_counter()
            for m, (c, X) in enumerate(zip(clients, parts, strict=True)):
                c.fit(X, centers, texts=None if texts is None else texts[m])
            centers = aggregate_centers([c.cluster_centers_ for c in clients],
                                        [c.counts_ for c in clients], centers)
            if self.verbose:
                now = time.perf_counter()
                print(f"FederatedFSTC round {r + 1}/{self.rounds}: {now - t:.1f}s "
                      f"({now - started:.0f}s so far)", flush=True)
        self.global_centers_ = centers
        self.clients_ = clients
        sizes = np.array([len(X) for X in parts], dtype=np.float64)
        heads = [c.get_arrays() for c in clients]
        avg = {name: sum(w * h[name] for w, h in zip(sizes / sizes.sum(), heads, strict=True))
               for name in heads[0]}
        self.model_ = p.clusterer(k, device=self.device).set_arrays(
            {name: a.astype(np.float32) for name, a in avg.items()})
        return self

    def predict(self, X: Any) -> np.ndarray:
        """Clusters of ``X`` under the global (averaged) model."""
        return self.model_.predict(X)




def size_signals(counts: np.ndarray, marginal: np.ndarray | None = None) -> dict[str, float]:
    """What a worker can see of its clusters without labels: the entropy of their sizes over
    its largest possible value (1: equal sizes), and the total variation between the sizes and
    the transport's marginal ``marginal`` (None: the equal one), 0 where the head predicts the
    sizes the transport asks for."""
    p = np.asarray(counts, dtype=np.float64)
    p = p / max(p.sum(), 1e-12)
    k = len(p)
    b = np.full(k, 1.0 / k) if marginal is None else np.asarray(marginal, dtype=np.float64)
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum() / np.log(k)) if k > 1 else 1.0
    return {"size_entropy": entropy, "marginal_gap": float(0.5 * np.abs(p - b).sum())}

#: Arrays a worker uploads every round; the model's own (``head.*``, ``encoder.*``) come last.
