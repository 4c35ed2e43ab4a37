"""Tests of common/data.py and common/atomic.py on the bundled dataset and the real model.

Embedding costs ~17 ms per text on a CPU, so the whole file embeds well under 100 texts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.atomic import atomic_save_npy, atomic_write_bytes
from common.data.embedding import embed_texts, resolve_device
from common.data.partitions import holdout_split, partition
from common.data.reading import DataError, TextDataset, make_task, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
DBPEDIA = ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"


@pytest.fixture(scope="module")
def dbpedia() -> TextDataset:
    return read_jsonl(DBPEDIA)


@pytest.fixture(scope="module")
def y14(dbpedia: TextDataset) -> np.ndarray:
    return make_task(dbpedia.labels)[0]


# --------------------------------------------------------------------------------------------
# read_jsonl
# --------------------------------------------------------------------------------------------


def test_read_bundled_file(dbpedia: TextDataset) -> None:
    assert len(dbpedia.texts) == len(dbpedia.labels) == 10_000
    assert len(set(dbpedia.labels)) == 14
    assert all(isinstance(t, str) and t for t in dbpedia.texts)
    assert dbpedia.path == DBPEDIA


def test_read_limit_is_deterministic_subset(dbpedia: TextDataset) -> None:
    a = read_jsonl(DBPEDIA, limit=500, seed=3)
    b = read_jsonl(DBPEDIA, limit=500, seed=3)
    c = read_jsonl(DBPEDIA, limit=500, seed=4)
    assert len(a.texts) == len(a.labels) == 500
    assert a.texts == b.texts and a.labels == b.labels
    assert a.texts != c.texts
    # A subset, in file order.
    position = {t: i for i, t in enumerate(dbpedia.texts)}
    rows = [position[t] for t in a.texts]
    assert rows == sorted(rows)
    # A limit at or above the row count keeps everything.
    assert len(read_jsonl(DBPEDIA, limit=20_000).texts) == 10_000


def test_read_blank_lines_and_int_labels(tmp_path: Path) -> None:
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a", "label": 1}\n\n   \n{"text": "b", "label": "two"}\n')
    ds = read_jsonl(f)
    assert ds.texts == ["a", "b"]
    assert ds.labels == ["1", "two"]


def test_read_a_file_with_a_byte_order_mark_and_windows_line_ends(tmp_path: Path) -> None:
    """A file saved by a Windows editor starts with a UTF-8 byte-order mark: its line 1 was
    "not valid JSON" (predict read it; training did not)."""
    f = tmp_path / "x.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "a", "label": "x"}\r\n{"text": "b", "label": "y"}\r\n')
    ds = read_jsonl(f)
    assert ds.texts == ["a", "b"] and ds.labels == ["x", "y"]


def test_read_a_table_with_a_header(tmp_path: Path) -> None:
    """Documents often come as a spreadsheet's CSV (or a TSV): its "text" and "label"
    columns are read as JSONL's fields (quoted commas and line breaks included); a "label"
    column labels every row. Such a file was "line 1: not valid JSON"."""
    f = tmp_path / "docs.csv"
    f.write_bytes(b'\xef\xbb\xbfid,Text,label\n1,"a, b\nc",x\n\n2,plain,y\n')
    ds = read_jsonl(f)
    assert ds.texts == ["a, b\nc", "plain"] and ds.labels == ["x", "y"] and ds.labelled
    t = tmp_path / "docs.tsv"
    t.write_text('text\n"quoted" as is\nsecond\n')
    ds = read_jsonl(t)
    assert ds.texts == ['"quoted" as is', "second"] and not ds.labelled
    assert len(read_jsonl(f, limit=1)) == 1
    for text, message in (("text,label\na,x\nb,\n", "docs.csv:3: no label (the header has"),
                          ("body,label\na,x\n", 'docs.csv:1: expected a header naming a "text"'),
                          ('text\n"open\n', "docs.csv:2: not readable as a table"),
                          ("text,label\n", "docs.csv: empty file")):
        f.write_text(text)
        with pytest.raises(DataError, match=re.escape(message)):
            read_jsonl(f)


@pytest.mark.parametrize(
    ("line3", "expected"),
    [
        ("{not json", "x.jsonl:3: not valid JSON"),
        ('{"label": "a"}', "x.jsonl:3: missing field 'text'"),
        ('{"text": "a"}', "x.jsonl:3: missing field 'label'"),
        ('{"text": 5, "label": "a"}', "x.jsonl:3: field 'text' must be a string"),
        ('["a", "b"]', "x.jsonl:3: expected a JSON object"),
    ],
)
def test_read_bad_line_names_file_and_line(tmp_path: Path, line3: str, expected: str) -> None:
    f = tmp_path / "x.jsonl"
    good = json.dumps({"text": "fine", "label": "a"})
    f.write_text(f"{good}\n{good}\n{line3}\n{good}\n")
    with pytest.raises(DataError, match=expected) as info:
        read_jsonl(f)
    assert "\n" not in str(info.value)


def test_read_missing_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        read_jsonl(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl: empty file"):
        read_jsonl(empty)
    with pytest.raises(DataError, match="limit"):
        read_jsonl(DBPEDIA, limit=0)


# --------------------------------------------------------------------------------------------
# make_task
# --------------------------------------------------------------------------------------------


def test_make_task_multiclass(dbpedia: TextDataset) -> None:
    y, classes = make_task(dbpedia.labels)
    assert classes == sorted(set(dbpedia.labels))
    assert y.dtype == np.int64 and y.shape == (10_000,)
    assert set(y.tolist()) == set(range(14))
    assert all(classes[k] == lab for k, lab in zip(y[:50], dbpedia.labels[:50], strict=True))


def test_make_task_one_vs_rest(dbpedia: TextDataset) -> None:
    y, classes = make_task(dbpedia.labels, "one_vs_rest", positive="Album")
    assert classes == ["rest", "Album"]
    assert y.dtype == np.int64
    assert int(y.sum()) == dbpedia.labels.count("Album") > 0
    assert all((k == 1) == (lab == "Album") for k, lab in zip(y, dbpedia.labels, strict=True))


def test_make_task_errors() -> None:
    with pytest.raises(DataError, match="positive class 'Zebra' not in the data; labels are: a, b"):
        make_task(["b", "a", "b"], "one_vs_rest", positive="Zebra")
    with pytest.raises(DataError, match="needs a positive class"):
        make_task(["a", "b"], "one_vs_rest")
    with pytest.raises(DataError, match="multiclass, one_vs_rest"):
        make_task(["a", "b"], "regression")


# --------------------------------------------------------------------------------------------
# partition
# --------------------------------------------------------------------------------------------


def _assert_covers(parts: list[np.ndarray], n: int) -> None:
    for p in parts:
        assert np.all(np.diff(p) > 0)  # sorted, no duplicates
    allrows = np.concatenate(parts)
    assert len(allrows) == n
    assert np.array_equal(np.sort(allrows), np.arange(n))


@pytest.mark.parametrize(
    ("scheme", "kwargs"),
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.5}),
        ("dirichlet", {"alpha": 0.1}),
        ("proportions", {"proportions": [0.5, 0.3, 0.2]}),
    ],
)
def test_partition_covers_all_rows_disjointly(y14: np.ndarray, scheme: str, kwargs: dict) -> None:
    parts = partition(y14, 3, scheme=scheme, seed=1, **kwargs)
    assert len(parts) == 3
    _assert_covers(parts, len(y14))
    again = partition(y14, 3, scheme=scheme, seed=1, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_partition_iid_sizes_and_seed(y14: np.ndarray) -> None:
    parts = partition(y14, 7, "iid", seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == len(y14)
    other = partition(y14, 7, "iid", seed=1)
    assert not np.array_equal(parts[0], other[0])


def _label_skew(y: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each part's label distribution and the global one."""
    k = int(y.max()) + 1
    overall = np.bincount(y, minlength=k) / len(y)
    tv = [0.5 * np.abs(np.bincount(y[p], minlength=k) / len(p) - overall).sum() for p in parts]
    return float(np.mean(tv))


