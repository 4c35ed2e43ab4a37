"""The FedNMF paper's partition: K equal-sized clients, label proportions from Dir(alpha * p)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.data.partitions import dirichlet_equal

ROOT = Path(__file__).resolve().parents[1]
STACKOVERFLOW = ROOT / "data" / "stackoverflow" / "stackoverflow_1500.jsonl"


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    with STACKOVERFLOW.open(encoding="utf-8") as fh:
        return np.array([json.loads(line)["label_name"] for line in fh])


def _top_share(y: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean over parts of the share of the part's most common label."""
    return float(np.mean([np.unique(y[p], return_counts=True)[1].max() / len(p)
                          for p in parts]))


@pytest.mark.parametrize("k", [1, 10, 30, 50])
def test_parts_are_equal_disjoint_and_use_the_data(labels: np.ndarray, k: int) -> None:
    parts = dirichlet_equal(labels, k, alpha=1.0, seed=0)
    size = len(labels) // k
    assert len(parts) == k and all(len(p) == size for p in parts)
    rows = np.concatenate(parts)
    assert len(np.unique(rows)) == len(rows) == k * size
    assert rows.min() >= 0 and rows.max() < len(labels)
    assert all(p.dtype == np.int64 and (np.diff(p) > 0).all() for p in parts)


def test_small_alpha_skews_and_large_alpha_mixes(labels: np.ndarray) -> None:
    # 20 tags of 75 titles; half the data per part leaves room for the drawn proportions.
    skewed = dirichlet_equal(labels, 10, alpha=0.1, seed=0, size=75)
    mixed = dirichlet_equal(labels, 10, alpha=100.0, seed=0, size=75)
    assert _top_share(labels, skewed) > 0.4
    assert _top_share(labels, mixed) < 0.2
    assert np.mean([len(np.unique(labels[p])) for p in mixed]) > 15


def test_seeded(labels: np.ndarray) -> None:
    a = dirichlet_equal(labels, 10, alpha=0.5, seed=3)
    b = dirichlet_equal(labels, 10, alpha=0.5, seed=3)
    c = dirichlet_equal(labels, 10, alpha=0.5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_bad_arguments(labels: np.ndarray) -> None:
    with pytest.raises(ValueError, match="n_parts"):
        dirichlet_equal(labels, 0)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_equal(labels, 2, alpha=0.0)
    with pytest.raises(ValueError, match="size"):
        dirichlet_equal(labels, 2, size=751)
