"""Scores of a clustering against reference labels: ACC under the best one-to-one mapping, NMI.

Labels only score a clustering; no clustering model in fedctl trains on them.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import confusion_matrix, normalized_mutual_info_score

__all__ = ["cluster_mapping", "clustering_accuracy", "clustering_metrics", "cluster_sizes"]


# hand-written: no library returns the map; sklearn's confusion_matrix under scipy's Hungarian
def cluster_mapping(y_true: np.ndarray, y_pred: np.ndarray) -> dict[int, int]:
    """The one-to-one map from cluster ids to label ids that agrees on the most rows.

    The Hungarian method (``scipy.optimize.linear_sum_assignment``) on the contingency table.
    With more clusters than labels (or the reverse) the surplus ids stay unmapped.

    Parameters
    ----------
    y_true, y_pred : numpy.ndarray
        Integer labels and cluster ids, one per row.

    Returns
    -------
    dict of int to int
        Cluster id -> label id.
    """
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"y_true has shape {y_true.shape} but y_pred {y_pred.shape}")
    labels, clusters = np.unique(y_true), np.unique(y_pred)
    # Rows: clusters, columns: labels (one shared label space for confusion_matrix).
    space = np.union1d(labels, clusters)
    table = confusion_matrix(y_pred, y_true, labels=space)
    rows, cols = linear_sum_assignment(table, maximize=True)
    return {int(space[r]): int(space[c]) for r, c in zip(rows, cols, strict=True)
            if table[r, c] > 0}


# hand-written: no library scores ACC under the best one-to-one map; one np.mean over it
def clustering_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """ACC: the share of rows whose cluster maps to their label under :func:`cluster_mapping`.

    Invariant to renaming the clusters: a permuted labelling scores 1.0. ``nan`` for no rows.
    """
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if len(y_true) == 0:
        return float("nan")
    mapping = cluster_mapping(y_true, y_pred)
    mapped = np.array([mapping.get(int(c), -1) for c in y_pred])
    return float(np.mean(mapped == y_true))


def clustering_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """``acc`` (:func:`clustering_accuracy`) and ``nmi`` (scikit-learn's
    ``normalized_mutual_info_score``, arithmetic normalization), both in [0, 1]."""
    if len(y_true) == 0:
        return {"acc": float("nan"), "nmi": float("nan")}
    return {"acc": clustering_accuracy(y_true, y_pred),
            "nmi": float(normalized_mutual_info_score(y_true, y_pred))}


def cluster_sizes(y_pred: np.ndarray) -> dict[str, float]:
    """What can be said of a clustering without labels: how many clusters it uses
    (``clusters_used``) and the share of the documents in its largest (``largest_cluster``)."""
    y_pred = np.asarray(y_pred)
    if len(y_pred) == 0:
        return {}
    counts = np.bincount(y_pred - y_pred.min()) if y_pred.min() < 0 else np.bincount(y_pred)
    return {"clusters_used": float(np.count_nonzero(counts)),
            "largest_cluster": float(counts.max() / len(y_pred))}