def test_partition_dirichlet_small_alpha_is_skewed(y14: np.ndarray) -> None:
    skewed = partition(y14, 4, "dirichlet", alpha=0.1, seed=0)
    near_iid = partition(y14, 4, "dirichlet", alpha=100.0, seed=0)
    assert all(len(p) >= 10 for p in skewed)
    assert _label_skew(y14, skewed) > 0.4
    assert _label_skew(y14, near_iid) < 0.1
    assert _label_skew(y14, skewed) > 5 * _label_skew(y14, near_iid)


def test_partition_proportions_nine_to_one(y14: np.ndarray) -> None:
    parts = partition(y14, 2, "proportions", proportions=[9, 1], seed=0)
    _assert_covers(parts, len(y14))
    assert [len(p) for p in parts] == [9_000, 1_000]
    same = partition(y14, 2, "proportions", proportions=[0.9, 0.1], seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same, strict=True))


def test_partition_dirichlet_equal_from_the_config(tmp_path: Path) -> None:
    """`data.partition: dirichlet_equal` gives every worker the same number of documents, more
    skewed at a small alpha than at a large one."""
    from common.config import parse_config
    from common.data.shards import local_data

    def top_share(alpha: float) -> float:
        cfg = parse_config({"workers": ["a", "b", "c"], "output_dir": str(tmp_path),
                            "data": {"path": str(DBPEDIA), "limit": 301, "task": "multiclass",
                                     "partition": "dirichlet_equal", "alpha": alpha}})
        shards = [local_data(cfg, w) for w in ("a", "b", "c")]
        rows = [np.concatenate([s.train_index, s.test_index]) for s in shards]
        assert [len(r) for r in rows] == [100, 100, 100]  # 301 // 3 each, one row left over
        assert len(np.unique(np.concatenate(rows))) == 300
        y = shards[0].y  # the whole dataset's labels
        return float(np.mean([np.bincount(y[r]).max() / len(r) for r in rows]))

    assert top_share(0.1) > top_share(100.0) + 0.05


