"""Differential privacy for the families trained by gradient: what cluster.yaml's ``privacy:``
section says, and the accountant (docs/PRIVACY.md).

Two guarantees, either or both:

* **record-level DP-SGD** (``dp_sgd``), on each worker: every local step draws a Poisson
  sample of the worker's documents (rate ``q = batch_size / n``), clips each document's
  gradient to ``max_grad_norm`` and adds Gaussian noise of standard deviation
  ``noise_multiplier · max_grad_norm`` to their sum (Opacus). It bounds what anything the
  worker sends, and so the final model, reveals about any one of its documents, also to a
  master that sees every update. Each worker's ε counts the steps it took.
* **client-level DP-FedAvg** (``client_dp``; McMahan et al. 2018): every update's change to the
  global model is clipped to norm ``clip`` (by the worker, and again by the master), the master
  averages them with equal weights and adds Gaussian noise of standard deviation
  ``noise_multiplier · clip`` to their sum. It bounds what the published models reveal about
  any one worker's participation, to everyone but the master, which sees the updates. The
  sampling rate is ``client_fraction``; ε counts the rounds.

Both are accounted by Opacus's Rényi-DP accountant (subsampled Gaussian, Mironov et al. 2019),
reported as (ε, ``delta``); ``target_epsilon`` ends training before a round would spend more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.secagg.params import SecAggParams


@dataclass
class DPSGDParams:
    """Record-level DP-SGD on each worker (``privacy.dp_sgd``).

    Parameters
    ----------
    noise_multiplier : float, default 1.0
        σ: the noise's standard deviation over ``max_grad_norm``.
    max_grad_norm : float, default 1.0
        C: each document's gradient is clipped to this L2 norm.
    """

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0:
            raise ValueError("noise_multiplier: expected a number > 0")
        if not self.max_grad_norm > 0:
            raise ValueError("max_grad_norm: expected a number > 0")


@dataclass
class ClientDPParams:
    """Client-level DP-FedAvg (``privacy.client_dp``).

    Parameters
    ----------
    clip : float, default 1.0
        Each update's change to the global model is clipped to this L2 norm. It should be
        near the changes' usual norm: far below, every update is cut short; far above, the
        noise (proportional to it) drowns them.
    noise_multiplier : float, default 1.0
        σ: the noise on the sum of the clipped changes has standard deviation σ · clip.
    """

    clip: float = 1.0
    noise_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError("clip: expected a number > 0")
        if not self.noise_multiplier >= 0:
            raise ValueError("noise_multiplier: expected a number >= 0")


@dataclass
class PrivacyParams:
    """cluster.yaml's ``privacy:`` section.

    Parameters
    ----------
    dp_sgd : DPSGDParams, optional
    client_dp : ClientDPParams, optional
    delta : float, default 1e-5
        The δ every ε is reported at.
    target_epsilon : float, optional
        Training ends before a round whose ε (either kind) would exceed it.
    secure_aggregation : SecAggParams, optional
        The master learns only the sum of each round's updates (:mod:`common.secagg`).
    """

    dp_sgd: DPSGDParams | None = None
    client_dp: ClientDPParams | None = None
    delta: float = 1e-5
    target_epsilon: float | None = None
    secure_aggregation: SecAggParams | None = None

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ValueError("delta: expected a number in (0, 1)")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError("target_epsilon: expected a number > 0, or null")

    @property
    def any(self) -> bool:
        return self.dp_sgd is not None or self.client_dp is not None


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε after ``steps`` subsampled Gaussian steps (Poisson rate ``sample_rate``), at ``delta``;
    0 before any step, inf without noise."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    # Imported here: reading a cluster.yaml should not load Opacus.
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as _rdp

    orders = list(RDPAccountant.DEFAULT_ALPHAS)  # the Rényi orders Opacus itself tries
    rdp = _rdp.compute_rdp(q=min(sample_rate, 1.0), noise_multiplier=noise_multiplier,
                           steps=steps, orders=orders)
    eps, _ = _rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(eps)


def client_sample_rate(client_fraction: float, n_workers: int) -> float:
    """DP-FedAvg's rate: the share of ``n_workers`` a round samples, k = max(1, round(C·N))
    of N (:meth:`master.rounds.Roster.sample`), which for few workers is well above C (one
    of 3 at C = 0.1)."""
    n = max(n_workers, 1)
    return min(1.0, max(1, round(client_fraction * n)) / n)


def sgd_sample_rate(batch_size: int, n: int) -> float:
    """DP-SGD's Poisson rate: a step takes each of ``n`` documents with probability q."""
    return min(1.0, batch_size / max(n, 1))


def sgd_steps_per_round(batch_size: int, n: int, local_epochs: int) -> int:
    """Local steps in one round: ``local_epochs`` passes of ``1 / q`` steps each."""
    return local_epochs * math.ceil(max(n, 1) / batch_size)


def describe(params: PrivacyParams) -> dict[str, Any]:
    """The section as plain values, for logs and summaries."""
    out: dict[str, Any] = {"delta": params.delta, "target_epsilon": params.target_epsilon}
    if params.dp_sgd is not None:
        out["dp_sgd"] = vars(params.dp_sgd).copy()
    if params.client_dp is not None:
        out["client_dp"] = vars(params.client_dp).copy()
    if params.secure_aggregation is not None:
        out["secure_aggregation"] = vars(params.secure_aggregation).copy()
    return out


def clipped_change(new: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
                   bound: float) -> tuple[dict[str, np.ndarray], float]:
    """The change ``new − base`` (float64), scaled so that its L2 norm over all arrays
    together is at most ``bound``; and its norm before."""
    delta = {n: np.asarray(new[n], dtype=np.float64) - np.asarray(base[n], dtype=np.float64)
             for n in new}
    norm = math.sqrt(sum(float(np.dot(d.ravel(), d.ravel())) for d in delta.values()))
    if norm > bound:
        for d in delta.values():
            d *= bound / norm
    return delta, norm


def clip_update(new: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], bound: float
                ) -> tuple[dict[str, np.ndarray], float]:
    """``new`` moved back towards ``base`` so that its change has L2 norm at most ``bound``
    (:func:`clipped_change`), in ``new``'s dtypes; and the change's norm before."""
    change, norm = clipped_change(new, base, bound)
    return ({n: (np.asarray(base[n], dtype=np.float64) + d).astype(np.asarray(new[n]).dtype)
             for n, d in change.items()}, norm)
