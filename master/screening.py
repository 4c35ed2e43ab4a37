"""Values that cannot be right: a round's updates screened before they are aggregated, and the
aggregate checked before it is published.

Each check is a bound documented in :mod:`common.constants`:

* an update that holds NaN or Inf, or overflows, is left out of the round; in a round of three
  updates or more, so is one whose distance to the model it was built on is more than
  ``NORM_OUTLIER_FACTOR`` times the round's lower median distance; in a round of fewer (where
  nothing says which one is wrong), one more than that many times the smallest of the last
  ``NORM_GROWTH_WINDOW`` rounds' largest distance aggregated (:class:`DistanceHistory`);
* an aggregate that holds NaN or Inf, a value past ``PUBLISHED_VALUE_LIMIT`` (what a float32
  worker can square), or whose norm grows past ``NORM_GROWTH_LIMIT`` times the model it
  replaces or the smallest of the last ``NORM_GROWTH_WINDOW`` published, or
  ``NORM_JOB_GROWTH_LIMIT`` times the smallest published in the job, or shrinks as far
  under their largest (:class:`GrowthWindow`), is not published: it is undone and redone
  without the update furthest out;
* with ``max_weight_fraction`` set, no worker's share of a weighted average exceeds it.

Robust aggregation (trimmed means, Krum) is a strategy's job; these checks only keep what is
plainly broken or hostile from reaching the published model. Nothing here touches a socket.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from common import constants as C
from common.aggregate import CHUNK
from master.strategies import ClientResult


def _squares(a: np.ndarray, b: np.ndarray | None = None) -> float:
    """Sum of squares of ``a`` (or of ``a - b``) in blocks, without a model-sized temporary.
    Overflow gives inf, which every bound here treats as too large."""
    fa = np.asarray(a).reshape(-1)
    fb = None if b is None else np.asarray(b).reshape(-1)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, fa.size, CHUNK):
            x = fa[lo:lo + CHUNK]
            if x.dtype.kind not in "f":
                x = x.astype(np.float64)
            if fb is not None:
                x = x - fb[lo:lo + CHUNK].astype(x.dtype, copy=False)
            total += float(np.dot(x, x))
    return total if math.isfinite(total) else math.inf


def norm(arrays: Mapping[str, np.ndarray]) -> float:
    """Euclidean norm of all the arrays together (inf for any NaN, Inf or overflow)."""
    return math.sqrt(sum(_squares(a) for a in arrays.values()))


def distance(arrays: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> float:
    """Euclidean distance of an update from the model it was built on; its norm where the
    two do not have the same arrays (a family whose uploads are not parameters)."""
    if set(arrays) != set(base) or any(arrays[n].shape != base[n].shape for n in arrays):
        return norm(arrays)
    return math.sqrt(sum(_squares(arrays[n], base[n]) for n in arrays))


def outliers(distances: Mapping[str, float], factor: float = C.NORM_OUTLIER_FACTOR
             ) -> dict[str, str]:
    """The updates to leave out: worker -> why.

    Compared with the lower median of the round's distances, so a minority of hostile updates
    cannot move the reference; fewer than three updates are only checked for being finite (the
    aggregate check still applies).
    """
    finite = sorted(d for d in distances.values() if math.isfinite(d))
    out = {w: "its values are not finite or overflow" for w, d in distances.items()
           if not math.isfinite(d)}
    if len(distances) < 3 or not finite:
        return out
    reference = finite[(len(finite) - 1) // 2]
    for w, d in distances.items():
        if w not in out and d > factor * reference and d > C.NEGLIGIBLE_DISTANCE:
            out[w] = (f"its distance to the model, {d:.3g}, is over {factor:g} times the "
                      f"round's median {reference:.3g}")
    return out


def largest_value(arrays: Mapping[str, np.ndarray]) -> float:
    """The largest magnitude among the arrays' values (0 for none), without a copy of them
    (a secure sum of 25 M coordinates is 200 MB)."""
    return max((max(float(np.max(a)), -float(np.min(a))) for a in arrays.values()
                if np.asarray(a).size), default=0.0)


#: Most array forms a GrowthWindow keeps a window for (a synchronized step has four).
MAX_WINDOWS = 16


def aggregate_problem(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
                      limit: float = C.NORM_GROWTH_LIMIT) -> str | None:
    """Why an aggregate must not be published, or None if it may. The growth bound applies
    where the aggregate has the arrays of the model it replaces (not to a step's statistics,
    nor to a model that grows by design); the bound on values applies to all."""
    return _aggregate_check(before, after, limit)[0]


def _aggregate_check(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
                     limit: float, bounds: Sequence[tuple[float, float, float, str]] = (),
                     shrink: bool = False) -> tuple[str | None, float]:
    """:func:`aggregate_problem`; with ``shrink``, the aggregate also held to at least the
    model's norm over ``limit``; and to each ``(factor, least, most, what)`` of ``bounds``
    (the smallest and largest norm of earlier models of the same arrays, and what they are):
    at most ``factor`` times ``least`` and at least ``most`` over ``factor``. Returns the
    problem and the aggregate's norm."""
    new = norm(after)
    if not math.isfinite(new):
        return "the aggregate holds NaN or Inf", new
    # No value is past the norm: the values are only looked at when the norm is that large.
    if new > C.PUBLISHED_VALUE_LIMIT and (
            top := largest_value(after)) > C.PUBLISHED_VALUE_LIMIT:
        return (f"the aggregate holds a value of {top:.3g}, past the {C.PUBLISHED_VALUE_LIMIT:g} "
                f"a float32 worker can square"), new
    same = set(before) == set(after) and all(before[n].shape == after[n].shape for n in after)
    old = norm(before) if same else 0.0
    if old > 0 and new > limit * old:
        return (f"the aggregate's norm {new:.3g} is over {limit:g} times the model's "
                f"{old:.3g}"), new
    if shrink and old > 0 and new * limit < old:
        return (f"the aggregate's norm {new:.3g} is under the model's {old:.3g} over "
                f"{limit:g}"), new
    for factor, least, most, what in bounds if same else ():
        if 0 < least < old and new > factor * least:
            return (f"the aggregate's norm {new:.3g} is over {factor:g} times {least:.3g}, "
                    f"the smallest of {what}"), new
        if most > old > 0 and new * factor < most:
            return (f"the aggregate's norm {new:.3g} is under {most:.3g} over {factor:g}, "
                    f"the largest of {what}"), new
    return None, new


