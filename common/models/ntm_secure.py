"""The neural topic models' synchronous steps as sums, so that secure aggregation can carry them.

Under ``privacy.secure_aggregation`` the master learns only the sum of what its workers send
(:mod:`common.secagg`). A synchronous step needs more than a weighted mean of weights, but
everything it needs from the workers is a sum all the same; each worker sends these terms, in
one vector per cluster round, and the master reads its phase's upload back from their sum:

==========================  =============================  ===================================
round                       each worker's terms            the master reads back
==========================  =============================  ===================================
phase 0, 1 (moments)        ``n``, ``sum x``, ``sum x^2``  mean ``S/n``, M2 ``S2 - n mean^2``
phase 2, 3 (backward sums)  ``sum_g``, ``sum_gy``          the same sums
phase 4 (gradients)         its share of the gradient      their sum: the step's gradient
step, per-node batch norm   ``n * gradient``, and per      the batch-size weighted mean
(``sync_batch_norm: no``)   batch norm ``n_b``, ``n_b *    gradient; each batch norm's running
                            mean``, ``n_b * (var +         statistics moved by the union's
                            mean^2)`` of its batch         moments (as ``merge_running_stats``)
==========================  =============================  ===================================

A worker that holds no state of the step (it restarted mid-step) sends zeros and says so in
the clear (its update's ``abstain`` metric), so that the master knows who, redoes the step as in
plain rounds, and excludes a member that keeps abstaining; an abstention counted inside the sum
could not be traced to anyone.

These sums feed Adam, which divides a gradient by its own size, and batch norm, which divides
by a standard deviation: a 32-bit ring's error (1e-9 of the clip) would move the model where
the plain run does not. They travel in the 64-bit ring (:data:`RING_BITS`), whose error is
float64's: at most ``(n + 2) 2^-53`` of the clipping range a worker for n workers
(:data:`CLIPS`, per phase, wide enough for this family's values; a value beyond it is clipped
and the worker warns).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch.nn as nn

from common.models.ntm_sync_bn import ABSTAIN, moved_running_stats

if TYPE_CHECKING:
    from common.models.ntm import NeuralTopicModel

__all__ = ["RING_BITS", "CLIPS", "STEP", "layout", "vector_size", "worker_vector",
           "read_sum"]

#: The ring of the synchronous steps' secure sums (module docstring).
RING_BITS = 64
#: A whole step without synchronized batch norm (the phases are 0 to 4).
STEP = -1
#: Each phase's clipping range: row sums of activations and of their squares (phases 0 and 1)
#: reach thousands; the backward sums and gradients stay far below 2^12 for these models.
#: The sum's error is at most ``n * clip * (n + 2) * 2^-53`` for n workers
#: (:func:`common.secagg.ring.error_bound`: 6.8e-12 at phase 4 with 3 workers).
CLIPS = {0: 2.0**24, 1: 2.0**24, 2: 2.0**12, 3: 2.0**12, 4: 2.0**12, STEP: 2.0**24}


def _batch_norms(model: NeuralTopicModel) -> list[tuple[str, nn.BatchNorm1d]]:
    """The batch-norm layers that keep running statistics, by name."""
    return [(prefix, m) for prefix, m in model.net_.named_modules()
            if isinstance(m, nn.BatchNorm1d) and m.running_mean is not None]


def layout(model: NeuralTopicModel, phase: int, batch_stats: bool = True
           ) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a worker's terms in ``phase`` (:data:`STEP` for a step without
    synchronized batch norm, whose batch norms are merged only with ``batch_stats``)."""
    k2, v = 2 * model.n_topics, model.vocab_size_
    out: dict[str, tuple[int, ...]]
    if phase in (0, 1):
        width = k2 if phase == 0 else v
        out = {"n": (1,), "sum": (width,), "sumsq": (width,)}
    elif phase in (2, 3):
        width = v if phase == 2 else k2
        out = {"sum_g": (width,), "sum_gy": (width,)}
    elif phase in (4, STEP):
        params = dict(model.net_.named_parameters())
        out = {n: tuple(params[n].shape) for n in model.param_names()}
        if phase == STEP:
            out["n"] = (1,)
            for prefix, bn in _batch_norms(model) if batch_stats else []:
                width = bn.num_features
                out.update({f"{prefix}.n": (1,), f"{prefix}.sum": (width,),
                            f"{prefix}.sumsq": (width,)})
    else:
        raise ValueError(f"phase {phase}: a step has phases 0 to 4 (or is one, {STEP})")
    return out


def vector_size(model: NeuralTopicModel, phase: int, batch_stats: bool = True) -> int:
    """Length of a worker's vector in ``phase``."""
    return _size(layout(model, phase, batch_stats))


def _size(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(s)) for s in shapes.values())


def _flatten(terms: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
             ) -> np.ndarray:
    out = np.empty(_size(shapes), dtype=np.float64)
    at = 0
    for name in sorted(shapes):
        t = np.asarray(terms[name], dtype=np.float64).reshape(-1)
        if t.size != int(np.prod(shapes[name])):
            raise ValueError(f"{name}: {t.size} values, expected shape {shapes[name]}")
        out[at:at + t.size] = t
        at += t.size
    return out