def test_partition_errors(y14: np.ndarray) -> None:
    with pytest.raises(DataError, match="0 workers cannot share"):
        partition(y14, 0)
    with pytest.raises(DataError, match=r"6 workers cannot share 5 document\(s\): at most one "
                                        r"worker a document"):
        partition(np.arange(5), 6)
    with pytest.raises(DataError, match="iid, dirichlet, dirichlet_equal, proportions"):
        partition(y14, 2, "stripes")
    with pytest.raises(DataError, match="one share per part"):
        partition(y14, 3, "proportions", proportions=[0.5, 0.5])
    with pytest.raises(DataError, match="one share per part"):
        partition(y14, 3, "proportions")
    with pytest.raises(DataError, match="positive"):
        partition(y14, 2, "proportions", proportions=[1, 0])
    with pytest.raises(DataError, match="alpha"):
        partition(y14, 2, "dirichlet", alpha=0)
    with pytest.raises(DataError, match="at least 10 rows"):
        partition(np.zeros(25, dtype=np.int64), 3, "dirichlet")
    # alpha~0 sends each class of 200 rows whole to one part: never two parts of >= 290.
    with pytest.raises(DataError, match="100 tries"):
        partition(np.repeat(np.arange(3), 200), 2, "dirichlet", alpha=0.001, min_size=290)


# --------------------------------------------------------------------------------------------
# holdout_split
# --------------------------------------------------------------------------------------------


def test_holdout_split_stratified(y14: np.ndarray) -> None:
    shard = partition(y14, 4, "iid", seed=0)[2]
    train, test = holdout_split(y14, shard, test_fraction=0.2, seed=0)
    assert len(test) == round(0.2 * len(shard))
    assert np.array_equal(np.sort(np.concatenate([train, test])), shard)
    # Stratified: each class's share of the test set matches its share of the shard.
    shard_share = np.bincount(y14[shard], minlength=14) / len(shard)
    test_share = np.bincount(y14[test], minlength=14) / len(test)
    assert np.abs(shard_share - test_share).max() < 0.01
    _, again = holdout_split(y14, shard, test_fraction=0.2, seed=0)
    assert np.array_equal(test, again)


