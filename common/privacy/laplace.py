"""The Laplace mechanism with clipping, as iFTM parties apply it to their topic-model counts.

What is perturbed (see :mod:`common.models.lda_mh`): each party's document–topic count matrix
n_dk (tokens of document d on topic k; sentences for SentenceLDA), once, right after the
random initial assignment. Every entry gets one independent draw of Laplace(0, b = 1/ε)
(standard deviation √2 / ε), the draw is kept for the rest of training, and the sampler reads
the privatized count n_dk + η_dk, with anything at or below the threshold τ read as 0. The
word–topic counts that leave the party are computed by a sampler that never read an
unperturbed n_dk. (Count changes of one token move n_dk by 1, the sensitivity the scale 1/ε
is calibrated to.)
"""

from __future__ import annotations

import numpy as np

__all__ = ["laplace_epsilon", "laplace_noise", "privatize"]

#: The families whose parties perturb their counts with :func:`privatize`.
LAPLACE_FAMILIES = ("lda", "sentencelda")


def laplace_epsilon(family: str, params: dict) -> float | None:
    """ε of the Laplace noise a job of ``family`` with model ``params`` applies (on by default
    for the iFTM families, ε 11; 0 or null turns it off); None for none."""
    if family not in LAPLACE_FAMILIES:
        return None
    from common.models.lda_mh import LDAParams

    eps = params.get("epsilon", LDAParams.epsilon)
    return float(eps) if eps else None


def laplace_noise(shape: tuple[int, ...], epsilon: float, rng: np.random.Generator
                  ) -> np.ndarray:
    """Laplace(0, 1/ε) noise of the given shape (float64).

    Parameters
    ----------
    shape : tuple of int
    epsilon : float
        Privacy budget ε > 0; the scale is b = 1/ε (sensitivity 1), the standard deviation
        √2 / ε.
    rng : numpy.random.Generator
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    return rng.laplace(0.0, 1.0 / epsilon, size=shape)


# hand-written: iFTM reuses one noise draw and clips at tau; DP libraries draw afresh per query
def privatize(counts: np.ndarray, epsilon: float | None, tau: float = 0.2,
              rng: np.random.Generator | None = None, noise: np.ndarray | None = None
              ) -> np.ndarray:
    """Counts plus Laplace(1/ε) noise, clipped to 0 at or below ``tau``.

    Parameters
    ----------
    counts : numpy.ndarray
    epsilon : float or None
        None for no noise (clipping only).
    tau : float, default 0.2
        Entries ≤ tau after the noise become 0.
    rng : numpy.random.Generator, optional
        Source of the noise (a fresh default generator if None).
    noise : numpy.ndarray, optional
        A noise draw to reuse (perturbed once, read many times); overrides ``epsilon``.

    Returns
    -------
    numpy.ndarray of float64
    """
    counts = np.asarray(counts, dtype=np.float64)
    if noise is None:
        noise = (laplace_noise(counts.shape, epsilon, rng or np.random.default_rng())
                 if epsilon is not None else 0.0)
    out = counts + noise
    out[out <= tau] = 0.0
    return out
