"""A finished run's folder, read back: the model, what it is, the config and the results."""

from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common import constants as C
from common.atomic import is_locked
from common.config import ClusterConfig, load_config
from common.npz import load_npz
from common.runlog import read_metrics
from fedctl.errors import one_line

__all__ = ["Run", "load_run", "list_runs", "wall_time", "headline"]


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


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, None when there is none; ValueError naming the file when
    it is not one (a run killed while writing it, a hand edit)."""
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    except RecursionError:  # lists nested past Python's stack
        raise ValueError(f"{path}: not readable JSON (nested too deep)") from None
    if not isinstance(found, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(found).__name__}")
    return found


def load_run(path: str | Path) -> Run:
    """Read a finished run's folder; FileNotFoundError (one line) if it holds no model."""
    folder = Path(path)
    if not (folder / "model.npz").is_file():
        raise FileNotFoundError(f"{folder}: no model.npz ({_why_no_model(folder)})")
    try:
        arrays = load_npz(folder / "model.npz")  # (each array's size held to the file)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, MemoryError) as exc:
        # (an empty file, a copy cut short: EOFError)
        raise ValueError(f"{folder / 'model.npz'}: not a readable model "
                         f"({one_line(exc)})") from None
    model = read_json(folder / "model.json") or {}
    if not isinstance(model.get("family"), str) or not model["family"]:
        raise ValueError(f"{folder / 'model.json'}: "
                         f"{'names no family' if model else 'missing'} (written beside "
                         f"model.npz at a run's end: copy the whole run folder)")
    return Run(path=folder, family=str(model.get("family", "")),
               config=load_config(folder / "cluster.yaml"), arrays=arrays, model=model,
               comparison=read_json(folder / "comparison.json"),
               summary=read_json(folder / "summary.json"))


def failed_note(folder: str | Path) -> str | None:
    """Why the run in ``folder`` failed, from the note ``fedctl run`` leaves there (None: no
    note; "no reason written" for an empty one)."""
    note = Path(folder) / C.FAILED_NOTE
    if not note.is_file():
        return None
    return one_line(note.read_text(errors="replace")) or "no reason written"


def _why_no_model(folder: Path) -> str:
    """Why a folder holds no model, for the one-line error: its run failed (and why), is
    still running or was stopped, or is not a run at all."""
    why = failed_note(folder)
    if why is not None:
        return f"its run failed: {why}"
    if folder.name.endswith(".failed"):
        return "its run failed"
    if (folder / "metrics.jsonl").is_file() or folder.name.endswith(C.STAGING_SUFFIX):
        return "its run has not finished: still running, or stopped"
    return "not a finished fedctl run"


#: Files only a run writes: a folder holding one of them is listed by :func:`list_runs`.
RUN_MARKS = ("metrics.jsonl", "summary.json", "model.json", C.FAILED_NOTE)


def started(run_dir: str | Path) -> float | None:
    """When the run began: the time of the first event of its ``metrics.jsonl`` (None if it
    has none yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = json.loads(fh.readline())
    except (OSError, ValueError):
        return None
    t = first.get("time") if isinstance(first, dict) else None
    return float(t) if isinstance(t, (int, float)) else None


def _events(run_dir: str | Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s events ([] without the file)."""
    path = Path(run_dir) / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def wall_time(run_dir: str | Path, events: list[dict[str, Any]] | None = None
              ) -> float | None:
    """Seconds from the run's first event to its last (``metrics.jsonl``, or ``events``
    already read from it), if it has two."""
    events = _events(run_dir) if events is None else events
    times = [e["time"] for e in events if isinstance(e.get("time"), (int, float))]
    return max(times) - min(times) if len(times) > 1 else None


def rounds_logged(run_dir: str | Path, events: list[dict[str, Any]] | None = None) -> int:
    """The last round whose ``round`` event ``metrics.jsonl`` (or ``events``) holds (0 for
    none): of a run that stopped, those a resume does not run again."""
    events = _events(run_dir) if events is None else events
    done = [e.get("round") for e in events if e.get("event") == "round"]
    return max((r for r in done if isinstance(r, int)), default=0)


def strategy_name(cfg: ClusterConfig) -> str:
    """What aggregates: the strategy, or "its own rule" for a family that has one (lda, fstc:
    their config's fedavg is the default, not what runs)."""
    from master.families import server_family_class

    try:
        own = server_family_class(cfg).own_rule
    except Exception:  # a family this install lacks (a plugin): say what the file says
        own = None
    if own is not None:
        return "its own rule"
    if cfg.family in ("prodlda", "combinedtm") and cfg.family_params.get("mode", "sync") == "sync":
        return "synchronous steps"  # gradients summed, one Adam step at the master: no strategy
    # client_dp replaces the strategy with DP-FedAvg (master.families), as check says.
    return "dpfedavg" if cfg.privacy.client_dp is not None else str(cfg.strategy.get("name"))


