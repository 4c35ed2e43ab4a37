"""Short-text clustering sets with unequal and many clusters, built from the shipped data.

FSTC's settings were chosen on StackOverflow and AG News, whose classes are equal in size.
Issue 29's honest protocol needs sets they were not chosen on, and sets whose clusters look
like a user's documents: few large clusters and a long tail of small ones. Every set here is a
deterministic subsample (``SET_SEED``) of a dataset in ``../shared/data``:

* ``<name>_pl``: the classes of ``<name>`` (StackOverflow, AG News, DBpedia) cut to power-law
  sizes n_r ∝ r^−a for the classes in a seeded random order r = 1…K, with a chosen so that the
  largest over the smallest is ``ratio`` (20 by default); the largest is as large as every class
  allows.
* ``tagmynews``: TagMyNews as it comes (7 classes, 752 to 3,204 items: a ratio of 4.3).
* ``pooled45``: StackOverflow's 20 tags, AG News's 4 topics, DBpedia's 14 classes and
  TagMyNews's 7 categories as 45 clusters (labels prefixed by their source, so AG News's
  "World" and TagMyNews's "world" stay apart), at power-law sizes of ratio 20.

:func:`load_set` returns the texts, their cached all-MiniLM-L6-v2 embeddings (embedded once per
source dataset, then indexed) and integer labels; ``python benchmarks/fstc_sets.py`` prints the
sets' sizes.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.data.embedding import embed_texts  # noqa: E402
from common.data.reading import read_jsonl  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
#: The subsamples are fixed: the runs' seeds vary the client split and the training, not the set.
SET_SEED = 0
#: Largest class over smallest in the power-law sets (issue 29: at least 20).
RATIO = 20.0
SOURCES = {"stackoverflow": "stackoverflow", "agnews": "agnews_8000",
           "dbpedia": "dbpedia_10k", "tagmynews": "tagmynews_subset"}
POOLED = ("stackoverflow", "agnews", "dbpedia", "tagmynews")
SETS = ("stackoverflow_pl", "agnews_pl", "dbpedia_pl", "tagmynews", "pooled45")
#: Table 2's sets as they come (equal classes), for the same rows beside the unequal ones.
EQUAL_SETS = ("stackoverflow_eq", "agnews_eq")
TITLES = {"stackoverflow_eq": "StackOverflow (Table 2)", "agnews_eq": "AG News (Table 2)",
          "stackoverflow_pl": "StackOverflow, power law", "agnews_pl": "AG News, power law",
          "dbpedia_pl": "DBpedia, power law", "tagmynews": "TagMyNews",
          "pooled45": "45 pooled clusters"}


@lru_cache(maxsize=4)
def source(name: str) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """Texts, embeddings and string labels of a shipped dataset (embeddings cached on disk)."""
    file = SOURCES[name]
    ds = read_jsonl(DATA / file / f"{file}.jsonl")
    # The reference backend, which the committed tables were scored on: OpenVINO's embeddings
    # (cosine 0.99999 to torch's) still move a single FSTC seed by up to 9 ACC points.
    X = embed_texts(ds.texts, device="cpu", progress=False, backend="torch")
    return tuple(ds.texts), X, np.asarray([str(y) for y in ds.labels])


def power_law_rows(labels: np.ndarray, ratio: float = RATIO, seed: int = SET_SEED
                   ) -> np.ndarray:
    """Rows of a subsample whose classes have power-law sizes, largest / smallest = ``ratio``.

    The classes take ranks r = 1…K in a seeded random order and sizes n_max · r^−a with
    a = log(ratio) / log(K); n_max is the largest every class can supply. Rows within a class
    are a seeded random draw. Sorted row indices.
    """
    classes, counts = np.unique(labels, return_counts=True)
    k = len(classes)
    rng = np.random.default_rng(seed)
    ranks = rng.permutation(k) + 1
    shape = ranks.astype(np.float64) ** -(np.log(ratio) / np.log(k))
    n_max = float(np.min(counts / shape))
    sizes = np.maximum(np.floor(n_max * shape + 1e-9).astype(np.int64), 1)
    rows = [rng.choice(np.flatnonzero(labels == c), size=s, replace=False)
            for c, s in zip(classes, sizes, strict=True)]
    return np.sort(np.concatenate(rows))


@lru_cache(maxsize=8)
def load_set(name: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Texts, embeddings (n, 384) and integer labels of one of :data:`SETS`."""
    if name == "pooled45":
        texts: list[str] = []
        parts, labels = [], []
        for src in POOLED:
            t, X, y = source(src)
            texts += t
            parts.append(X)
            labels += [f"{src}:{c}" for c in y]
        X, y = np.concatenate(parts), np.asarray(labels)
        rows = power_law_rows(y)
    elif name == "tagmynews" or name in EQUAL_SETS:
        t, X, y = source(name.removesuffix("_eq"))
        texts, rows = list(t), np.arange(len(y))
    elif name.endswith("_pl") and name[:-3] in SOURCES:
        t, X, y = source(name[:-3])
        texts, rows = list(t), power_law_rows(y)
    else:
        raise KeyError(f"unknown set {name!r} (one of {', '.join(SETS + EQUAL_SETS)})")
    return ([texts[i] for i in rows], np.ascontiguousarray(X[rows]),
            np.unique(y[rows], return_inverse=True)[1])


def describe(name: str) -> dict[str, float]:
    """Rows, clusters and the largest over the smallest cluster of a set."""
    _, _, y = load_set(name)
    counts = np.bincount(y)
    return {"rows": len(y), "clusters": len(counts), "largest": int(counts.max()),
            "smallest": int(counts.min()), "ratio": float(counts.max() / counts.min())}


if __name__ == "__main__":
    for s in SETS:
        d = describe(s)
        print(f"{TITLES[s]:28s} {d['rows']:6d} rows, {d['clusters']:2d} clusters, "
              f"{d['largest']} … {d['smallest']} (ratio {d['ratio']:.1f})")
