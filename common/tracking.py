"""Experiment tracking: the events of ``metrics.jsonl`` sent on to TensorBoard and MLflow.

The master's metrics log hands every event it writes to the sinks made here
(:func:`make_sinks`), so a tracker sees exactly what the log holds, when a checkpoint covers it:

* ``start`` -> the run's parameters (family, strategy, rounds; MLflow params);
* ``worker_round`` -> each worker's numbers at step = round (``<worker>/<metric>``);
* ``round`` -> the round's numbers (``round/duration_s``, ``round/mean_macro_f1``...);
* ``done`` -> the end (MLflow run finished; TensorBoard files flushed and closed).

Both libraries are optional (``pip install 'fedctl[tracking]'``); a configuration that asks for
one that is missing is a one-line error at start.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

from common.config import ConfigError

log = logging.getLogger("fedctl.tracking")

#: Event fields that are not measurements.
_NOT_METRICS = frozenset({"event", "round", "worker", "time", "version", "participants",
                          "missing"})


class Sink(Protocol):
    def on_event(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _numbers(event: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in event.items() if k not in _NOT_METRICS
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _scalars(event: dict[str, Any]) -> dict[str, float]:
    """The tags and values of one event (none for events that carry no per-round numbers)."""
    kind = event.get("event")
    if kind == "worker_round":
        return {f"{event['worker']}/{k}": v for k, v in _numbers(event).items()}
    if kind == "round":
        return {f"round/{k}": v for k, v in _numbers(event).items()}
    return {}


class TensorBoardSink:
    """Scalars to a TensorBoard event file in ``folder`` (torch's ``SummaryWriter``)."""

    def __init__(self, folder: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("tracking.tensorboard needs the tensorboard package: "
                              "pip install 'fedctl[tracking]'") from None
        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))

    def on_event(self, event: dict[str, Any]) -> None:
        step = int(event.get("round") or 0)
        for tag, value in _scalars(event).items():
            self.writer.add_scalar(tag, value, step)
        if event.get("event") == "start":
            self.writer.add_text("run", ", ".join(f"{k}={v}" for k, v in event.items()
                                                  if k not in ("event", "time")))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class MLflowSink:
    """Params and metrics to an MLflow tracking store (a folder, or a server's URI)."""

    def __init__(self, uri: str, experiment: str, run_name: str | None = None) -> None:
        # MLflow 3 calls home (its usage telemetry, config.mlflow-telemetry.io) from the
        # master's node unless told not to; the user's own setting, if any, stands.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("tracking.mlflow needs the mlflow package: "
                              "pip install 'fedctl[tracking]'") from None
        if uri.startswith("file:"):
            # MLflow 3 keeps its folder store in maintenance and asks for this opt-in; a
            # folder needs no database and reads back with MLflow's own client.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(experiment)
            exp_id = (found.experiment_id if found
                      else self.client.create_experiment(experiment))
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        except Exception as exc:  # MLflow's own errors: a bad URI, an unreachable server
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"tracking.mlflow ({uri}): {first}") from None
        self._closed = False

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            for k, v in event.items():
                if k not in ("event", "time"):
                    self.client.log_param(self.run_id, k, v)
            return
        step = int(event.get("round") or 0)
        for tag, value in _scalars(event).items():
            self.client.log_metric(self.run_id, tag, value, step=step)
        if kind == "done":
            self.close()

    def close(self, status: str = "FINISHED") -> None:
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id, status)


def make_sinks(tracking: Any, out_dir: str | Path, run_name: str | None = None) -> list[Sink]:
    """The sinks ``tracking`` (a :class:`common.config.TrackingConfig`) asks for, with their
    default places inside the run's folder ``out_dir``."""
    out = Path(out_dir)
    sinks: list[Sink] = []
    if tracking.tensorboard:
        folder = out / "tensorboard" if tracking.tensorboard is True else tracking.tensorboard
        sinks.append(TensorBoardSink(folder))
        log.info("tracking: TensorBoard events in %s", folder)
    if tracking.mlflow:
        uri = tracking.mlflow
        if uri is True:
            uri = str(out / "mlruns")
        if "://" not in uri and not uri.startswith("file:"):
            uri = Path(uri).resolve().as_uri()
        sinks.append(MLflowSink(uri, tracking.experiment, run_name))
        log.info("tracking: MLflow experiment %r at %s", tracking.experiment, uri)
    return sinks
