"""cluster.yaml's ``privacy.secure_aggregation`` section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SecAggParams:
    """Secure aggregation (SecAgg+): the master learns only the sum of the round's updates.

    Parameters
    ----------
    threshold : int, optional
        Shares needed to recover a worker's secrets, and the fewest workers a round may end
        with. Default: a majority of each worker's group (itself and its neighbours), at
        least 2.
    neighbours : int, optional
        How many others each worker is paired with (an even number). Default: all of them
        (the original SecAgg); set it for large clusters (SecAgg+: O(k) work per worker).
    clip : float, default 8.0
        Each coordinate of a worker's change to the model is clipped to [-clip, clip] before
        it is quantized (common/secagg/ring.py states the error bound).
    """

    threshold: int | None = None
    neighbours: int | None = None
    clip: float = 8.0

    def __post_init__(self) -> None:
        if self.threshold is not None and (isinstance(self.threshold, bool)
                                           or not int(self.threshold) == self.threshold
                                           or self.threshold < 2):
            raise ValueError("secure_aggregation.threshold: expected an integer of at least 2")
        if self.neighbours is not None and (isinstance(self.neighbours, bool)
                                            or self.neighbours < 2 or self.neighbours % 2):
            raise ValueError("secure_aggregation.neighbours: expected an even number of at "
                             "least 2")
        if not self.clip > 0:
            raise ValueError("secure_aggregation.clip: expected a number > 0")

    def group_size(self, n_participants: int) -> int:
        """A worker and its neighbours, in a round of ``n_participants``."""
        if self.neighbours is None:
            return n_participants
        return min(n_participants, self.neighbours + 1)

    def threshold_for(self, n_participants: int) -> int:
        """The threshold of a round of ``n_participants``."""
        if self.threshold is not None:
            return int(self.threshold)
        return max(2, self.group_size(n_participants) // 2 + 1)