#: The score a run's one-line summary names: the first of these its workers reported.
HEADLINES = (("macro_f1", "macro-F1"), ("accuracy", "accuracy"), ("npmi_doc", "NPMI"),
             ("perplexity", "perplexity"), ("nmi", "NMI"))


def headline(summary: dict[str, Any] | None) -> str:
    """``"macro-F1 0.9808"``: the mean over workers of the first federated score of
    :data:`HEADLINES` in ``summary.json``'s comparison, or ``"-"``."""
    rows = (summary or {}).get("comparison") or []
    for key, label in HEADLINES:
        vals = [r[f"federated_{key}"] for r in rows
                if isinstance(r.get(f"federated_{key}"), (int, float))]
        if vals:
            return f"{label} {sum(vals) / len(vals):.4f}"
    return "-"


def run_state(folder: Path) -> dict[str, Any]:
    """One run folder as :func:`list_runs` lists it: path, family, workers, rounds, headline
    score, start, wall time and state."""
    try:
        summary = read_json(folder / "summary.json")
        model = read_json(folder / "model.json") or {}
    except ValueError as exc:  # listed, as damaged: one bad run must not hide the others
        summary, model, damaged = None, {}, str(exc)
    else:
        damaged = None
    if damaged is not None:
        state = f"damaged: {Path(damaged.split(': ', 1)[0]).name} unreadable"
    elif (folder / C.FAILED_NOTE).exists() or (summary or {}).get("failed") or (
            folder.name.endswith(".failed") and summary is None):
        # (a failed run resumed to its end has its summary and no note: finished)
        state = "failed"
        if summary is None and (folder / "checkpoint.npz").is_file():
            state = "failed, resumable"  # stopped by Ctrl-C, a dead worker, the deadline
    elif summary is not None and (folder / "model.npz").is_file():
        # (a model.json lost in a copy: `fedctl predict` cannot use the run)
        state = "finished" if model else "damaged: model.json missing"
    elif is_locked(folder / C.MASTER_LOCK):  # its master holds the lock while it lives
        state = "running"
    else:
        state = ("stopped, resumable" if (folder / "checkpoint.npz").is_file()
                 else "stopped")
    # A stopped master's events say nothing of how long it lived (one that waited twelve
    # minutes for its workers showed 1.8 s); a running one's wall is its time so far.
    start = started(folder)
    # Read once: an unfinished failed run needs both its wall time and its rounds.
    events = _events(folder) if state != "running" else []
    wall = (wall_time(folder, events) if state in ("finished", "failed", "failed, resumable")
            else time.time() - start if state == "running" and start is not None
            else None)
    note = folder / C.FAILED_NOTE
    if state.startswith("failed") and start is not None and note.is_file():
        # (written when the run ended: its events stopped with its last round, and a run
        # stopped four minutes in showed 18 s)
        wall = max(wall or 0.0, note.stat().st_mtime - start)
    family, workers = model.get("family", "?"), len((summary or {}).get("workers", []))
    rounds: Any = (summary or {}).get("rounds", "-")
    if family == "?" or not workers or summary is None:
        try:
            cfg = load_config(folder / "cluster.yaml")
            family, workers = cfg.family, len(cfg.workers)
        except Exception:  # a folder half-written by a run still starting
            cfg = None
        if summary is None and cfg is not None:
            # Unfinished: the rounds its log holds of those it was to run ("-" said nothing of
            # a run stopped at round 40 of 50).
            rounds = f"{rounds_logged(folder, events or None)}/{cfg.rounds}"
    return {"path": folder, "family": family, "workers": workers,
            "rounds": rounds, "score": headline(summary),
            "wall_s": wall, "state": state, "started": start, "mtime": folder.stat().st_mtime}


def list_runs(root: str | Path) -> list[dict[str, Any]]:
    """Every run folder under ``root`` (``runs/``), oldest first: path, family, workers,
    rounds, headline score, start, wall time and state (``finished``, ``failed``, ``running``
    (its master holds the folder's lock), ``stopped`` or ``stopped, resumable`` (a checkpoint
    to go on from)). The ``latest`` link is not listed twice."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        # What only a run writes (a cluster.yaml alone is also a project's, or a copy's).
        if folder.name == "latest" or not folder.is_dir() or not any(
                (folder / name).is_file() for name in RUN_MARKS):
            continue
        try:
            found.append(run_state(folder))
        except Exception as exc:  # fields of the wrong type: one bad run must not hide the rest
            found.append({"path": folder, "family": "?", "workers": 0, "rounds": "-",
                          "score": "-", "wall_s": None, "state": f"damaged: {one_line(exc)}",
                          "started": None, "mtime": folder.stat().st_mtime})
    # By when each began: a folder's time changes whenever anything is written in it (a
    # prediction saved there moved an old run to the end); the folder's time only where no
    # event says.
    return sorted(found, key=lambda e: (e["started"] if e["started"] is not None
                                        else e["mtime"], e["path"].name))
