"""Inference backends for the sentence model: PyTorch as shipped, or the same weights exported
here, once, to OpenVINO (bfloat16 where the CPU has it) or to ONNX Runtime with int8 dynamic
quantization.

Nothing is downloaded, and nothing is sent: importing OpenVINO posts a usage event to Google
Analytics (its ``openvino_telemetry`` package, with no consent file in the user's home); the
package is kept from loading here (:func:`openvino`), and OpenVINO falls back to its own
stub. The export reads the local model folder and is written beside the
embedding cache (``~/.cache/fedctl/models/<model>-<hash>/<backend>/``, or under
``$FEDCTL_MODELS_DIR``), atomically and under a file lock, so a master and workers on one
machine export once and every later process reuses it.

The exported backends run the model's transformer only; mean pooling and the L2 normalization
of the sentence-transformers pipeline (``1_Pooling``, ``2_Normalize``) are done here, so they
support models whose pooling is the mean of the token embeddings (all-MiniLM-L6-v2's). Another
pipeline falls back to torch, saying so.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from common.data.embedding import gpu_possible
from common.data.reading import DataError

log = logging.getLogger("fedctl.data")

#: The names a caller may ask for; ``auto`` picks the fastest one available.
BACKENDS = ("auto", "torch", "openvino", "onnx-int8")
#: Where ``auto`` looks first on a CPU-only machine.
_AUTO_ORDER = ("openvino",)
#: Which pip package each exported backend needs (for the one-line error).
_PACKAGES = {"openvino": ("openvino",), "onnx-int8": ("onnxruntime", "onnx")}
#: Each backend's batch size when the caller gives none (measured on 2 cores: see
#: benchmarks/results/embedding.md).
DEFAULT_BATCH = {"torch": 64, "openvino": 32, "onnx-int8": 16}


class BackendUnavailable(Exception):
    """An exported backend could not be built or loaded (the caller falls back to torch)."""


def node_threads() -> int:
    """The CPU cores this process may run on (its affinity mask, not the machine's count),
    capped by ``$OMP_NUM_THREADS`` when set: the share ``fedctl worker --threads`` gives each
    of several workers on one host."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        cores = max(1, os.cpu_count() or 1)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(cores, int(cap)) if cap.isdigit() and int(cap) > 0 else cores


def check_backend_name(name: str | None) -> str:
    """``name`` normalised (None and "" mean ``auto``), or a one-line :class:`DataError`."""
    key = (name or "auto").strip().lower()
    if key not in BACKENDS:
        raise DataError(f"unknown embedding backend '{name}'; use {', '.join(BACKENDS)}")
    return key


def _missing_package(backend: str) -> str | None:
    import importlib.util

    for pkg in _PACKAGES.get(backend, ()):
        if importlib.util.find_spec(pkg) is None:
            return pkg
    return None


def openvino() -> Any:
    """The ``openvino`` module, imported with its telemetry kept out of the process: a
    worker's node must not post anything anywhere (a ``None`` in ``sys.modules`` makes the
    import of ``openvino_telemetry`` fail, which OpenVINO expects and answers with a stub)."""
    if "openvino_telemetry" not in sys.modules:
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]
    import openvino as ov

    return ov


def _openvino_precision() -> str:
    ov = openvino()

    return str(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name())


def resolve_backend(name: str | None, device: str) -> str:
    """The backend that will run, as named in logs and cache keys.

    Parameters
    ----------
    name : str or None
        One of :data:`BACKENDS` (None is ``auto``).
    device : str
        A resolved torch device name (see :func:`common.data.embedding.resolve_device`).

    Returns
    -------
    str
        ``torch``, ``openvino-<precision>`` (``openvino-bf16`` on a CPU with bfloat16
        instructions, ``openvino-f32`` otherwise) or ``onnx-int8``.

    Raises
    ------
    DataError
        An unknown name; an exported backend asked for by name whose package is missing, or
        with a device other than the CPU.

    Notes
    -----
    ``auto`` is torch whenever a GPU is present (the device asked for, or CUDA/MPS available
    to this process): workers embedding on the GPU and a master on the CPU then share one
    cache entry. On a CPU-only machine it is the first of :data:`_AUTO_ORDER` whose package is
    installed, else torch.
    """
    key = check_backend_name(name)
    if key == "torch":
        return "torch"
    if key == "auto":
        gpu = device != "cpu"
        if not gpu and gpu_possible():  # (without torch's import where no GPU can be)
            import torch

            gpu = (torch.cuda.is_available()
                   or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()))
        if gpu:
            return "torch"
        for candidate in _AUTO_ORDER:
            if _missing_package(candidate) is None:
                return _label(candidate)
        return "torch"
    if device != "cpu":
        raise DataError(f"embedding backend '{key}' runs on the CPU, not on '{device}'; "
                        "use --backend torch (or auto) for a GPU")
    pkg = _missing_package(key)
    if pkg is not None:
        raise DataError(f"embedding backend '{key}' needs the {pkg} package "
                        f"(pip install {' '.join(_PACKAGES[key])})")
    return _label(key)


