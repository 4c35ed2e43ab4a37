"""The sentence model's inference backends (common/data/embedding_backends.py) on the real
model and real abstracts from data/dbpedia_10k: the exported backends agree with torch, the
cache never serves one backend's embeddings for another's, the export is made once and reused,
and a bad name or a missing package is one clear error.

A few hundred texts in all; each backend exports once for the module (seconds).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.data import embedding_backends as eb
from common.data.embedding import (
    _cache_key,
    default_model_path,
    embed_texts,
    embed_texts_with_backend,
)
from common.data.reading import DataError, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
DBPEDIA = ROOT / "data" / "dbpedia_10k" / "dbpedia_10k.jsonl"

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                                    reason="the openvino package is not installed")
needs_onnxruntime = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="the onnxruntime and onnx packages are not installed")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """200 abstracts spread over the file (every 50th: all 14 topics, short and long)."""
    return read_jsonl(DBPEDIA).texts[::50]


@pytest.fixture(scope="module")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One export folder for the module, so each backend exports once here."""
    root = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDCTL_MODELS_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def torch_emb(texts: list[str], tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    return embed_texts(texts, cache_dir=tmp_path_factory.mktemp("torch"), device="cpu",
                       progress=False, backend="torch")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


# --------------------------------------------------------------------------------------------
# Agreement with torch
# --------------------------------------------------------------------------------------------


@needs_openvino
def test_openvino_matches_torch(texts: list[str], torch_emb: np.ndarray, models_root: Path,
                                tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedctl.data")
    emb, used = embed_texts_with_backend(texts, cache_dir=tmp_path, device="cpu",
                                         progress=True, backend="openvino")
    assert used.startswith("openvino-")
    assert emb.shape == torch_emb.shape and emb.dtype == np.float32
    cos = _cosines(emb, torch_emb)
    # Measured on the 10,000 abstracts: mean 0.99999, min 0.99997 (bfloat16 on AMX).
    assert cos.min() >= 0.999, (cos.mean(), cos.min())
    # Same pipeline as torch's: mean pooling, then the model's Normalize.
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    lines = [r.getMessage() for r in caplog.records]
    assert (f"embedding {len(texts)} texts with all-MiniLM-L6-v2 on {used}, "
            f"{eb.node_threads()} threads") in lines


@needs_onnxruntime
def test_onnx_int8_close_to_torch(texts: list[str], torch_emb: np.ndarray, models_root: Path,
                                  tmp_path: Path) -> None:
    emb, used = embed_texts_with_backend(texts, cache_dir=tmp_path, device="cpu",
                                         progress=False, backend="onnx-int8")
    assert used == "onnx-int8"
    cos = _cosines(emb, torch_emb)
    # int8 weights and activations cost more: measured mean 0.9935, min 0.978 on 10,000.
    assert cos.mean() >= 0.99 and cos.min() >= 0.97, (cos.mean(), cos.min())


# --------------------------------------------------------------------------------------------
# Cache keys
# --------------------------------------------------------------------------------------------


def test_cache_key_differs_by_backend(texts: list[str]) -> None:
    path = default_model_path()
    keys = {b: _cache_key(path, texts, b) for b in
            ("torch", "openvino-bf16", "openvino-f32", "onnx-int8")}
    assert len(set(keys.values())) == 4
    # torch's key is the one caches had before there were backends: they stay valid.
    h = hashlib.sha256()
    h.update("/".join(Path(path).parts[-2:]).encode())
    h.update((Path(path) / "config.json").read_bytes())
    h.update(b"\n" + "\0".join(texts).encode())
    assert _cache_key(path, texts) == keys["torch"] == h.hexdigest()


@needs_openvino
def test_one_cache_file_per_backend(texts: list[str], models_root: Path, tmp_path: Path) -> None:
    some = texts[:16]
    a, used = embed_texts_with_backend(some, cache_dir=tmp_path, device="cpu", progress=False,
                                       backend="torch")
    b, used_b = embed_texts_with_backend(some, cache_dir=tmp_path, device="cpu",
                                         progress=False, backend="openvino")
    path = default_model_path()
    files = sorted(p.name for p in tmp_path.glob("*.npy"))
    assert files == sorted(f"{_cache_key(path, some, k)[:32]}.npy" for k in (used, used_b))
    assert not np.array_equal(a, b)  # computed twice, not served from the other's file


# --------------------------------------------------------------------------------------------
# The export: made once, reused
# --------------------------------------------------------------------------------------------


@needs_openvino
def test_export_is_reused(texts: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FEDCTL_MODELS_DIR", str(tmp_path / "models"))
    caplog.set_level(logging.INFO, logger="fedctl.data")
    eb.load_exported.cache_clear()
    embed_texts(texts[:8], cache_dir=tmp_path / "c1", device="cpu", progress=False,
                backend="openvino")
    xml = eb.export_dir(default_model_path(), tmp_path / "models", "openvino") / "model.xml"
    assert xml.is_file()
    stamp = xml.stat().st_mtime_ns
    assert sum("exporting" in r.getMessage() for r in caplog.records) == 1

    eb.load_exported.cache_clear()  # as a new process would: load from disk
    caplog.clear()
    embed_texts(texts[8:16], cache_dir=tmp_path / "c2", device="cpu", progress=False,
                backend="openvino")
    assert not any("exporting" in r.getMessage() for r in caplog.records)
    assert any("on openvino-" in r.getMessage() for r in caplog.records)
    assert xml.stat().st_mtime_ns == stamp
    # Nothing half-written is left beside it.
    assert sorted(p.name for p in xml.parent.parent.iterdir()) == ["openvino", "openvino.lock"]


# --------------------------------------------------------------------------------------------
# Names, packages, fallback
# --------------------------------------------------------------------------------------------


def test_unknown_backend_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^unknown embedding backend 'tpu'; use auto, torch, "
                                        r"openvino, onnx-int8$"):
        embed_texts(["a text"], cache_dir=tmp_path, backend="tpu")
    assert not list(tmp_path.glob("*.npy"))


def test_unknown_backend_on_the_command_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedctl.cli import main

    result = CliRunner().invoke(main, ["data", "embed", str(DBPEDIA), "-o",
                                       str(tmp_path / "x"), "--backend", "nope"])
    assert result.exit_code == 1
    assert result.output.strip() == ("Error: unknown embedding backend 'nope'; "
                                     "use auto, torch, openvino, onnx-int8")


def test_missing_package_is_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules is how Python marks a module that cannot be imported.
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(DataError, match=r"^embedding backend 'openvino' needs the openvino "
                                        r"package \(pip install openvino\)$"):
        eb.resolve_backend("openvino", "cpu")
    # auto goes on without it.
    assert eb.resolve_backend("auto", "cpu") in ("torch", "onnx-int8")


def test_exported_backend_refuses_a_gpu_device() -> None:
    with pytest.raises(DataError, match="runs on the CPU"):
        eb.resolve_backend("openvino", "cuda")


def test_auto_and_names() -> None:
    assert eb.check_backend_name(None) == eb.check_backend_name(" AUTO ") == "auto"
    assert eb.resolve_backend("torch", "cpu") == "torch"
    assert eb.resolve_backend("auto", "cuda") == "torch"  # a GPU: torch, one cache entry
    import torch

    if importlib.util.find_spec("openvino") and not torch.cuda.is_available():
        assert eb.resolve_backend("auto", "cpu").startswith("openvino-")
    cores = len(os.sched_getaffinity(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)
        assert eb.node_threads() == cores
        mp.setenv("OMP_NUM_THREADS", "1")  # a worker's share of a host (fedctl worker)
        assert eb.node_threads() == 1


@needs_openvino
def test_fallback_to_torch_when_the_backend_cannot_load(
        texts: list[str], models_root: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # A copy of the model whose pooling is the CLS token: the exported backends do the token
    # mean only, so OpenVINO cannot serve it and torch does, saying why.
    source = Path(default_model_path())
    model = tmp_path / "cls-model" / "model"
    model.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "1_Pooling":
            (model / item.name).symlink_to(item)
    shutil.copytree(source / "1_Pooling", model / "1_Pooling")
    pooling = model / "1_Pooling" / "config.json"
    pooling.write_text(pooling.read_text().replace('"pooling_mode_cls_token": false',
                                                   '"pooling_mode_cls_token": true')
                       .replace('"pooling_mode_mean_tokens": true',
                                '"pooling_mode_mean_tokens": false'))
    caplog.set_level(logging.INFO, logger="fedctl.data")
    some = texts[:8]
    emb, used = embed_texts_with_backend(some, model_path=str(model), cache_dir=tmp_path / "c",
                                         device="cpu", progress=False, backend="openvino")
    assert used == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "using torch instead" in warnings[0]
    assert "pooling_mode_cls_token" in warnings[0]
    files = [p.name for p in (tmp_path / "c").glob("*.npy")]
    assert files == [f"{_cache_key(str(model), some, 'torch')[:32]}.npy"]
    assert emb.shape == (8, 384)


def test_auto_is_resolved_without_torch_where_no_gpu_can_be() -> None:
    """``auto`` on a machine without a GPU driver (this CPU-only one) is decided before
    ``import torch`` (1.5 s of CPU at every ``fedctl run``'s start); where a driver is present
    it is torch's own answer."""
    import subprocess

    code = ("import sys; from common.data.embedding import gpu_possible, resolve_device; "
            "from common.data.embedding_backends import resolve_backend; "
            "print(gpu_possible(), resolve_device('auto'), resolve_backend('auto', 'cpu'), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    import torch

    gpu = torch.cuda.is_available()
    assert out[0] == "True" or not gpu  # False only where torch finds no GPU either
    assert out[1] == ("cuda" if gpu else "cpu")
    assert out[2] == ("torch" if gpu or importlib.util.find_spec("openvino") is None
                      else eb.resolve_backend("openvino", "cpu"))
    if out[0] == "False":
        assert out[3] == "False"  # decided without importing torch
