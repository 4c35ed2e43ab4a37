"""The master's privacy ledger: what each round spent, and when training must end
(cluster.yaml's ``privacy:``; :mod:`common.privacy.dp`).

Record-level ε is each worker's own: its accountant counts the DP-SGD steps it took and
reports ε, and ε after one round more, with every update; the ledger keeps the largest.
Client-level ε is the master's: DP-FedAvg's subsampled Gaussian, one step per aggregated round
at the rate a worker is drawn, k = max(1, round(C·N)) of the N registered workers
(:func:`common.privacy.dp.client_sample_rate`): at C = 0.1 and 3 workers that is 1/3, not 0.1.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from common.privacy.dp import (
    PrivacyParams,
    client_sample_rate,
    describe,
    epsilon,
    sgd_sample_rate,
    sgd_steps_per_round,
)

log = logging.getLogger("fedctl.master")


def batching(family: Any) -> tuple[int, int]:
    """The family's batch size and local epochs (1 where it has none): with a worker's
    documents, what its DP-SGD accountant's ε follows from."""
    params = getattr(family, "params", None)
    return getattr(params, "batch_size", 1), getattr(params, "local_epochs", 1)


class PrivacyLedger:
    """ε so far, per kind, and the rule that ends training at ``target_epsilon``.

    Parameters
    ----------
    params : PrivacyParams
    client_fraction : float
        C, the fraction of the registered workers a round samples.
    """

    def __init__(self, params: PrivacyParams, client_fraction: float) -> None:
        self.params = params
        self.client_fraction = client_fraction
        # the highest rate a round has drawn workers at: with fewer workers registered than
        # the job names, each one's chance is higher (kept: ε is what the worst round allows)
        self.client_rate_: float | None = None
        self.record_: dict[str, float] = {}  # worker -> ε after its last reported round
        self.record_next_: dict[str, float] = {}  # worker -> ε after one round more
        self.stopped_: str | None = None
        # worker -> (documents, batch size, local epochs), from the job's start: the most a
        # worker's own accountant can honestly report (see record)
        self._sizes: dict[str, tuple[int, int, int]] = {}
        # rounds -> client-level ε: each round's stop rule asks for the next round's, which
        # that round's event then reports (the accountant takes some 30 ms a call)
        self._client: dict[int, float] = {}

    def note_workers(self, n_workers: int) -> None:
        """The rounds to come draw from ``n_workers`` registered workers."""
        self.note_rate(client_sample_rate(self.client_fraction, n_workers))

    def note_rate(self, rate: float) -> None:
        """A round drew workers at ``rate`` (or a checkpoint says one did): the highest is
        the one counted."""
        if self.client_rate_ is None or rate > self.client_rate_:
            self.client_rate_ = rate
            self._client.clear()

    def client_epsilon(self, rounds: int) -> float | None:
        """Client-level ε after ``rounds`` aggregated rounds (None without ``client_dp``), at
        the highest rate a round has drawn workers at (:meth:`note_workers`)."""
        dp = self.params.client_dp
        if dp is None:
            return None
        if rounds not in self._client:
            rate = self.client_rate_ if self.client_rate_ is not None else self.client_fraction
            self._client[rounds] = epsilon(dp.noise_multiplier, rate, rounds, self.params.delta)
        return self._client[rounds]

    def first_round_refusal(self, n_samples: Mapping[str, int], batch_size: int,
                            local_epochs: int) -> str | None:
        """Why the job must not start: its first round would already pass ``target_epsilon``
        (for the worker with the fewest documents, or at the client level). None if not."""
        self._sizes = {w: (n, batch_size, local_epochs) for w, n in n_samples.items()}
        self.note_workers(len(n_samples))
        target = self.params.target_epsilon
        if target is None:
            return None
        dp, first = self.params.dp_sgd, []
        if dp is not None:
            for wid, n in n_samples.items():
                e = epsilon(dp.noise_multiplier, sgd_sample_rate(batch_size, n),
                            sgd_steps_per_round(batch_size, n, local_epochs), self.params.delta)
                first.append((e, f"{wid}'s record-level ε ({n} documents)"))
        client = self.client_epsilon(1)
        if client is not None:
            first.append((client, "the client-level ε"))
        over = [x for x in first if x[0] > target]
        if not over:
            return None
        e, what = max(over)
        return (f"privacy: the first round would take {what} to {e:.3g}, past target_epsilon "
                f"{target:g}: raise the noise_multiplier, or lower the batch size or the local "
                f"epochs")

    def record(self, metrics: Mapping[str, Mapping[str, Any]], version: int,
               sizes: Mapping[str, tuple[int, int, int]] | None = None) -> dict[str, Any]:
        """Take a round's worker metrics; the fields its ``round`` event carries. ``sizes``
        (worker -> documents, batch size, local epochs) bounds the claims of workers the job
        did not start with: one that joined late, or every one after a resume, was believed
        whatever it claimed, and one claim ended the job for all."""
        for wid, size in (sizes or {}).items():
            self._sizes.setdefault(wid, size)
        for wid, m in metrics.items():
            if "epsilon" in m:
                # what the run's privacy statement reports: bounded as the claim that stops
                self.record_[wid] = self._believable(wid, float(m["epsilon"]), version)
                self.record_next_[wid] = self._believable(
                    wid, float(m.get("epsilon_next", m["epsilon"])), version + 1)
        out: dict[str, Any] = {}
        if self.params.dp_sgd is not None and self.record_:
            out["epsilon"] = max(self.record_.values())
        if self.params.client_dp is not None:
            out["client_epsilon"] = self.client_epsilon(version)
        return out

    def _believable(self, worker_id: str, claimed: float, rounds: int) -> float:
        """A worker's claimed ε after ``rounds`` rounds, at most what its registered documents
        allow if it trained in every one: a larger claim (which would end the job for
        everyone) cannot be honest. Checked only where the claim would stop training: the
        accountant takes some 30 ms a call."""
        dp, target = self.params.dp_sgd, self.params.target_epsilon
        if dp is None or target is None or claimed <= target or worker_id not in self._sizes:
            return claimed
        n, batch, epochs = self._sizes[worker_id]
        most = epsilon(dp.noise_multiplier, sgd_sample_rate(batch, n),
                       rounds * sgd_steps_per_round(batch, n, epochs), self.params.delta)
        if claimed > most * (1 + 1e-9):
            log.warning("privacy: %s claims ε %.3g after %d round(s), more than its %d "
                        "documents allow (%.3g): taken as %.3g", worker_id, claimed, rounds, n,
                        most, most)
            return most
        return claimed

    def must_stop(self, version: int) -> bool:
        """True when the next round would take an ε past ``target_epsilon``: training ends
        now, and the reason is logged and kept for the summary."""
        target = self.params.target_epsilon
        if target is None or self.stopped_ is not None:
            return self.stopped_ is not None
        ahead = []
        if self.params.dp_sgd is not None and self.record_next_:
            wid = max(self.record_next_, key=self.record_next_.__getitem__)
            ahead.append((self.record_next_[wid], f"{wid}'s record-level ε"))
        client = self.client_epsilon(version + 1)
        if client is not None:
            ahead.append((client, "the client-level ε"))
        over = [(e, what) for e, what in ahead if e > target]
        if not over:
            return False
        e, what = max(over)
        self.stopped_ = (f"privacy budget: one more round would take {what} to {e:.3g}, past "
                         f"target_epsilon {target:g} (δ {self.params.delta:g}); training "
                         f"ends after {version} round(s)")
        log.warning("%s", self.stopped_)
        return True

    def summary(self, version: int) -> dict[str, Any]:
        """What summary.json says of privacy."""
        out = describe(self.params)
        if self.params.dp_sgd is not None:
            out["epsilon_by_worker"] = dict(sorted(self.record_.items()))
            out["epsilon"] = max(self.record_.values(), default=0.0)
        if self.params.client_dp is not None:
            out["client_epsilon"] = self.client_epsilon(version)
        if self.stopped_ is not None:
            out["stopped"] = self.stopped_
        return out