def _label(backend: str) -> str:
    return f"openvino-{_openvino_precision()}" if backend == "openvino" else backend


def family(label: str) -> str:
    """``openvino-bf16`` -> ``openvino``: the backend a label belongs to."""
    return "openvino" if label.startswith("openvino") else label


# --------------------------------------------------------------------------------------------
# The exported backends' pipeline: tokenizer, transformer, mean pooling, normalization
# --------------------------------------------------------------------------------------------


def _pipeline(model_path: str) -> tuple[int, bool]:
    """``(max_seq_length, normalize)`` of a sentence-transformers folder whose pooling is the
    token mean; :class:`BackendUnavailable` for any other pipeline."""
    folder = Path(model_path)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        raise BackendUnavailable(f"{folder} has no modules.json")
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise BackendUnavailable(f"pipeline {kinds} is not Transformer, mean Pooling[, Normalize]")
    pooling_path = folder / modules[1].get("path", "1_Pooling") / "config.json"
    pooling = json.loads(pooling_path.read_text(encoding="utf-8")) if pooling_path.is_file() else {}
    modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
    if modes != ["pooling_mode_mean_tokens"]:
        raise BackendUnavailable(f"pooling {modes or 'unknown'} is not the token mean")
    max_len = 512
    bert_cfg = folder / "sentence_bert_config.json"
    if bert_cfg.is_file():
        max_len = int(json.loads(bert_cfg.read_text(encoding="utf-8")).get("max_seq_length")
                      or max_len)
    return max_len, len(kinds) == 3


