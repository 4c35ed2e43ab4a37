"""Update compression: each kind against the exact update, error feedback, hostile input, and a
real cluster whose uploads shrink."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.net.compression import Compressor, decompress
from common.net.wire import ProtocolError
from tests.conftest import MakeConfig, events, start_worker_threads

RNG = np.random.default_rng(0)
BASE = {"w": RNG.normal(size=(50, 40)).astype(np.float32), "b": np.zeros(40, np.float32),
        "steps": np.array([3], dtype=np.int64)}


def _new(scale: float = 0.1) -> dict[str, np.ndarray]:
    return {"w": BASE["w"] + RNG.normal(scale=scale, size=BASE["w"].shape).astype(np.float32),
            "b": BASE["b"] + np.float32(scale), "steps": np.array([4], dtype=np.int64)}


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(np.asarray(a).nbytes for a in arrays.values())


def test_none_sends_the_parameters_themselves() -> None:
    new = _new()
    assert Compressor("none").compress(new, BASE) == new
    assert decompress("none", new, BASE) == new


@pytest.mark.parametrize(("kind", "ratio", "tol"), [("float16", 0.51, 1e-3), ("int8", 0.27, 2e-3)])
def test_quantized_deltas_are_close_and_small(kind: str, ratio: float, tol: float) -> None:
    new = _new()
    sent = Compressor(kind).compress(new, BASE)
    assert _nbytes(sent) <= ratio * _nbytes(new) + 16
    back = decompress(kind, sent, BASE)
    assert back["w"].dtype == np.float32 and back["w"].shape == (50, 40)
    np.testing.assert_allclose(back["w"], new["w"], atol=tol)
    np.testing.assert_array_equal(back["steps"], new["steps"])  # integers travel as they are


def test_topk_keeps_the_largest_changes_and_feeds_back_the_rest() -> None:
    c = Compressor("topk", fraction=0.05)
    new = _new()
    sent = c.compress(new, BASE)
    assert sent["w#idx"].size == 100 and sent["w#val"].size == 100
    delta = (new["w"] - BASE["w"]).reshape(-1)
    kept = np.sort(np.abs(delta))[-100:]
    np.testing.assert_allclose(np.sort(np.abs(sent["w#val"])), kept)
    back = decompress("topk", sent, BASE)
    # What was dropped waits in the residual: sent + residual is the whole change.
    np.testing.assert_allclose((back["w"] - BASE["w"]) + c.residual_["w"], new["w"] - BASE["w"],
                               atol=1e-6)


def test_error_feedback_loses_nothing_over_rounds() -> None:
    """Sending the same change every round: top-k's running total catches up with the truth."""
    c = Compressor("topk", fraction=0.1)
    target = _new()
    total = np.zeros_like(BASE["w"])
    for _ in range(30):
        back = decompress("topk", c.compress(target, BASE), BASE)
        total += back["w"] - BASE["w"]
    step = target["w"] - BASE["w"]
    # Nothing lost: what arrived plus what still waits is exactly what was sent ...
    np.testing.assert_allclose(total + c.residual_["w"], 30 * step, rtol=1e-4, atol=1e-4)
    # ... and what waits stays bounded (each value goes out once it is among the largest).
    assert np.abs(c.residual_["w"]).max() <= 15 * np.abs(step).max()


@pytest.mark.parametrize(("kind", "mutate", "code"), [
    ("float16", lambda s: s.pop("w"), "shape"),
    ("float16", lambda s: s.__setitem__("w", s["w"].astype(np.float32)), "dtype"),
    ("int8", lambda s: s.pop("w#scale"), "shape"),
    ("topk", lambda s: s.__setitem__("w#idx", s["w#idx"] + 10_000), "shape"),
    ("topk", lambda s: s.__setitem__("w#val", s["w#val"][:3]), "shape"),
    ("zip", lambda s: None, "bad_field"),
])
def test_bad_compressed_updates_are_refused(kind: str, mutate, code: str) -> None:
    sent = Compressor(kind if kind != "zip" else "none").compress(_new(), BASE)
    mutate(sent)
    with pytest.raises(ProtocolError) as info:
        decompress(kind, sent, BASE)
    assert info.value.code == code


@pytest.mark.slow
def test_cluster_with_int8_updates(tmp_path: Path, make_config: MakeConfig) -> None:
    """The master and two workers run on threads of this process (real sockets, real training,
    the config as `fedctl run` reads it): int8 travels both ways, on a cluster whose processes
    are other tests' subject (test_cluster.py), without three more torch imports."""
    from common.config import load_config
    from master.server import Master

    cfg = load_config(make_config(tmp_path, workers=2, rounds=3, compression={"kind": "int8"}))
    assert cfg.compression["kind"] == "int8"
    master = Master(cfg)
    master.bind()
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []
    threads = start_worker_threads(cfg, ["w1", "w2"], reports, errors)
    try:
        summary = master.serve()
    finally:
        master.close()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(reports) == ["w1", "w2"] and not summary.get("failed"), summary
    assert summary["trained"]["rounds"] == 3, summary
    out = tmp_path / "out"
    up = [e["bytes_out"] for e in events(out, "worker_round")]
    assert len(up) == 2 * 3
    # An uncompressed update carries every float32 array of the model (test_cluster checks
    # bytes_out >= the model's size on a plain run), so this bound is no looser than comparing
    # with a plain run of the same job.
    with np.load(out / "model.npz") as npz:
        arrays = [npz[name] for name in npz.files]
    assert arrays and all(a.dtype == np.float32 for a in arrays)
    assert max(up) < 0.3 * sum(a.nbytes for a in arrays)
    f1 = [e["mean_macro_f1"] for e in events(out, "round")]
    assert len(f1) == 3 and all(0 <= x <= 1 for x in f1)
