"""Scores and the metrics log shared by the master, the workers and the baselines."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.metrics import f1_score


def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1.

    Macro-F1 averages over the classes present in ``y_true`` or ``y_pred`` (scikit-learn's
    default): a worker whose test split holds no positives and that predicts none scores 1.0,
    not a meaningless 0.5 from a class it never saw.
    """
    if len(y_true) == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan")}
    return {
        "accuracy": float(np.mean(y_true == y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, average="macro", zero_division=0)),
    }


class MetricsLog:
    """Append-only JSON-lines log: one event per line, flushed as it is written.

    Each line is a complete JSON object, so a reader tailing the file (``fedctl run``'s progress
    display) never sees half an event, and a crash loses at most the line being written.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=_jsonable, allow_nan=True)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics log, skipping a last line still being written."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