def models_dir() -> Path:
    """Where exported models live: ``$FEDCTL_MODELS_DIR``, or ``~/.cache/fedctl/models``
    (beside the default embedding cache, ``~/.cache/fedctl/embeddings``)."""
    env = os.environ.get("FEDCTL_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fedctl" / "models"


def export_dir(model_path: str, root: Path, backend: str) -> Path:
    """``<root>/<model folder's last two parts>-<sha256 of its files, 16 hex>/<backend>``: a
    changed model file gets a new export."""
    from common.data.embedding import embedding_identity

    ident = embedding_identity(model_path)
    name = ident["name"].replace("/", "-")
    return root / f"{name}-{ident['sha256'][:16]}" / backend


def _torch_transformer(model_path: str) -> tuple[Any, dict[str, Any]]:
    """The model folder's transformer as a module of (input_ids, attention_mask,
    token_type_ids) -> last hidden state, and an example input for tracing."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    base = AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()

    class LastHidden(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    tok = AutoTokenizer.from_pretrained(model_path)
    example = tok(["An example sentence to trace the model with.", "Another one."],
                  padding=True, return_tensors="pt", return_token_type_ids=True)
    return LastHidden(base), {k: example[k] for k in
                              ("input_ids", "attention_mask", "token_type_ids")}


def _write_openvino(model_path: str, out: Path) -> None:
    ov = openvino()
    import torch

    module, example = _torch_transformer(model_path)
    with torch.no_grad():
        converted = ov.convert_model(module, example_input=example)
    ov.save_model(converted, str(out / "model.xml"), compress_to_fp16=False)


def _write_onnx_int8(model_path: str, out: Path) -> None:
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    module, example = _torch_transformer(model_path)
    names = list(example)
    axes = {n: {0: "batch", 1: "tokens"} for n in [*names, "last_hidden_state"]}
    fp32 = out / "model_fp32.onnx"
    with torch.no_grad():
        torch.onnx.export(module, tuple(example.values()), str(fp32), input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)
    quantize_dynamic(str(fp32), str(out / "model.onnx"), weight_type=QuantType.QInt8,
                     per_channel=True)
    fp32.unlink()


_WRITERS: dict[str, tuple[str, Callable[[str, Path], None]]] = {
    "openvino": ("model.xml", _write_openvino),
    "onnx-int8": ("model.onnx", _write_onnx_int8),
}


def exported_model(model_path: str, root: Path, backend: str) -> Path:
    """The exported model file of ``backend``, exported now if it is not there yet.

    The export is written into a temporary folder beside its place and renamed into it, under
    an exclusive file lock: concurrent processes export once, and a crash leaves no half
    export behind.
    """
    target = export_dir(model_path, root, backend)
    file_name, write = _WRITERS[backend]
    if (target / file_name).is_file():
        return target / file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / file_name).is_file():  # another process exported while we waited
            return target / file_name
        log.info("exporting %s to %s (%s, once)", display_name(model_path), target, backend)
        tmp = Path(tempfile.mkdtemp(prefix=f".{backend}-", dir=target.parent))
        try:
            with _quiet():
                write(model_path, tmp)
            if target.exists():  # an unfinished folder without the model file
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target / file_name


@contextmanager
def _quiet() -> Iterator[None]:
    """No tracer warnings and no INFO or WARNING lines of the exporters while exporting (the
    quantizer logs each tensor, and advice, on the root logger); errors still show."""
    before = logging.root.manager.disable
    logging.disable(max(before, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def display_name(model_path: str) -> str:
    """``all-MiniLM-L6-v2`` for the bundled model, else the folder's last two path parts."""
    from common.data.embedding import default_model_path

    if Path(model_path) == Path(default_model_path()):
        return "all-MiniLM-L6-v2"
    return "/".join(Path(model_path).parts[-2:])


@dataclass
class Encoder:
    """A loaded backend: ``encode(texts, batch_size, progress)`` -> float32 rows."""

    name: str
    threads: int
    encode: Callable[[list[str], int, bool], np.ndarray]


def _batches(texts: list[str], tokenizer: Any, max_len: int, batch_size: int
             ) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Batches of similar length (longest first, as sentence-transformers does), tokenized."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    out = []
    for start in range(0, len(texts), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                        max_length=max_len, return_tensors="np", return_token_type_ids=True)
        out.append((idx, {k: np.asarray(enc[k], dtype=np.int64)
                          for k in ("input_ids", "attention_mask", "token_type_ids")}))
    return out


def _pool(hidden: np.ndarray, mask: np.ndarray, normalize: bool) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    emb = (hidden.astype(np.float32) * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    if normalize:
        emb /= np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
    return emb


def _progress_bar(total: int, progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Batches", disable=not progress)


def _load_openvino(model_path: str, root: Path, threads: int) -> Encoder:
    ov = openvino()
    from transformers import AutoTokenizer

    max_len, normalize = _pipeline(model_path)
    xml = exported_model(model_path, root, "openvino")
    core = ov.Core()
    # Throughput mode: OpenVINO splits the threads into streams (2 of 1 thread on 2 cores)
    # and the batches run on them side by side, faster than one batch on all threads.
    compiled = core.compile_model(str(xml), "CPU", {"PERFORMANCE_HINT": "THROUGHPUT",
                                                     "INFERENCE_NUM_THREADS": threads})
    jobs = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
    inputs = {i.get_any_name() for i in compiled.inputs}
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def encode(texts: list[str], batch_size: int, progress: bool) -> np.ndarray:
        result = np.empty((len(texts), compiled.outputs[0].get_partial_shape()[2].get_length()),
                          dtype=np.float32)
        bar = _progress_bar(-(-len(texts) // batch_size), progress)
        queue = ov.AsyncInferQueue(compiled, jobs)

        def done(request: Any, userdata: tuple[np.ndarray, np.ndarray]) -> None:
            idx, mask = userdata
            result[idx] = _pool(request.get_output_tensor(0).data, mask, normalize)
            bar.update(1)

        queue.set_callback(done)
        for idx, enc in _batches(texts, tokenizer, max_len, batch_size):
            queue.start_async({k: v for k, v in enc.items() if k in inputs},
                              (idx, enc["attention_mask"]))
        queue.wait_all()
        bar.close()
        return result

    return Encoder(f"openvino-{_openvino_precision()}", threads, encode)


def _load_onnx_int8(model_path: str, root: Path, threads: int) -> Encoder:
    import onnxruntime as ort
    from transformers import AutoTokenizer

    max_len, normalize = _pipeline(model_path)
    path = exported_model(model_path, root, "onnx-int8")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def encode(texts: list[str], batch_size: int, progress: bool) -> np.ndarray:
        parts = []
        with _progress_bar(-(-len(texts) // batch_size), progress) as bar:
            for idx, enc in _batches(texts, tokenizer, max_len, batch_size):
                hidden = session.run(None, {k: v for k, v in enc.items() if k in inputs})[0]
                parts.append((idx, _pool(hidden, enc["attention_mask"], normalize)))
                bar.update(1)
        result = np.empty((len(texts), parts[0][1].shape[1]), dtype=np.float32)
        for idx, emb in parts:
            result[idx] = emb
        return result

    return Encoder("onnx-int8", threads, encode)


@lru_cache(maxsize=4)
def load_exported(model_path: str, root: str, backend: str) -> Encoder:
    """An exported backend ready to encode (cached per process), its export under ``root``
    (see :func:`models_dir`).

    Raises
    ------
    BackendUnavailable
        Whatever stops it: the model's pipeline, the export, the runtime.
    """
    loader = {"openvino": _load_openvino, "onnx-int8": _load_onnx_int8}[backend]
    try:
        return loader(model_path, Path(root), node_threads())
    except BackendUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party runtime: fall back
        raise BackendUnavailable(f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc


# A compiled OpenVINO model destroyed in the interpreter's own teardown once aborted a process
# after its work was done ("terminate called without an active exception": once, in a test
# child process; not in 32 runs since): drop the cached encoders while the interpreter is whole.
atexit.register(load_exported.cache_clear)