def worker_vector(model: NeuralTopicModel, phase: int, upload: Mapping[str, np.ndarray],
                  n_local: int, base: Mapping[str, np.ndarray], n_union: float = 0.0,
                  batch_stats: bool = True) -> np.ndarray:
    """A worker's terms for ``phase`` from its plain upload of that phase, flattened in name
    order (float64, before the ring's quantization).

    Parameters
    ----------
    model : NeuralTopicModel
        Any model of the run's shapes (the worker's own); for :data:`STEP`, its batch norms'
        momentum.
    upload : mapping
        What the worker would upload in a plain round (``ABSTAIN`` among them: it abstains).
    n_local : int
        Its batch's rows.
    base : mapping
        The weights the step started from (for :data:`STEP`: the running statistics its batch
        moved them from).
    n_union : float
        The union batch's rows, as phase 1 published them (phase 4 only).
    """
    shapes = layout(model, phase, batch_stats)
    if ABSTAIN in upload:  # nothing to add (the abstention itself travels in the clear)
        return np.zeros(_size(shapes))
    n = float(n_local)
    terms: dict[str, np.ndarray] = {}
    if phase in (0, 1):
        mean = np.asarray(upload["mean"], np.float64)
        terms.update({"n": np.array([n]), "sum": n * mean,
                      "sumsq": np.asarray(upload["m2"], np.float64) + n * mean**2})
    elif phase in (2, 3):
        terms.update({k: upload[k] for k in ("sum_g", "sum_gy")})
    elif phase == 4:
        # The plain upload is scaled for a batch-size weighted mean; its share of the sum is:
        share = n / n_union
        terms.update({k: np.asarray(upload[k], np.float64) * share
                      for k in model.param_names()})
    else:
        terms.update({k: np.asarray(upload[k], np.float64) * n for k in model.param_names()})
        terms["n"] = np.array([n])
        for prefix, bn in _batch_norms(model) if batch_stats else []:
            width = bn.num_features
            if n < 2:  # no batch norm step moved the statistics (merge_running_stats skips it)
                terms.update({f"{prefix}.n": np.zeros(1), f"{prefix}.sum": np.zeros(width),
                              f"{prefix}.sumsq": np.zeros(width)})
                continue
            mean, var = _batch_moments(bn, upload, base, prefix, n)
            terms.update({f"{prefix}.n": np.array([n]), f"{prefix}.sum": n * mean,
                          f"{prefix}.sumsq": n * (var + mean**2)})
    return _flatten(terms, shapes)


def _batch_moments(bn: nn.BatchNorm1d, upload: Mapping[str, np.ndarray],
                   base: Mapping[str, np.ndarray], prefix: str, n: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A batch's mean and biased variance, from the running statistics it moved (the same
    recovery as :meth:`NeuralTopicModel.merge_running_stats`)."""
    m = bn.momentum
    rm0 = np.asarray(base[f"{prefix}.running_mean"], np.float64)
    rv0 = np.asarray(base[f"{prefix}.running_var"], np.float64)
    rm = np.asarray(upload[f"{prefix}.running_mean"], np.float64)
    rv = np.asarray(upload[f"{prefix}.running_var"], np.float64)
    return (rm - (1 - m) * rm0) / m, (rv - (1 - m) * rv0) / m * ((n - 1) / n)


def read_sum(model: NeuralTopicModel, phase: int, total: np.ndarray,
             batch_stats: bool = True) -> dict[str, np.ndarray]:
    """What the master takes from the workers' summed terms: the upload of ``phase`` as one
    worker holding the whole union batch would send it (phases 0 to 4: for
    :class:`~common.models.ntm_sync_bn.SyncBNReducer`), or, for :data:`STEP`, the step's
    update (gradients and running statistics, for ``apply_gradients``)."""
    shapes = layout(model, phase, batch_stats)
    total = np.asarray(total, np.float64).reshape(-1)
    if total.size != _size(shapes):
        raise ValueError(f"a secure sum of {total.size} values for a layout of "
                         f"{_size(shapes)}")
    sums, at = {}, 0
    for name in sorted(shapes):
        size = int(np.prod(shapes[name]))
        sums[name] = total[at:at + size].reshape(shapes[name])
        at += size
    dtype = np.dtype(model.dtype)
    if phase in (0, 1):
        n = max(float(sums["n"][0]), 1.0)  # 0 only when every member abstained
        mean = sums["sum"] / n
        # Rounding may leave a constant feature's M2 a hair below zero.
        return {"mean": mean, "m2": np.maximum(sums["sumsq"] - n * mean**2, 0.0)}
    if phase in (2, 3):
        return {k: sums[k] for k in ("sum_g", "sum_gy")}
    if phase == 4:
        return {k: sums[k].astype(dtype) for k in model.param_names()}
    n = max(float(sums["n"][0]), 1.0)
    out = {k: (sums[k] / n).astype(dtype) for k in model.param_names()}
    for prefix, bn in _batch_norms(model):
        nb = float(sums[f"{prefix}.n"][0]) if batch_stats else 0.0
        if nb < 2:  # nothing moved them: they stay as they are
            out[f"{prefix}.running_mean"] = bn.running_mean.detach().cpu().numpy().copy()
            out[f"{prefix}.running_var"] = bn.running_var.detach().cpu().numpy().copy()
            continue
        mean = sums[f"{prefix}.sum"] / nb
        var = np.maximum(sums[f"{prefix}.sumsq"] / nb - mean**2, 0.0)
        out[f"{prefix}.running_mean"], out[f"{prefix}.running_var"] = moved_running_stats(
            bn, mean, var, nb)
    return out
