"""ACC under the Hungarian mapping and NMI (common.eval.clustering)."""

from __future__ import annotations

import numpy as np
import pytest

from common.eval.clustering import cluster_mapping, clustering_accuracy, clustering_metrics


def test_permuted_labelling_scores_one() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 7, size=500)
    renamed = rng.permutation(7)[y] + 100  # other ids, same partition
    assert clustering_accuracy(y, renamed) == 1.0
    assert clustering_metrics(y, renamed) == pytest.approx({"acc": 1.0, "nmi": 1.0})
    assert cluster_mapping(y, renamed) == {int(renamed[i]): int(y[i])
                                           for i in np.unique(y, return_index=True)[1]}


def test_accuracy_uses_the_best_one_to_one_mapping() -> None:
    y = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    # Cluster 5 is mostly label 1, cluster 7 mostly label 0; cluster 9 holds label 2 and one
    # row of label 1. A greedy majority vote would also get 8/10 here; the test below differs.
    pred = np.array([7, 7, 5, 5, 5, 9, 9, 9, 9, 9])
    assert cluster_mapping(y, pred) == {7: 0, 5: 1, 9: 2}
    assert clustering_accuracy(y, pred) == pytest.approx(8 / 10)


def test_two_clusters_cannot_map_to_one_label() -> None:
    # Both clusters are mostly label 0; one-to-one, only one of them may take it.
    y = np.array([0, 0, 0, 0, 1, 1])
    pred = np.array([3, 3, 4, 4, 4, 4])
    assert clustering_accuracy(y, pred) == pytest.approx(4 / 6)  # 3->0 (2 rows), 4->1 (2 rows)


def test_more_clusters_than_labels_leaves_the_surplus_unmapped() -> None:
    y = np.array([0, 0, 1, 1])
    pred = np.array([0, 1, 2, 3])
    mapping = cluster_mapping(y, pred)
    assert len(mapping) == 2 and set(mapping.values()) == {0, 1}
    assert clustering_accuracy(y, pred) == pytest.approx(0.5)
    assert 0 < clustering_metrics(y, pred)["nmi"] < 1


def test_one_cluster_for_everything_has_no_information() -> None:
    y = np.array([0, 1, 2, 0, 1, 2])
    scores = clustering_metrics(y, np.zeros(6, dtype=int))
    assert scores["acc"] == pytest.approx(2 / 6)
    assert scores["nmi"] == pytest.approx(0.0)


def test_shapes_must_agree_and_empty_is_nan() -> None:
    with pytest.raises(ValueError, match="shape"):
        cluster_mapping(np.zeros(3, dtype=int), np.zeros(4, dtype=int))
    assert np.isnan(clustering_accuracy(np.array([], dtype=int), np.array([], dtype=int)))
