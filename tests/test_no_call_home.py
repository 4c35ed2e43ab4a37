"""Nothing calls home: libraries fedctl runs on a node post usage telemetry unless told not to.

Each test runs the real library in a process of its own, outside pytest (MLflow turns its
telemetry off under PYTEST_CURRENT_TEST and CI), with every HTTP(S) request of the standard
library and of ``requests`` recorded and refused, and asserts that none was made.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Installed first in the child: every request of urllib and requests, and every host name
#: looked up (httpx's, huggingface_hub's, any library's), is printed, then fails.
RECORDER = """
import socket, urllib.request, requests.sessions
def _sent(*args, **kwargs):
    print("SENT", *[a for a in args if isinstance(a, str)][:2],
          getattr(args[0], "full_url", "") if args else "", flush=True)
    raise OSError("no network here")
urllib.request.urlopen = _sent
requests.sessions.Session.request = lambda self, method, url, *a, **k: _sent(method, url)
_lookup = socket.getaddrinfo
def _resolve(host, *args, **kwargs):
    if host not in (None, "localhost", "127.0.0.1", "::1"):
        _sent("lookup", str(host))
    return _lookup(host, *args, **kwargs)
socket.getaddrinfo = _resolve
"""


def _run(code: str, tmp_path: Path, **env: str) -> str:
    """``code`` after :data:`RECORDER` in a fresh interpreter, outside pytest and CI; its
    standard output."""
    # (Nor is the hub told to stay offline: `fedctl worker` started by hand does not say so.)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTEST_CURRENT_TEST", "CI", "MLFLOW_DISABLE_TELEMETRY",
                          "DO_NOT_TRACK", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run([sys.executable, "-c", RECORDER + code], cwd=ROOT,
                          env={**clean, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                    reason="the openvino package is not installed")
def test_the_openvino_backend_sends_nothing(tmp_path: Path) -> None:
    """Importing OpenVINO posted a usage event to Google Analytics (openvino_telemetry, with
    no consent file in the user's home) from every worker embedding on the default `auto`
    backend: no document left, but the node called out. Exporting and running the backend
    now sends nothing (the telemetry sends from a thread, then a forked process: waited
    for)."""
    out = _run(f"""
import sys, time
from common.data.embedding import embed_texts_with_backend
emb, used = embed_texts_with_backend(["a short text", "another one"],
                                     cache_dir={str(tmp_path / "cache")!r}, device="cpu",
                                     progress=False, backend="openvino")
time.sleep(2)
print("USED", used, flush=True)
""", tmp_path, FEDCTL_MODELS_DIR=str(tmp_path / "models"))
    assert "SENT" not in out and "USED openvino-" in out, out


def test_the_torch_backend_looks_nothing_up(tmp_path: Path) -> None:
    """The bundled sentence model is read from its folder: embedding on torch, with the hub
    not told to stay offline, looks no host up."""
    out = _run(f"""
from common.data.embedding import embed_texts_with_backend
emb, used = embed_texts_with_backend(["a short text"], cache_dir={str(tmp_path / "cache")!r},
                                     device="cpu", progress=False, backend="torch")
print("USED", used, flush=True)
""", tmp_path)
    assert "SENT" not in out and "USED torch" in out, out


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                    reason="the mlflow package is not installed")
def test_mlflow_tracking_sends_nothing_but_to_its_store(tmp_path: Path) -> None:
    """MLflow 3 fetched its telemetry settings from config.mlflow-telemetry.io (and then posts
    events) from the master's node; a folder store is now written with no request made."""
    out = _run(f"""
import time
from common.tracking import MLflowSink
sink = MLflowSink("file:{tmp_path / 'mlruns'}", "fedctl", "run")
time.sleep(2)
print("RUN", sink.run_id, flush=True)
""", tmp_path)
    assert "SENT" not in out and "RUN " in out, out
    assert (tmp_path / "mlruns").is_dir()