def test_holdout_split_singleton_class_not_stratified() -> None:
    y = np.array([0] * 10 + [1] * 9 + [2])  # class 2 has one row: stratifying would fail
    train, test = holdout_split(y, np.arange(20), test_fraction=0.25, seed=0)
    assert len(test) == 5 and len(train) == 15


def test_holdout_split_errors() -> None:
    y = np.zeros(10, dtype=np.int64)
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(DataError, match="test_fraction"):
            holdout_split(y, np.arange(10), test_fraction=bad)
    with pytest.raises(DataError, match="cannot be split"):
        holdout_split(y, np.array([3]))


# --------------------------------------------------------------------------------------------
# resolve_device
# --------------------------------------------------------------------------------------------


def test_resolve_device() -> None:
    import torch

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("mps") == "mps"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda:0") == "cuda:0"
    else:
        with pytest.raises(DataError, match="device 'cuda' requested but CUDA is not available"):
            resolve_device("cuda")
        with pytest.raises(DataError, match="'cuda:1'"):
            resolve_device("cuda:1")
    with pytest.raises(DataError, match="unknown device"):
        resolve_device("tpu")


# --------------------------------------------------------------------------------------------
# embed_texts (real model; ~60 texts in all)
# --------------------------------------------------------------------------------------------


def test_embed_shape_and_cache(
    dbpedia: TextDataset, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    texts = dbpedia.texts[:24]
    caplog.set_level(logging.INFO, logger="fedctl.data")
    emb = embed_texts(texts, cache_dir=tmp_path, progress=False)
    assert emb.shape == (24, 384) and emb.dtype == np.float32
    assert np.isfinite(emb).all()
    cache_files = list(tmp_path.glob("*.npy"))
    assert len(cache_files) == 1 and len(cache_files[0].stem) == 32

    caplog.clear()
    again = embed_texts(texts, cache_dir=tmp_path, progress=True)
    assert np.array_equal(emb, again) and again.dtype == np.float32
    hits = [r.getMessage() for r in caplog.records if "cache hit" in r.getMessage()]
    assert hits == [f"embeddings: cache hit {cache_files[0]}"]
    assert not any("embedding 24 texts" in r.getMessage() for r in caplog.records)


def test_embeddings_not_kept_read_the_cache_and_write_nothing(
        dbpedia: TextDataset, tmp_path: Path) -> None:
    """A model's predictions (keep=False) read a cached array (a file the cluster trained on
    costs no embedding) but leave no file: each call on new texts left two, for ever."""
    cached = embed_texts(dbpedia.texts[:8], cache_dir=tmp_path, progress=False)
    before = sorted(tmp_path.iterdir())
    assert np.array_equal(embed_texts(dbpedia.texts[:8], cache_dir=tmp_path, progress=False,
                                      keep=False), cached)
    new = embed_texts(dbpedia.texts[8:12], cache_dir=tmp_path, progress=False, keep=False)
    assert new.shape == (4, 384) and np.isfinite(new).all()
    assert sorted(tmp_path.iterdir()) == before
    np.testing.assert_allclose(new, embed_texts(dbpedia.texts[8:12], cache_dir=tmp_path,
                                                progress=False), atol=1e-6)


def test_a_cache_file_someone_else_wrote_is_not_used(dbpedia: TextDataset, tmp_path: Path
                                                     ) -> None:
    """A cache entry replaced by NaN, complex numbers or a header declaring more rows than it
    holds gave NaN probabilities (invalid JSON), a traceback, or an 8 TiB allocation: each is
    ignored and the texts embedded again."""
    texts = dbpedia.texts[:4]
    good = embed_texts(texts, cache_dir=tmp_path, progress=False)
    (entry,) = tmp_path.glob("*.npy")
    for bad in (np.full((4, 384), np.nan, np.float32), np.zeros((4, 384), np.complex64),
                np.zeros((4, 384), np.int32)):
        np.save(entry, bad)
        np.testing.assert_allclose(embed_texts(texts, cache_dir=tmp_path, progress=False),
                                   good, atol=1e-6)
    raw = entry.read_bytes().replace(b"'shape': (4, 384)", b"'shape': (4000000000000, 384)")
    entry.write_bytes(raw)
    np.testing.assert_allclose(embed_texts(texts, cache_dir=tmp_path, progress=False), good,
                               atol=1e-6)


def test_embed_default_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDCTL_CACHE_DIR", str(tmp_path / "env-cache"))
    texts = [
        "The cat sat on the mat.",
        "A kitten was sitting on the rug.",
        "Quarterly interest rates rose sharply at the central bank.",
    ]
    emb = embed_texts(texts, progress=False)
    assert len(list((tmp_path / "env-cache").glob("*.npy"))) == 1

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    assert cos(emb[0], emb[1]) > cos(emb[0], emb[2]) + 0.2
    assert cos(emb[0], emb[1]) > cos(emb[1], emb[2]) + 0.2


def test_embed_empty_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no texts"):
        embed_texts([], cache_dir=tmp_path)


_CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
logging.getLogger("fedctl.data").setLevel(logging.DEBUG)  # progress=False logs at DEBUG
from common.data.embedding import embed_texts
from common.data.reading import read_jsonl
texts = read_jsonl(sys.argv[1]).texts[100:112]
emb = embed_texts(texts, cache_dir=sys.argv[2], progress=False)
print(emb.shape[0], emb.shape[1], float(emb.sum()))
"""


def test_embed_concurrent_processes_compute_once(tmp_path: Path) -> None:
    cache = tmp_path / "shared-cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(DBPEDIA), str(cache)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    outs = [out.split() for out, _ in results]
    assert outs[0][:2] == ["12", "384"] and outs[0] == outs[1]
    # One process computed, the other waited on the lock and read its result.
    logs = [err for _, err in results]
    assert sum("fedctl.data embedding 12 texts" in e for e in logs) == 1
    assert sum("fedctl.data embeddings: cache hit" in e for e in logs) == 1
    assert len(list(cache.glob("*.npy"))) == 1
    assert not list(cache.glob("*.tmp"))


# --------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------


def test_atomic_save_npy_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.npy"
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    atomic_save_npy(target, arr)
    atomic_save_npy(target, arr * 2)  # overwrite in place
    assert np.array_equal(np.load(target), arr * 2)
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.npy"]


def test_atomic_write_bytes_and_cleanup_on_error(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    atomic_write_bytes(target, b'{"ok": true}')
    assert target.read_bytes() == b'{"ok": true}'
    # A failing write leaves the old file intact and no temp file behind.
    with pytest.raises(ValueError):
        atomic_save_npy(target, np.array([object()], dtype=object))
    assert target.read_bytes() == b'{"ok": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_worker_whose_classes_no_one_else_holds_is_named(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """A worker started with `--data` of another task (StackOverflow tags among DBpedia's
    classes) was merged in silence: 31 classes, its federated F1 0.0."""
    import logging

    from common.config import parse_config
    from master.families.mlp import MLPServer
    from master.strategies import make_strategy

    cfg = parse_config({"workers": ["w1", "w2", "w3"], "data": {"task": "multiclass"}},
                       "<test>")
    regs = {"w1": {"input_dim": 8, "classes": ["Album", "Film"]},
            "w2": {"input_dim": 8, "classes": ["Film", "Plant"]},
            "w3": {"input_dim": 8, "classes": [f"tag{i}" for i in range(9)]}}
    with caplog.at_level(logging.WARNING, logger="fedctl.master"):
        MLPServer(cfg, make_strategy("fedavg")).setup(regs)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["mlp: w3's classes (tag0, tag1, tag2, tag3, tag4 and 4 more) share none "
                    "with the other workers' (Album, Film, Plant): the model learns them from "
                    "it alone; is its data another task's?"], said
