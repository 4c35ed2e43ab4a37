"""A finished run's folder, read back: the model, what it is, the config and the results."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ClusterConfig, load_config
from common.runlog import read_metrics

__all__ = ["Run", "load_run"]


@dataclass
class Run:
    """What ``fedctl run`` (or ``fedctl master``) left in its output folder.

    Attributes
    ----------
    path : Path
    family : str
    config : ClusterConfig
        The configuration the processes ran (``cluster.yaml`` of the folder).
    arrays : dict of str to numpy.ndarray
        The final global parameters (``model.npz``).
    model : dict
        ``model.json``: family, setup (classes, vocabulary...), rounds, version, run id.
    comparison : dict or None
        ``comparison.json``: per-worker and pooled scores.
    summary : dict or None
    """

    path: Path
    family: str
    config: ClusterConfig
    arrays: dict[str, np.ndarray]
    model: dict[str, Any]
    comparison: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    _metrics: list[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The events of ``metrics.jsonl``, read on first use."""
        if self._metrics is None:
            self._metrics = read_metrics(self.path / "metrics.jsonl")
        return self._metrics


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load_run(path: str | Path) -> Run:
    """Read a finished run's folder; FileNotFoundError (one line) if it holds no model."""
    folder = Path(path)
    if not (folder / "model.npz").is_file():
        raise FileNotFoundError(f"{folder}: no model.npz (not a finished fedctl run)")
    with np.load(folder / "model.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    model = _json(folder / "model.json") or {}
    return Run(path=folder, family=str(model.get("family", "")),
               config=load_config(folder / "cluster.yaml"), arrays=arrays, model=model,
               comparison=_json(folder / "comparison.json"),
               summary=_json(folder / "summary.json"))
