"""What a model family implements on the worker's side."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import ClusterConfig
from common.data.reading import DataError
from common.data.shards import LocalData, unlabelled_message
from common.secagg.ring import to_vector


@dataclass
class FitResult:
    """A local update: the new arrays, the examples behind them, and what to log."""

    arrays: dict[str, np.ndarray]
    n_samples: int
    metrics: dict[str, float]


class ClientFamily(ABC):
    """Worker side of a model family: local update, evaluation, local-only baseline.

    Parameters
    ----------
    cfg : ClusterConfig
        The cluster; ``cfg.family_params`` holds this family's hyperparameters.
    data : LocalData
        This worker's documents; they never leave the worker.
    device : str
        Resolved torch device (``"cpu"``, ``"cuda"``, ...).
    seed : int
        This worker's seed.
    """

    name: str = "family"
    #: Uploads are parameters of the shape the master sent, so the cluster's ``compression``
    #: (a delta against them) applies. Families that upload something else set False.
    compressible: bool = True
    #: The family learns from labels (a classifier): a file without them is refused. The
    #: others train on text alone and skip only the scores that need labels.
    needs_labels: bool = False
    #: What the family sends about a worker's documents outside its updates, and so outside
    #: every privacy mechanism (``fedctl check`` says it where one is on; docs/PRIVACY.md).
    sent_in_the_clear: tuple[str, ...] = ()

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        if self.needs_labels and not data.labelled:
            raise DataError(unlabelled_message(data.dataset.path, self.name))
        self.cfg = cfg
        self.data = data
        self.device = device
        self.seed = seed

    @property
    def n_samples(self) -> int:
        return self.data.n_train

    def secure_vector(self, arrays: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray],
                      n_samples: int, n_max: int, clip: float) -> tuple[np.ndarray, float]:
        """This round's upload as secure aggregation sums it, and the share of its values
        the clip changed: by default the change to the model weighted by ``n_samples /
        n_max``, then that weight (:func:`common.secagg.ring.to_vector`); the master half's
        ``secure_result`` reads the sum back."""
        return to_vector(dict(arrays), dict(model), n_samples / n_max, clip)

    def registration_info(self) -> dict[str, Any]:
        """What the master needs for the pre-training exchange (sizes, labels, vocabulary)."""
        return {}

    def setup(self, setup: Mapping[str, Any]) -> None:
        """Take the master's answer to the pre-training exchange (its ``setup_info_``)."""

    @abstractmethod
    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        """Local update from the global payload."""

    @abstractmethod
    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        """Score a global payload on this worker's own test split."""

    def final_scores(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                     ) -> dict[str, float]:
        """Scores of the final model for the closing report: :meth:`evaluate` by default; a
        family adds here what costs too much to compute every round (gensim's coherence)."""
        return self.evaluate(meta, arrays)

    def local_state(self) -> dict[str, Any]:
        """What this worker's training carries from one round to the next (an optimizer's
        moments, its own factors, its position in its mini-batch stream, its generators), as a
        state tree (:mod:`common.state`), taken after :meth:`setup` and after every
        :meth:`fit`. A worker that goes back to an earlier round (a resumed master) or starts
        again (a restart) loads it with :meth:`load_local_state`, so that it trains as if
        nothing had happened. Empty (the default) for a family that keeps nothing."""
        return {}

    def snapshot_due(self, meta: Mapping[str, Any]) -> bool:
        """Whether the state after the round of ``meta`` goes to disk before its update
        leaves (:mod:`worker.snapshots`): by default after every round. A family whose
        state after some rounds is never gone back to (the middle of a step of several
        rounds, which is redone from its start) skips those."""
        return True

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`local_state` returned (after :meth:`setup`)."""

    def privacy_stream(self) -> Any:
        """The part of the local state that must only move forward: a differential-privacy
        noise generator and the steps its accountant counted. None (the default) without one.

        A worker that goes back to an earlier round's state keeps this as it is now: noise
        already drawn for an update that left must never be drawn again for another (two
        releases with the same noise from different global models differ by the clipped
        gradients alone), and every step taken counts, replayed or not."""
        return None

    def resume_privacy_stream(self, stream: Any) -> None:
        """Put back what :meth:`privacy_stream` returned, after an earlier state was loaded."""

    def local_baseline(self) -> dict[str, float] | None:
        """Score of a model trained on this worker's data alone (same budget), if meaningful."""
        return None
