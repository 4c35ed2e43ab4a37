"""Master checkpoints: everything needed to resume a job after the master dies.

One file, ``<output_dir>/checkpoint.npz``, written atomically by a background thread (so the
fsync never lands on a round's critical path) after every ``checkpoint_every`` rounds, as long as
writing takes at most ``checkpoint_budget`` of the wall time: the global payload, the strategy's
optimizer state, the family's own state, and a JSON document (stored as a byte array inside the
same archive, so the two can never disagree) with the round, version, registrations and the
sampling generator's state. Loading uses ``allow_pickle=False``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from common.atomic import atomic_write
from common.npz import load_npz
from common.runlog import MetricsLog
from master.families.base import ServerFamily

log = logging.getLogger("fedctl.master")

FILENAME = "checkpoint.npz"
_META = "__meta__"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read back; the message names it (one line)."""


@dataclass
class Checkpoint:
    """The state of a job after a completed round.

    Attributes
    ----------
    meta : dict
        JSON-able: ``run_id``, ``round`` (last completed), ``version``, ``setup_info``,
        ``global_meta``, ``registrations``, ``rng_state``, ``family_meta``.
    global_arrays, strategy_arrays, family_arrays : dict of str to numpy.ndarray
    """

    meta: dict[str, Any]
    global_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    strategy_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    family_arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def write_to(self, fh: BinaryIO) -> None:
        """Write the checkpoint as an ``.npz`` archive to the open file ``fh``."""
        arrays = {f"global/{k}": v for k, v in self.global_arrays.items()}
        arrays |= {f"strategy/{k}": v for k, v in self.strategy_arrays.items()}
        arrays |= {f"family/{k}": v for k, v in self.family_arrays.items()}
        arrays[_META] = np.frombuffer(json.dumps(self.meta).encode(), dtype=np.uint8)
        # Straight into the file: no in-memory copy of a model that may be 100 MB.
        np.savez(fh, **arrays)

    @staticmethod
    def check_resumable(folder: str | Path, rounds: int) -> None:
        """Raise FileNotFoundError (one line) unless ``folder`` holds a run to continue to
        ``rounds``: a checkpoint, and not a finished run of that many rounds already (its
        results would be written over with nothing trained; a finished run resumed with more
        rounds trains them, and a master stopped after its model and before its summary is
        resumed to write it)."""
        path = Path(folder)
        summary = path / "summary.json"
        if summary.is_file():
            try:
                done = json.loads(summary.read_text(encoding="utf-8")).get("rounds")
            except (ValueError, AttributeError):
                done = None
            if isinstance(done, int) and done >= rounds:
                raise FileNotFoundError(f"{path}: holds a finished run of {done} round(s): "
                                        f"nothing to resume (--rounds more to train on)")
        if not (path / FILENAME).is_file():
            raise FileNotFoundError(f"{path / FILENAME}: no checkpoint to resume from")

    @classmethod
    def load(cls, folder: str | Path) -> Checkpoint:
        """Read ``folder/checkpoint.npz``.

        Raises
        ------
        FileNotFoundError
            With a one-line message when there is none.
        """
        path = Path(folder) / FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no checkpoint to resume from")
        try:
            parts: dict[str, dict[str, np.ndarray]] = {"global": {}, "strategy": {},
                                                        "family": {}}
            meta: dict[str, Any] = {}
            for key, value in load_npz(path).items():  # (each array's size held to the file)
                if key == _META:
                    meta = json.loads(value.tobytes().decode())
                else:
                    kind, _, name = key.partition("/")
                    parts[kind][name] = value
            if not isinstance(meta, dict):
                raise ValueError("its record is not a JSON object")
        except Exception as exc:  # cut short, overwritten, not a checkpoint: numpy's readers
            # raise BadZipFile, EOFError, ValueError, KeyError, SyntaxError (a damaged header)
            raise CheckpointError(
                f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:120] or 'empty'}); "
                f"it is written whole or not at all, so something else changed it: resume "
                f"is not possible from it (start again, or restore it from a copy)") from None
        if not meta:
            raise CheckpointError(f"{path}: holds no checkpoint record: not a checkpoint")
        return cls(meta, parts["global"], parts["strategy"], parts["family"])