Form = tuple[tuple[str, tuple[int, ...]], ...]  # a payload's array names and shapes


class _Floors:
    """Per form of arrays, the last ``rounds`` values recorded and the smallest in the whole
    job (positive and finite ones only): the floors a value of the same form is held to."""

    def __init__(self, rounds: int, what: str) -> None:
        self.rounds, self.what = rounds, what
        self._recent: dict[Form, deque[float]] = {}
        self._least: dict[Form, float] = {}
        self._most: dict[Form, float] = {}

    def bounds(self, form: Form) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        """The smallest and largest of the window's values, and of the job's (None for
        none)."""
        recent = self._recent.get(form)
        if not recent:
            return None, None
        return (min(recent), max(recent)), (self._least[form], self._most[form])

    def add(self, form: Form, value: float) -> None:
        # (a value of 0, a model zeroed, would otherwise switch the floors off)
        if not (math.isfinite(value) and value > 0):
            return
        if form not in self._recent and len(self._recent) >= MAX_WINDOWS:
            self._recent.clear()  # (a family whose forms never repeat keeps no history)
            self._least.clear()
            self._most.clear()
        self._recent.setdefault(form, deque(maxlen=self.rounds)).append(value)
        self._least[form] = min(value, self._least.get(form, value))
        self._most[form] = max(value, self._most.get(form, value))

    def state(self) -> list[list[Any]]:
        """JSON-able: ``[[[name, shape], ...], [value, ...], least, most]`` a form."""
        return [[[[n, list(shape)] for n, shape in form], list(values), self._least[form],
                 self._most[form]] for form, values in self._recent.items()]

    def restore(self, state: Sequence[Any]) -> None:
        """Take back what :meth:`state` gave; ValueError (one line) if it is not that."""
        recent: dict[Form, deque[float]] = {}
        least: dict[Form, float] = {}
        most: dict[Form, float] = {}
        try:
            for arrays, values, smallest, largest in state:
                form = form_of_listed(arrays)
                kept = [float(x) for x in values][-self.rounds:]
                if not kept or not all(math.isfinite(x) and x > 0 for x in
                                       (*kept, float(smallest), float(largest))):
                    raise ValueError("a value is not a finite number > 0")
                recent[form] = deque(kept, maxlen=self.rounds)
                least[form] = min(float(smallest), *kept)
                most[form] = max(float(largest), *kept)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the checkpoint's {self.what} are malformed: {exc}") from None
        self._recent = dict(list(recent.items())[-MAX_WINDOWS:])
        self._least = {form: least[form] for form in self._recent}
        self._most = {form: most[form] for form in self._recent}


