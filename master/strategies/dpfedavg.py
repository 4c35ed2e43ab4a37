"""DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018): client-level differential privacy, set by cluster.yaml's ``privacy.client_dp``
rather than by name (:mod:`common.privacy.dp`).

Θ = Θ_t + (Σ_i clip(Θ_i − Θ_t, C) + N(0, σ²C² I)) / m, with equal weights (a worker's
weight would be its sensitivity) and the fixed denominator m = expected participants
(``client_fraction`` × workers), so that one worker more or less moves the sum by at most C.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

import numpy as np

from common.privacy.dp import clipped_change
from master.strategies.base import ClientResult, Strategy


class DPFedAvg(Strategy):
    """Clip each update's change, sum, add Gaussian noise, divide by the expected count.

    Parameters
    ----------
    clip : float
        C, the bound on each update's change (L2, all arrays together).
    noise_multiplier : float
        σ: the noise on the sum has standard deviation σ · C.
    expected_clients : int
        m, the participants a round expects.

    Attributes
    ----------
    clipped_norms_ : list of float
        The last round's change norms before clipping (the master logs how many were clipped).
    """

    name = "dpfedavg"
    #: With secure aggregation the workers send weight 1 and their clipped changes (the master
    #: cannot clip what it does not see; it clips their mean, a no-op for honest workers) and
    #: the master adds the noise to the unmasked sum.
    sums_updates = True

    def __init__(self, clip: float, noise_multiplier: float, expected_clients: int) -> None:
        self.clip = clip
        self.noise_multiplier = noise_multiplier
        self.expected_clients = max(1, expected_clients)
        # Seeded from the operating system, never from the job's seed: noise that anyone could
        # draw again would protect nothing. Its state goes in the checkpoint (exact resume).
        self._rng = np.random.Generator(np.random.PCG64(secrets.randbits(128)))
        self.clipped_norms_: list[float] = []

    def aggregate(self, current: Mapping[str, np.ndarray], results: Sequence[ClientResult]
                  ) -> dict[str, np.ndarray]:
        total = {n: np.zeros(np.shape(a), dtype=np.float64) for n, a in current.items()}
        self.clipped_norms_ = []
        for r in results:  # the master clips too: a worker that did not is no exception
            change, norm = clipped_change(r.arrays, current, self.clip)
            self.clipped_norms_.append(norm)
            for n in total:
                total[n] += change[n]
        sd = self.noise_multiplier * self.clip
        return {n: (np.asarray(current[n], dtype=np.float64)
                    + (total[n] + self._rng.normal(0.0, sd, size=total[n].shape))
                    / self.expected_clients).astype(np.asarray(current[n]).dtype)
                for n in current}

    def state(self) -> dict[str, np.ndarray]:
        # The generator's state as uint64 words (PCG64: state and increment, 128 bits each).
        st = self._rng.bit_generator.state["state"]
        words = [(v >> s) & (2**64 - 1) for v in (st["state"], st["inc"]) for s in (0, 64)]
        return {"rng": np.array(words, dtype=np.uint64)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        if "rng" in state:
            w = [int(x) for x in np.asarray(state["rng"], dtype=np.uint64)]
            bg = np.random.PCG64()
            bg.state = {"bit_generator": "PCG64",
                        "state": {"state": w[0] | (w[1] << 64), "inc": w[2] | (w[3] << 64)},
                        "has_uint32": 0, "uinteger": 0}
            self._rng = np.random.Generator(bg)
