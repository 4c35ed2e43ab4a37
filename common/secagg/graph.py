"""Who is paired with whom in a SecAgg+ round: a k-regular graph over the participants.

With ``k`` at least the number of other participants every pair is joined (the original
SecAgg). Otherwise the participants are put in a random order on a ring and each is joined to
the ``k / 2`` on either side (a Harary graph), so each worker's masks, keys and shares cost
O(k), not O(n).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def neighbours(participants: Sequence[str], k: int | None, rng: random.Random
               ) -> dict[str, list[str]]:
    """Each participant's neighbours (sorted), the graph undirected."""
    people = sorted(participants)
    n = len(people)
    if k is None or k >= n - 1:
        return {p: [q for q in people if q != p] for p in people}
    if k < 2 or k % 2:
        raise ValueError("neighbours must be an even number of at least 2")
    order = people[:]
    rng.shuffle(order)
    out: dict[str, set[str]] = {p: set() for p in people}
    for i, p in enumerate(order):
        for step in range(1, k // 2 + 1):
            q = order[(i + step) % n]
            out[p].add(q)
            out[q].add(p)
    return {p: sorted(out[p]) for p in people}
