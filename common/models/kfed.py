"""k-FED: one-shot federated k-means (Dennis, Li and Smith, ICML 2021), and the features of the
FBOW / FTF-IDF / FSBERT baselines of FSTC (Hu et al. 2023).

Each client runs k-means on its own rows and shares only its centres and their sizes; the server
clusters the pooled local centres (weighted by their sizes) into the global centres; each client
then labels its rows by the nearest global centre. One round, no raw data and no representation
of a single document leaves a client.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.cluster import KMeans
from sklearn.feature_extraction.text import CountVectorizer, TfidfTransformer
from sklearn.metrics import pairwise_distances_argmin

__all__ = ["local_kmeans", "combine_centers", "KFed", "FederatedVocabulary"]

Matrix = np.ndarray | sp.spmatrix


def local_kmeans(X: Matrix, n_clusters: int, n_init: int = 10, random_state: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A client's k-means: its centres and how many of its rows each one holds.

    Parameters
    ----------
    X : array or sparse matrix of shape (n, d)
    n_clusters : int
        Clipped to the number of distinct rows (a tiny client cannot have more).
    n_init : int, default 10
    random_state : int, default 0

    Returns
    -------
    centers : numpy.ndarray of shape (k, d), float64
    counts : numpy.ndarray of shape (k,), int64
    """
    k = min(n_clusters, X.shape[0])
    km = KMeans(k, n_init=n_init, random_state=random_state).fit(X)
    return np.asarray(km.cluster_centers_), np.bincount(km.labels_, minlength=k).astype(np.int64)


def combine_centers(centers: Sequence[np.ndarray], counts: Sequence[np.ndarray], n_clusters: int,
                    n_init: int = 10, random_state: int = 0) -> np.ndarray:
    """The server's step of k-FED: k-means on the pooled local centres, each weighted by its size.

    Parameters
    ----------
    centers : sequence of arrays of shape (k_m, d)
        Every client's local centres.
    counts : sequence of arrays of shape (k_m,)
        Rows behind each local centre (the k-means ``sample_weight``).
    n_clusters : int
    n_init : int, default 10
    random_state : int, default 0

    Returns
    -------
    numpy.ndarray of shape (n_clusters, d)
    """
    pooled = np.concatenate([np.asarray(c, dtype=np.float64) for c in centers])
    weight = np.concatenate([np.asarray(n, dtype=np.float64) for n in counts])
    keep = weight > 0  # a local centre that holds no row says nothing
    pooled, weight = pooled[keep], weight[keep]
    if len(pooled) < n_clusters:
        raise ValueError(f"{len(pooled)} non-empty local centres cannot make {n_clusters} "
                         "global clusters")
    km = KMeans(n_clusters, n_init=n_init, random_state=random_state)
    return np.asarray(km.fit(pooled, sample_weight=weight).cluster_centers_)


class KFed:
    """One-shot federated k-means over a list of clients' feature matrices.

    Parameters
    ----------
    n_clusters : int, default 8
    local_clusters : int or None, default None
        k' of each client's k-means; None means ``n_clusters``.
    n_init : int, default 10
        k-means restarts, on the clients and on the server.
    random_state : int, default 0
        Client ``m`` uses ``random_state + m``; the server ``random_state``.

    Attributes
    ----------
    cluster_centers_ : numpy.ndarray of shape (n_clusters, d)
    local_centers_ : list of numpy.ndarray
        Each client's upload: its centres...
    local_counts_ : list of numpy.ndarray
        ...and their sizes.
    """

    def __init__(self, n_clusters: int = 8, local_clusters: int | None = None, n_init: int = 10,
                 random_state: int = 0) -> None:
        self.n_clusters = n_clusters
        self.local_clusters = local_clusters
        self.n_init = n_init
        self.random_state = random_state

    def fit(self, parts: Sequence[Matrix]) -> KFed:
        """Run k-FED with one feature matrix per client."""
        k = self.local_clusters or self.n_clusters
        local = [local_kmeans(X, k, self.n_init, self.random_state + m)
                 for m, X in enumerate(parts)]
        self.local_centers_ = [c for c, _ in local]
        self.local_counts_ = [n for _, n in local]
        self.cluster_centers_ = combine_centers(self.local_centers_, self.local_counts_,
                                                self.n_clusters, self.n_init, self.random_state)
        return self

    def predict(self, X: Matrix) -> np.ndarray:
        """The nearest global centre of every row (what each client computes locally)."""
        return pairwise_distances_argmin(X, self.cluster_centers_)


class FederatedVocabulary:
    """Bag-of-words or TF-IDF features whose vocabulary and IDF come from the clients' counts.

    Each client counts its words; the server keeps the ``max_features`` words with the highest
    summed document frequency (among those in at least ``min_df`` documents) and sends back the
    vocabulary, and for TF-IDF the IDF from the summed document frequencies. Only word counts
    travel, as with the topic-model families.

    Parameters
    ----------
    kind : {"bow", "tfidf"}, default "tfidf"
    max_features : int or None, default None
        Keep at most this many words (None: all).
    min_df : int, default 2
        Drop words seen in fewer documents across all clients.
    stop_words : str or None, default "english"
        scikit-learn's stop-word list, or None.

    Attributes
    ----------
    vocabulary_ : dict of str to int
    idf_ : numpy.ndarray
        ``ln((1 + n) / (1 + df)) + 1`` (scikit-learn's smoothed IDF) over all clients' documents.
    """

    def __init__(self, kind: str = "tfidf", max_features: int | None = None, min_df: int = 2,
                 stop_words: str | None = "english") -> None:
        if kind not in ("bow", "tfidf"):
            raise ValueError(f"kind: expected 'bow' or 'tfidf', got {kind!r}")
        self.kind = kind
        self.max_features = max_features
        self.min_df = min_df
        self.stop_words = stop_words

    # hand-written: TfidfVectorizer fits one corpus; this IDF sums clients' document counts
    def fit(self, client_texts: Sequence[Sequence[str]]) -> FederatedVocabulary:
        """Agree on the vocabulary (and IDF) from every client's document frequencies."""
        df: dict[str, int] = {}
        n_docs = 0
        for texts in client_texts:  # on each client: its document frequencies only
            cv = CountVectorizer(stop_words=self.stop_words, binary=True).fit(texts)
            counts = np.asarray(cv.transform(texts).sum(axis=0)).ravel()
            for word, j in cv.vocabulary_.items():
                df[word] = df.get(word, 0) + int(counts[j])
            n_docs += len(texts)
        words = sorted((w for w, c in df.items() if c >= self.min_df),
                       key=lambda w: (-df[w], w))[:self.max_features]
        words.sort()
        self.vocabulary_ = {w: j for j, w in enumerate(words)}
        freq = np.array([df[w] for w in words], dtype=np.float64)
        self.idf_ = np.log((1 + n_docs) / (1 + freq)) + 1
        return self

    def transform(self, texts: Sequence[str]) -> sp.csr_matrix:
        """A client's rows: word counts, or L2-normalized TF-IDF with the agreed IDF."""
        counts = CountVectorizer(vocabulary=self.vocabulary_,
                                 stop_words=self.stop_words).transform(texts)
        if self.kind == "bow":
            return counts.astype(np.float64)
        tfidf = TfidfTransformer()
        tfidf.idf_ = self.idf_
        return tfidf.transform(counts)