class GrowthWindow:
    """The growth bound over rounds: an aggregate is held to ``NORM_GROWTH_LIMIT`` times the
    model it replaces and times the smallest norm of the last ``NORM_GROWTH_WINDOW`` models of
    the same arrays published, and to ``NORM_JOB_GROWTH_LIMIT`` times the smallest published
    in the whole job. Against the last model alone, a member sending it with one value 90 x
    larger each round compounded: by round 10 an honest member's loss on it was past
    float32's range. The window slows such growth to 100 x a window; the job's bound ends it.
    Shrinking is held alike (100 x under the model it replaces, the window's largest, and
    1e4 x under the job's): a member that shrank the model 1e8 x once left every honest
    aggregate after it past the growth bounds, for good. Honest models grew at most 15 x
    over their smallest (combinedtm in 100 rounds) and shrank at most 2.9 x (prodlda_sync in
    1,000). Each form of published arrays has its own record (a synchronized step's phases
    alternate). The records are checkpointed (:meth:`state` / :meth:`restore`): a master
    resumed with them empty let the same member step 100 x at once again."""

    def __init__(self, rounds: int = C.NORM_GROWTH_WINDOW) -> None:
        self._norms = _Floors(rounds, "growth windows")
        self._checked: tuple[Form, float] | None = None

    def problem(self, before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]
                ) -> str | None:
        """:func:`aggregate_problem` with the window's and the job's floors; call
        :meth:`published` once the aggregate checked last is the model."""
        form = form_of(after)
        window, job = self._norms.bounds(form)
        bounds = []
        if window is not None and job is not None:
            bounds = [(C.NORM_GROWTH_LIMIT, *window,
                       f"the last {C.NORM_GROWTH_WINDOW} published models' (NORM_GROWTH_WINDOW)"),
                      (C.NORM_JOB_GROWTH_LIMIT, *job,
                       "those published in this job (NORM_JOB_GROWTH_LIMIT)")]
        problem, new = _aggregate_check(before, after, C.NORM_GROWTH_LIMIT, bounds, shrink=True)
        self._checked = (form, new)
        return problem

    def published(self) -> None:
        if self._checked is not None:
            self._norms.add(*self._checked)
            self._checked = None

    def state(self) -> list[list[Any]]:
        return self._norms.state()

    def restore(self, state: Sequence[Any]) -> None:
        self._norms.restore(state)
        self._checked = None


class DistanceHistory:
    """The reference for a round of fewer than three updates, where the round's own median
    says nothing of which one is wrong: each round's largest distance aggregated, per form of
    upload. An update farther than ``NORM_OUTLIER_FACTOR`` times the smallest of the last
    ``NORM_GROWTH_WINDOW`` rounds' largest, or ``NORM_JOB_GROWTH_LIMIT`` times the job's
    smallest, is left out. Without it, one member of two sent a FedAdam pseudo-gradient, or a
    synchronized step's gradient, of 1e17 (finite, and squared within float64): the server
    optimizer's second moment held it for thousands of rounds, and every later step went
    where that member chose. The smallest of the window, not its largest, so that what a
    member got accepted does not raise its next allowance; the round's largest, so that a
    member sending tiny changes cannot lower it. Honest rounds in every example came within
    5.1 x of the window's floor. Checkpointed (:meth:`state` / :meth:`restore`)."""

    def __init__(self, rounds: int = C.NORM_GROWTH_WINDOW,
                 factor: float = C.NORM_OUTLIER_FACTOR) -> None:
        self.factor = factor
        self._largest = _Floors(rounds, "update distances")

    def outliers(self, distances: Mapping[str, float], forms: Mapping[str, Form]
                 ) -> dict[str, str]:
        """:func:`outliers`, and with fewer than three updates, those past the history's."""
        out = outliers(distances, self.factor)
        if len(distances) >= 3:
            return out
        for w, d in distances.items():
            window, job = self._largest.bounds(forms[w])
            if w in out or window is None or job is None or d <= C.NEGLIGIBLE_DISTANCE:
                continue
            if d > self.factor * window[0]:
                out[w] = (f"its distance to the model, {d:.3g}, is over {self.factor:g} times "
                          f"{window[0]:.3g}, the smallest of the last rounds' largest "
                          f"aggregated, with too few updates this round to compare")
            elif d > C.NORM_JOB_GROWTH_LIMIT * job[0]:
                out[w] = (f"its distance to the model, {d:.3g}, is over "
                          f"{C.NORM_JOB_GROWTH_LIMIT:g} times {job[0]:.3g}, the smallest round's "
                          f"largest aggregated in this job (NORM_JOB_GROWTH_LIMIT)")
        return out

    def aggregated(self, distances: Mapping[str, float], forms: Mapping[str, Form]) -> None:
        """Record the largest finite distance of each form among the updates aggregated, in a
        round of two or more: a member alone in a round (its peers silent, or not drawn)
        could otherwise send a tiny change and get the next rounds' honest ones left out."""
        if len(distances) < 2:
            return
        largest: dict[Form, float] = {}
        for w, d in distances.items():
            if math.isfinite(d):
                largest[forms[w]] = max(d, largest.get(forms[w], 0.0))
        for form, d in largest.items():
            if d > C.NEGLIGIBLE_DISTANCE:
                self._largest.add(form, d)

    def sum_problem(self, form: Form, d: float) -> str | None:
        """Why a secure round's aggregate of this form and size ``d`` (its members hidden in
        the sum: no update of it can be left out) is refused, or None: past the factor times
        the smallest of the last rounds' sums, or NORM_JOB_GROWTH_LIMIT times the job's. One
        member's synchronized step gradient at the clip held FedAdam's moments as an upload
        of 1e17 did in the clear."""
        window, job = self._largest.bounds(_summed(form))
        if window is None or job is None or d <= C.NEGLIGIBLE_DISTANCE:
            return None
        if d > self.factor * window[0]:
            return (f"its size, {d:.3g}, is over {self.factor:g} times {window[0]:.3g}, the "
                    f"smallest of the last rounds' secure sums")
        if d > C.NORM_JOB_GROWTH_LIMIT * job[0]:
            return (f"its size, {d:.3g}, is over {C.NORM_JOB_GROWTH_LIMIT:g} times "
                    f"{job[0]:.3g}, the smallest secure sum in this job (NORM_JOB_GROWTH_LIMIT)")
        return None

    def sum_aggregated(self, form: Form, d: float) -> None:
        """Record a secure round's aggregate, once applied (:meth:`sum_problem`); not one
        whose members sat out (its zeros would lower the floor)."""
        if d > C.NEGLIGIBLE_DISTANCE:
            self._largest.add(_summed(form), d)

    def state(self) -> list[list[Any]]:
        return self._largest.state()

    def restore(self, state: Sequence[Any]) -> None:
        self._largest.restore(state)


