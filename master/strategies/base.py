"""The abstract aggregation strategy every server rule implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.aggregate import nearest_neighbor_mixing


@dataclass
class ClientResult:
    """One client's contribution to a round.

    Attributes
    ----------
    worker_id : str
    arrays : mapping of str to numpy.ndarray
        The client's new parameters (same names and shapes as the global ones).
    n_samples : int
        Training examples behind them (FedAvg's weight).
    """

    worker_id: str
    arrays: Mapping[str, np.ndarray]
    n_samples: int
    #: The strategy's own arrays of the upload (``strategy.*``, e.g. SCAFFOLD's control
    #: variate change), apart from the model's.
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)
    #: For a secure sum (``worker_id`` "secure-sum"): the workers whose inputs it holds, and
    #: those of them that said, in the clear, that they abstained (their inputs are zeros).
    members: tuple[str, ...] = ()
    abstained: tuple[str, ...] = ()


class Strategy(ABC):
    """Turns the global parameters and the clients' results into new global parameters.

    Strategies with server-side state (FedAdam's moments, ...) keep it in attributes ending in
    ``_`` and expose it through :meth:`state` / :meth:`load_state` so the master can checkpoint it.
    """

    name: str = "strategy"
    #: Why the strategy cannot work from the sum of the updates alone
    #: (``privacy.secure_aggregation``, where the master sees nothing else); None: it can.
    secure_aggregation_refusal: str | None = None
    #: Whether :meth:`aggregate` sums the updates over a fixed denominator (DP-FedAvg) rather
    #: than taking their weighted mean: a secure round then hands it the survivors' mean once
    #: per survivor, so that its sum is theirs.
    sums_updates: bool = False

    @abstractmethod
    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        """Return the new global parameters."""

    def few_updates_note(self, n_updates: int) -> str | None:
        """What this strategy cannot do with ``n_updates`` a round (a robust rule that, with
        so few, protects nothing), said at ``fedctl check`` and the master's start; None by
        default."""
        return None

    def client_settings(self) -> dict[str, Any]:
        """What the workers must do for this strategy, sent in every round's ``meta`` (e.g.
        FedProx's ``proximal_mu``); none by default. A family whose workers cannot honour a
        setting is refused at start (``ServerFamily.client_settings``)."""
        return {}

    def client_arrays(self, current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Arrays the workers need besides the model (``strategy.*``, e.g. SCAFFOLD's server
        control variate), sent with every round's payload; none by default."""
        return {}

    def upload_arrays(self, current: Mapping[str, np.ndarray]
                      ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The ``strategy.*`` arrays every update must carry besides the model, by name:
        (shape, dtype); none by default."""
        return {}

    def state(self) -> dict[str, np.ndarray]:
        """Server-side optimizer state, for checkpoints (none by default)."""
        return {}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned."""


def mixed_results(results: Sequence[ClientResult], mixing: bool, num_malicious: int
                  ) -> Sequence[ClientResult]:
    """``results`` with their arrays nearest-neighbour mixed (each the mean of its ``n − f``
    nearest: :func:`common.aggregate.nearest_neighbor_mixing`) when ``mixing``, else as they
    are. The robust rules' option for skewed data."""
    if not mixing or len(results) < 2:
        return results
    mixed = nearest_neighbor_mixing([r.arrays for r in results], num_malicious)
    return [ClientResult(r.worker_id, m, r.n_samples, r.extra)
            for r, m in zip(results, mixed, strict=True)]


def check_mixing(mixing: bool, num_malicious: int) -> None:
    """The one-line errors for a robust rule's ``mixing`` and ``num_malicious_clients``."""
    if not isinstance(mixing, bool):
        raise ValueError(f"mixing must be true or false, got {mixing!r}")
    if not isinstance(num_malicious, int) or isinstance(num_malicious, bool) or num_malicious < 0:
        raise ValueError(f"num_malicious_clients must be an integer >= 0, got {num_malicious!r}")
    if mixing and num_malicious == 0:
        raise ValueError("mixing needs num_malicious_clients >= 1 (the hostile workers to "
                         "tolerate): with 0 every update would be mixed into the plain mean")
