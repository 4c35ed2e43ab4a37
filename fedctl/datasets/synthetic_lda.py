"""Synthetic federated LDA corpora and their scores (gFedNTM, Calvo-Bartolome & Arenas-Garcia,
section 4.1).

L nodes share a vocabulary of V words and K topics: K' topics are common to all nodes and each
node owns (K - K') / L private ones. Topics are drawn beta_k ~ Dir(eta); a document of node l
draws theta ~ Dir(alpha) over that node's K' + (K - K')/L topics (zero on the others), its
length uniformly in [min_len, max_len], and each word from theta @ beta. The true beta and
theta are kept.

Scores of a fitted model against the truth:

* DSS, document similarity score (lower is better): the documents' pairwise similarities
  under the true theta and under the inferred one, compared entry by entry:
  ``DSS = sum_{d, d'} |S_true(d, d') - S_model(d, d')| / D`` with the Hellinger similarity
  ``S(d, d') = sum_k sqrt(theta_dk theta_d'k)`` (the Bhattacharyya coefficient,
  1 - Hellinger distance squared), summed over all ordered pairs and divided by the number of
  documents D.
* TSS, topic similarity score (closer to K is better): for each true topic, the Hellinger
  similarity of the best-matching inferred topic, summed over the K true topics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["SyntheticLDA", "make_federated_lda", "hellinger_similarity",
           "document_similarity_score", "topic_similarity_score"]


@dataclass
class SyntheticLDA:
    """A generated federated corpus.

    Attributes
    ----------
    X : list of scipy.sparse.csr_matrix
        Each node's document-word counts, shape (n_docs, V).
    theta : list of numpy.ndarray
        Each node's true document-topic proportions, shape (n_docs, K).
    beta : numpy.ndarray of shape (K, V)
        True topic-word distributions.
    node_topics : list of numpy.ndarray
        The topic indices each node uses (shared first, then its private ones).
    n_shared : int
        K'.
    """

    X: list[sp.csr_matrix]
    theta: list[np.ndarray]
    beta: np.ndarray
    node_topics: list[np.ndarray]
    n_shared: int

    @property
    def vocabulary(self) -> list[str]:
        return [f"w{j}" for j in range(self.beta.shape[1])]


def make_federated_lda(n_nodes: int = 5, vocab_size: int = 5000, n_topics: int = 50,
                       n_shared: int = 10, docs_per_node: int = 1000, eta: float = 0.01,
                       alpha: float | None = None, min_len: int = 150, max_len: int = 250,
                       random_state: int = 0) -> SyntheticLDA:
    """Generate the corpus of gFedNTM section 4.1.

    Parameters
    ----------
    n_nodes : int, default 5
        L.
    vocab_size : int, default 5000
        V.
    n_topics : int, default 50
        K.
    n_shared : int, default 10
        K', topics every node uses; ``n_topics - n_shared`` must divide by ``n_nodes``.
    docs_per_node : int, default 1000
    eta : float, default 0.01
        Dirichlet concentration of the topics.
    alpha : float or None, default None
        Dirichlet concentration of the documents' topic proportions (None: 50 / K).
    min_len, max_len : int, default 150, 250
        Document lengths, uniform in [min_len, max_len].
    random_state : int, default 0
    """
    if not 0 <= n_shared <= n_topics or (n_topics - n_shared) % n_nodes:
        raise ValueError(f"n_topics - n_shared ({n_topics - n_shared}) must be >= 0 and "
                         f"divisible by n_nodes ({n_nodes})")
    if not 1 <= min_len <= max_len:
        raise ValueError("need 1 <= min_len <= max_len")
    rng = np.random.default_rng(random_state)
    alpha = 50.0 / n_topics if alpha is None else alpha
    beta = rng.dirichlet(np.full(vocab_size, eta), size=n_topics)
    per_node = (n_topics - n_shared) // n_nodes
    Xs, thetas, topics = [], [], []
    for node in range(n_nodes):
        own = np.arange(n_shared + node * per_node, n_shared + (node + 1) * per_node)
        idx = np.concatenate([np.arange(n_shared), own])
        theta = np.zeros((docs_per_node, n_topics))
        theta[:, idx] = rng.dirichlet(np.full(len(idx), alpha), size=docs_per_node)
        lengths = rng.integers(min_len, max_len + 1, size=docs_per_node)
        probs = theta @ beta
        probs /= probs.sum(1, keepdims=True)
        counts = np.stack([rng.multinomial(n, p) for n, p in zip(lengths, probs, strict=True)])
        Xs.append(sp.csr_matrix(counts.astype(np.float32)))
        thetas.append(theta)
        topics.append(idx)
    return SyntheticLDA(Xs, thetas, beta, topics, n_shared)


def hellinger_similarity(P: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """Pairwise sum_k sqrt(p_k q_k) of the rows of P and Q (each row a distribution)."""
    P = np.clip(np.asarray(P, np.float64), 0, None)
    Q = np.clip(np.asarray(Q, np.float64), 0, None)
    P = P / P.sum(1, keepdims=True)
    Q = Q / Q.sum(1, keepdims=True)
    return np.sqrt(P) @ np.sqrt(Q).T


def document_similarity_score(theta_true: np.ndarray, theta_model: np.ndarray) -> float:
    """DSS (lower is better; 0 for identical similarity structure), see the module docstring.

    The two may have different numbers of topics: only document-document similarities are
    compared.
    """
    if len(theta_true) != len(theta_model):
        raise ValueError("theta_true and theta_model hold different numbers of documents")
    s_true = hellinger_similarity(theta_true, theta_true)
    s_model = hellinger_similarity(theta_model, theta_model)
    return float(np.abs(s_true - s_model).sum() / len(theta_true))


def topic_similarity_score(beta_true: np.ndarray, beta_model: np.ndarray) -> float:
    """TSS (K = n true topics is perfect): sum over the true topics of the Hellinger
    similarity of the best-matching model topic."""
    return float(hellinger_similarity(beta_true, beta_model).max(1).sum())