def _summed(form: Form) -> Form:
    """A secure sum's form, apart from a plain upload's of the same arrays."""
    return tuple((f"secure-sum:{name}", shape) for name, shape in form)


def form_of(arrays: Mapping[str, Any]) -> Form:
    """The names and shapes of ``arrays``: what a window of norms or distances is kept for."""
    return tuple((n, tuple(int(d) for d in np.shape(arrays[n]))) for n in sorted(arrays))


def form_of_listed(arrays: Any) -> Form:
    """The :data:`Form` a checkpoint listed as ``[[name, shape], ...]``."""
    return tuple((str(n), tuple(int(d) for d in shape)) for n, shape in arrays)


def state_problem(state: Mapping[str, np.ndarray]) -> str | None:
    """Why a strategy's state after aggregating must not be kept (its numbers are not
    finite), or None."""
    floats = {k: v for k, v in state.items() if np.asarray(v).dtype.kind == "f"}
    return None if math.isfinite(norm(floats)) else "the strategy's state holds NaN or Inf"


def cap_weights(results: Sequence[ClientResult], max_fraction: float | None
                ) -> list[ClientResult]:
    """The results with their weights capped so that none holds more than ``max_fraction`` of
    the total (water-filling: capped weights are set so each capped worker holds exactly the
    fraction, the others keep theirs). Unchanged when ``max_fraction`` is None or cannot be met
    (fewer workers than ``1 / max_fraction``: then all weigh the same)."""
    if max_fraction is None or not results:
        return list(results)
    n = len(results)
    if max_fraction * n < 1:
        return [ClientResult(r.worker_id, r.arrays, 1, r.extra) for r in results]
    weights = {r.worker_id: float(r.n_samples) for r in results}
    capped: set[str] = set()
    while True:
        free = sum(w for k, w in weights.items() if k not in capped)
        share = 1 - max_fraction * len(capped)  # what the uncapped workers hold together
        over = [k for k, w in weights.items()
                if k not in capped and free > 0 and w / free * share > max_fraction]
        if not over:
            break
        capped |= set(over)
    if not capped:
        return list(results)
    free = sum(w for k, w in weights.items() if k not in capped)
    share = 1 - max_fraction * len(capped)
    total = free / share if free > 0 else 1.0
    return [ClientResult(r.worker_id, r.arrays,
                         max_fraction * total if r.worker_id in capped else r.n_samples,
                         r.extra)
            for r in results]
