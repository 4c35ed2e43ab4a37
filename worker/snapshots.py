"""A worker's own state after each round it trained, on its own disk (docs/RECOVERY.md).

The master's checkpoint holds the global model; what a worker built in the rounds since (NMF's
document factors, an optimizer's moments, its place in its mini-batch stream) only the worker
holds. A resumed master goes back to its checkpoint's round, and every round it publishes says
which round's worker state it builds on (``base``): a worker whose state is newer goes back to
its snapshot of then and trains as if nothing had happened. A restarted worker loads its newest
snapshot. The master also says which snapshots it can no longer ask for (``keep``), and they are
deleted (up to two kept as spare files, for later snapshots to be written over), so a folder
holds the few rounds since the last checkpoint.

One file a round, ``round-000012.safetensors`` (:mod:`common.state`), written before the round's
update is sent: a worker killed after sending has the state its update came from. It is written
over a spare or the oldest file no longer wanted, in place: a new file's pages cost more to
write than the state itself (1.6 M parameters' Adam moments: 12 ms as a new ``.npz``, 1 ms over
an old file). A family may skip the rounds whose state is never gone back to
(``snapshot_due``: the middle of a synchronous step, which is redone from its start).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from common import state

log = logging.getLogger("fedctl.worker")

_NAME = re.compile(r"^round-(\d{6,})\.safetensors$")
RUN_FILE = "RUN"  # the run the snapshots belong to
#: Unwanted snapshots kept, as hidden spare files, for later ones to be written over: a master
#: whose checkpoint lags frees several rounds at once, then none for a while. At least this
#: many; more when the rounds written since the last release were more (the lag of the
#: master's checkpoint in rounds, 7 to 12 for a 0.1 M model on 2 cores): otherwise most
#: rounds would make a new file, four times the cost of writing over a spare.
SPARES = 2


def find_run_snapshots(root: str | Path, worker_id: str, run_id: str) -> Path | None:
    """The folder of a runs history ``root`` holding ``worker_id``'s snapshots of run
    ``run_id`` (``runs/workers/<id>``, a worker started alone with ``runs/latest``; or
    ``runs/<run>/workers/<id>``, a run ``fedctl run`` started, ``runs/<id>.failed/...`` once it
    failed), the newest if several; None if none does. A worker started with another config
    than the one that wrote them would not look there."""
    root = Path(root)
    places = [root / "workers" / worker_id]
    with contextlib.suppress(OSError):  # (each run's folder, by name: ids may hold * or [)
        places += [d / "workers" / worker_id for d in root.iterdir() if d.is_dir()]
    found = []
    for folder in places:
        with contextlib.suppress(OSError):
            if (folder / RUN_FILE).read_text().strip() == run_id:
                found.append(folder)
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


class Snapshots:
    """The snapshots of one worker in one run, in ``folder``.

    Parameters
    ----------
    folder : path
        This worker's own folder (created when first written).
    worker_id : str
    """

    def __init__(self, folder: str | Path, worker_id: str) -> None:
        self.folder = Path(folder)
        self.worker_id = worker_id
        # What the folder holds, read once: only this worker's process writes it, and a round
        # of millisecond models would otherwise list it four times (a tenth of the snapshot).
        self._rounds: list[int] | None = None
        self._spare_files: list[Path] | None = None
        self._saved_since_release = 0  # rounds written since prune last freed some

    def _path(self, round_: int) -> Path:
        return self.folder / f"round-{round_:06d}.safetensors"

    def _scan(self) -> None:
        names = os.listdir(self.folder) if self.folder.is_dir() else []
        self._rounds = sorted(int(m.group(1)) for m in map(_NAME.match, names) if m)
        self._spare_files = sorted(self.folder / n for n in names if n.startswith(".spare-"))

    def _forget(self) -> None:
        """Read the folder again at the next question (after a change made outside the index)."""
        self._rounds = self._spare_files = None

    def rounds(self) -> list[int]:
        """The rounds there is a snapshot after, oldest first."""
        if self._rounds is None:
            self._scan()
        assert self._rounds is not None
        return list(self._rounds)

    def holds(self, run_id: str) -> bool:
        """Whether the folder's snapshots are of run ``run_id``."""
        marker = self.folder / RUN_FILE
        return marker.is_file() and marker.read_text().strip() == run_id

    def adopt(self, run_id: str) -> bool:
        """Keep the snapshots if they are of run ``run_id``, else delete them (an earlier
        job's state must not leak into this one). True when there are some to use."""
        self._forget()  # what is on disk now, whatever happened since the index was read
        marker = self.folder / RUN_FILE
        known = marker.read_text().strip() if marker.is_file() else None
        if self.folder.is_dir():
            # A write cut short by a kill leaves its temp file; earlier versions wrote .npz.
            for old in (*self.folder.glob(".round-*.tmp"), *self.folder.glob("round-*.npz"),
                        *self._spares()):
                old.unlink(missing_ok=True)
        self._forget()
        if known != run_id:
            for r in self.rounds():
                self._path(r).unlink(missing_ok=True)
            self._forget()
            self.folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(run_id + "\n")
        return bool(self.rounds())

    def save(self, round_: int, tree: Any, keep: int | None = None) -> None:
        """The state after round ``round_`` (0: after the pre-training exchange); with ``keep``,
        :meth:`prune` as well. Written over a spare file, or the oldest one it would delete."""
        stale = [] if keep is None else [r for r in self._stale(keep) if r != round_]
        spares = self._spares()
        reuse = spares[0] if spares else self._path(stale[0]) if stale else None
        try:
            state.save(self._path(round_), tree, {"worker_id": self.worker_id, "round": round_},
                       reuse=reuse)
            assert self._rounds is not None and self._spare_files is not None
            if spares:  # the file taken over is the new round's now
                self._spare_files.remove(spares[0])
            elif stale:
                self._rounds.remove(stale[0])
            if round_ not in self._rounds:
                self._rounds = sorted([*self._rounds, round_])
            self._saved_since_release += 1
            if keep is not None:
                self.prune(keep)
        except BaseException:
            self._forget()  # the file taken over may be gone, a prune cut short: read again
            raise

    def _spares(self) -> list[Path]:
        if self._spare_files is None:
            self._scan()
        assert self._spare_files is not None
        return list(self._spare_files)

    def load(self, round_: int) -> Any:
        header, tree = state.load(self._path(round_))
        if header.get("worker_id") != self.worker_id or header.get("round") != round_:
            raise ValueError(f"{self._path(round_)}: a snapshot of {header.get('worker_id')} "
                             f"after round {header.get('round')}, not of {self.worker_id}")
        return tree

    def back_to(self, base: int) -> tuple[int, Any] | None:
        """The newest snapshot at or before round ``base``, as ``(round, state)``; the newer
        ones, of a future that will not happen, are deleted. None when there is none."""
        older = [r for r in self.rounds() if r <= base]
        if not older:
            return None
        for r in self.rounds():
            if r > older[-1]:
                self._path(r).unlink(missing_ok=True)
        self._rounds = older
        return older[-1], self.load(older[-1])

    def _stale(self, keep: int) -> list[int]:
        """What no resumed master can ask for: the rounds before the newest at or before
        ``keep``, oldest first."""
        return [r for r in self.rounds() if r <= keep][:-1]

    def prune(self, keep: int) -> None:
        """Delete what no resumed master can ask for: everything older than the newest
        snapshot at or before round ``keep``. As many as the rounds written since the last
        release (at least :data:`SPARES`) are kept as spares, for the rounds until the next
        one: the folder never holds more files than it already did."""
        stale = self._stale(keep)
        if not stale:
            return
        spares = self._spares()
        wanted = max(SPARES, self._saved_since_release)
        self._saved_since_release = 0
        for r in stale:
            with contextlib.suppress(FileNotFoundError):
                if len(spares) < wanted:
                    spare = self.folder / f".spare-{r:06d}"
                    self._path(r).rename(spare)
                    spares.append(spare)
                else:
                    self._path(r).unlink()
        for extra in sorted(spares)[wanted:]:  # more than the rounds until the next release
            extra.unlink(missing_ok=True)
            spares.remove(extra)
        self._rounds = [r for r in self.rounds() if r not in stale]
        self._spare_files = sorted(spares)
