"""The MLP document classifier, worker side: embed the local documents, train, score."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.config import ClusterConfig, build_params
from common.constants import SCAFFOLD_CHANGE as CHANGE
from common.constants import SCAFFOLD_CONTROL as CONTROL
from common.data.shards import LocalData, sentence_features
from common.models.mlp import MLPClassifier
from common.models.mlp_params import MLPParams
from common.privacy.dp import epsilon, sgd_sample_rate, sgd_steps_per_round
from worker.families.base import ClientFamily, FitResult


class MLPClient(ClientFamily):
    """Worker side of ``model: {family: mlp}``."""

    name = "mlp"
    needs_labels = True

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        super().__init__(cfg, data, device, seed)
        self.params = build_params(MLPParams, cfg.family_params, f"{cfg.source}: model")
        X = sentence_features(cfg, data.dataset, device=device, progress=True)
        self.x_train, self.x_test = X[data.train_index], X[data.test_index]
        self.model: MLPClassifier | None = None
        self.control_: dict[str, np.ndarray] = {}  # SCAFFOLD's c_i, kept across rounds
        self.classes: list[str] = list(data.classes)
        self._remap(self.classes)
        # torch and scikit-learn pay a one-off cost on their first call (about a second on a
        # CPU); pay it now, before joining, so it does not count as round 1's training time.
        warm = self.params.classifier(self.x_train.shape[1], 2, device=device)
        warm.fit(self.x_train[:8], np.arange(8) % 2, epochs=1)
        warm.score(self.x_test[:8], np.arange(min(8, len(self.x_test))) % 2)

    def _remap(self, classes: list[str]) -> None:
        missing = set(self.data.classes) - set(classes)
        if missing:
            raise ValueError(f"the model does not know the classes {sorted(missing)}")
        to_global = np.array([classes.index(c) for c in self.data.classes], dtype=np.int64)
        self.y_train, self.y_test = to_global[self.data.y_train], to_global[self.data.y_test]
        self.classes = classes

    def registration_info(self) -> dict[str, Any]:
        return {"input_dim": int(self.x_train.shape[1]), "classes": list(self.data.classes)}

    def setup(self, setup: Mapping[str, Any]) -> None:
        self._remap(list(setup["classes"]))
        self.model = self.params.classifier(int(setup["input_dim"]), len(self.classes),
                                            device=self.device, random_state=self.seed,
                                            dp=self.cfg.privacy.dp_sgd)

    def local_state(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        return {**self.model.local_state(), "control": self.control_}

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        if self.model is not None and state:
            self.model.load_local_state(state)
            self.control_ = dict(state.get("control") or {})

    def privacy_stream(self) -> Any:
        return None if self.model is None else self.model.privacy_stream()

    def resume_privacy_stream(self, stream: Any) -> None:
        if self.model is not None and stream is not None:
            self.model.resume_privacy_stream(stream)

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        assert self.model is not None, "setup() first"
        after = self._epsilon_after(1)  # once this round is trained (None without DP-SGD)
        target = self.cfg.privacy.target_epsilon
        if target is not None and after is not None and after > target:
            # The master ends training before this; a worker does not rely on it.
            raise RuntimeError(f"privacy budget: round {round_} would take this worker's ε to "
                               f"{after:.3g}, past target_epsilon {target:g}; it leaves the job "
                               f"rather than train it")
        self.model.set_arrays(arrays)
        control = meta.get("strategy_arrays")  # SCAFFOLD's server control variate c
        names = [n for n, _ in self.model.model_.named_parameters()]
        if control is not None:
            c = {n: np.asarray(control[CONTROL + n], dtype=np.float32) for n in names}
            mine = self.control_ or {n: np.zeros_like(c[n]) for n in names}
        t0 = time.perf_counter()
        self.model.fit(self.x_train, self.y_train,
                       proximal_mu=float(meta.get("proximal_mu", 0.0)),  # FedProx
                       correction=None if control is None else [c[n] - mine[n] for n in names])
        train_time = time.perf_counter() - t0
        # Views, not copies (100 MB at 25 M parameters): the update is sent, and acknowledged,
        # before the model is loaded or trained again.
        out = self.model.get_arrays(copy=False)
        if control is not None:
            # SCAFFOLD option II: c_i+ = c_i - c + (x - y) / (K lr); the change travels.
            k_lr = max(self.model.last_steps_, 1) * self.model.lr
            new = {n: (mine[n] - c[n] + (np.asarray(arrays[n], np.float32) - out[n]) / k_lr)
                   .astype(np.float32) for n in names}
            out = {**out, **{CHANGE + n: new[n] - mine[n] for n in names}}
            self.control_ = new
        # A round takes exactly sgd_steps_per_round steps, so ε now is `after`; the accountant
        # (some 30 ms a call) runs once more, for the round after (the master's stop rule).
        privacy = ({} if after is None else
                   {"epsilon": after, "epsilon_next": self._epsilon_after(1)})
        return FitResult(out, len(self.y_train),
                         {"train_loss": self.model.last_loss_, "train_time": train_time,
                          **privacy})

    def _epsilon_after(self, rounds: int) -> float | None:
        """With DP-SGD, this worker's own accountant: its ε once it has trained ``rounds``
        more rounds. None without DP-SGD."""
        dp = self.cfg.privacy.dp_sgd
        if dp is None or self.model is None:
            return None
        n, b = len(self.y_train), self.params.batch_size
        steps = self.model.dp_steps_ + rounds * sgd_steps_per_round(b, n, self.params.local_epochs)
        return epsilon(dp.noise_multiplier, sgd_sample_rate(b, n), steps, self.cfg.privacy.delta)

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        assert self.model is not None, "setup() first"
        self.model.set_arrays(arrays)
        return self.model.score(self.x_test, self.y_test)

    def local_baseline(self) -> dict[str, float]:
        """Same network and epochs (rounds x local epochs), this worker's data alone."""
        model = self.params.classifier(self.x_train.shape[1], len(self.classes),
                                       device=self.device, random_state=self.seed)
        model.fit(self.x_train, self.y_train, epochs=self.cfg.rounds * self.params.local_epochs)
        return model.score(self.x_test, self.y_test)