class CheckpointWriter:
    """Writes checkpoints on a background thread, then the rounds' events to the metrics log.

    Only the newest pending checkpoint is written (a newer round supersedes an older one), but
    no event is lost: a superseded checkpoint's events go out with the one that replaced it,
    and the events of rounds without a checkpoint wait for the next one, so the log never
    shows a round that a resumed master would run again.

    Parameters
    ----------
    folder : path
        Where ``checkpoint.npz`` goes.
    metrics : MetricsLog
        Where each round's events are appended once a checkpoint covering them is written.
    budget : float, default 1.0
        Largest share of wall time spent writing: :meth:`ready` is False until the time since
        the last write ended is at least its duration × (1 / budget − 1). 1: always ready.

    Attributes
    ----------
    last_write_s : float
        How long the last checkpoint took to write (0 before the first).
    written_base : int or None
        The ``resume_base`` of the newest checkpoint on disk: the round whose worker state a
        master resumed from it builds on (None before the first).
    """

    def __init__(self, folder: str | Path, metrics: MetricsLog, budget: float = 1.0) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {budget}")
        self.path = Path(folder) / FILENAME
        self.metrics = metrics
        self.budget = budget
        self.last_write_s = 0.0
        self.written_base: int | None = None
        self._last_end = float("-inf")
        self._lock = threading.Lock()
        self._pending: tuple[Checkpoint | None, list[dict[str, Any]]] | None = None
        self._held: list[dict[str, Any]] = []  # events of rounds no checkpoint covers yet
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
        self._thread.start()

    def ready(self, now: float | None = None) -> bool:
        """Whether a checkpoint now keeps writing within ``budget`` of the wall time (and
        none is being written)."""
        now = time.monotonic() if now is None else now
        with self._wake:
            if self._busy or self._pending is not None:
                return False
            return now - self._last_end >= self.last_write_s * (1 / self.budget - 1)

    def submit(self, ckpt: Checkpoint | None, events: list[dict[str, Any]],
               hold: bool = False) -> None:
        """Queue ``ckpt`` and the events to log once it is written.

        With ``ckpt=None`` and ``hold``, the events wait for the next checkpoint; without
        ``hold`` (checkpoints off) they are logged at once.
        """
        with self._wake:
            if ckpt is None and hold:
                # Also when an older round's checkpoint is pending: it does not cover these
                # rounds, so its write must not carry their events into the log (a master
                # killed then would run them again, and they would be logged twice).
                self._held += events
                return
            events, self._held = self._held + events, []
            if self._pending is not None:
                ckpt = ckpt or self._pending[0]
                events = self._pending[1] + events
            self._pending = (ckpt, events)
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    if self._held:  # closing without a last checkpoint: log what is left
                        self._pending, self._held = (None, self._held), []
                    else:
                        return
                (ckpt, events), self._pending = self._pending, None
                self._busy = True
            t0 = time.monotonic()
            try:
                if ckpt is not None:
                    # Every event this write covers (held and superseded rounds' too), so that a
                    # master killed before logging them logs them when it resumes.
                    ckpt.meta["events"] = events
                    atomic_write(self.path, ckpt.write_to)
                    if "resume_base" in ckpt.meta:
                        self.written_base = int(ckpt.meta["resume_base"])
            except Exception:  # a full disk must not stop training; the log says so
                log.exception("could not write checkpoint %s", self.path)
            end = time.monotonic()
            for e in events:
                try:
                    self.metrics.write_record(e)
                except Exception:  # one unwritable event must not stop the writer (flush waits)
                    log.exception("could not log event %s", e.get("event"))
            with self._wake:
                if ckpt is not None:
                    self.last_write_s, self._last_end = end - t0, end
                self._busy = False
                self._wake.notify_all()
            ckpt = None  # not kept alive while waiting: the model's memory is recycled

    def flush(self) -> None:
        """Wait until everything submitted is written."""
        with self._wake:
            while self._pending is not None or self._busy:
                self._wake.wait()

    def close(self) -> None:
        """Write what is pending, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()


def capture(family: ServerFamily, job: Mapping[str, Any]) -> Checkpoint:
    """A checkpoint of the job's own state ``job`` (run id, round, version, registrations,
    sampling state, the round's events) and of everything the family holds
    (:meth:`ServerFamily.snapshot`)."""
    meta, arrays = family.snapshot()
    return Checkpoint({**job, **meta}, arrays["global"], arrays["strategy"], arrays["family"])


def restore(ckpt: Checkpoint, family: ServerFamily) -> None:
    """Give ``family`` back what :func:`capture` took of it; raise RuntimeError when the
    checkpoint is of another family or strategy than the configuration's."""
    m = ckpt.meta
    if m.get("family") != family.cfg.family or m.get("strategy") != family.strategy.name:
        raise RuntimeError(f"the checkpoint is of {m.get('family')}/{m.get('strategy')}, the "
                           f"config asks for {family.cfg.family}/{family.strategy.name}")
    family.restore(m, {"global": ckpt.global_arrays, "strategy": ckpt.strategy_arrays,
                       "family": ckpt.family_arrays})
