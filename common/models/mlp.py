"""The MLP document classifier: two layers over sentence-embedding features.

Used three ways with the same code: by each worker for its local update, by each worker for its
local-only baseline, and centrally on pooled data for the centralized baseline.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from common.eval.classification import classification_metrics
from common.models.mlp_params import OPTIMIZERS, MLPParams  # noqa: F401  (its old home)
from common.models.optimizers import fused_kwargs
from common.models.proximal import anchor_of, proximal_term
from common.privacy.dp import DPSGDParams, sgd_sample_rate
from common.state import generator_state, set_generator_state


# hand-written: a torch loop, not sklearn's MLP: named weights travel, Adam state persists
class MLPClassifier:
    """Two-layer perceptron (Linear-ReLU-Linear) trained with cross-entropy.

    Binary one-vs-rest is the two-class case; the same network serves any number of classes.

    Parameters
    ----------
    input_dim : int
        Feature size (384 for all-MiniLM-L6-v2).
    n_classes : int
        Number of classes (2 for one-vs-rest).
    hidden : int, default 256
    epochs : int, default 1
        Passes over the data per call to :meth:`fit` (the local epochs of one round).
    batch_size : int, default 64
    optimizer : {"adam", "adamw", "sgd"}, default "adam"
    lr : float, default 1e-3
    weight_decay : float, default 0.0
    device : str, default "cpu"
    random_state : int, default 0
        Seeds the initial weights and the batch order.
    dp : DPSGDParams, optional
        Train by record-level DP-SGD (Opacus): each step a Poisson sample of the documents at
        rate ``batch_size / n``, each document's gradient clipped to ``dp.max_grad_norm``,
        Gaussian noise of ``dp.noise_multiplier · dp.max_grad_norm`` on their sum. The
        sampling and the noise draw from a generator seeded from the operating system, not
        from ``random_state``: noise anyone could replay protects nothing.

    Attributes
    ----------
    model_ : torch.nn.Sequential
    optimizer_ : torch.optim.Optimizer
        Kept across calls to :meth:`fit`, so a worker's optimizer state survives its rounds.
    last_loss_ : float
        Mean training loss of the last epoch.
    dp_steps_ : int
        DP-SGD steps taken over every call to :meth:`fit` (what the accountant counts).
    """

    def __init__(self, input_dim: int, n_classes: int, hidden: int = 256, epochs: int = 1,
                 batch_size: int = 64, optimizer: str = "adam", lr: float = 1e-3,
                 weight_decay: float = 0.0, device: str = "cpu", random_state: int = 0,
                 dp: DPSGDParams | None = None) -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.input_dim = input_dim
        self.n_classes = n_classes
        self.hidden = hidden
        self.epochs = epochs
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.device = device
        self.random_state = random_state
        gen = torch.Generator().manual_seed(random_state)
        torch.manual_seed(random_state)
        self.model_ = nn.Sequential(
            nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, n_classes)
        ).to(device)
        self._gen = gen
        self._optimizer: torch.optim.Optimizer | None = None
        self.last_loss_ = float("nan")
        self.dp = dp
        self.dp_steps_ = 0
        # On the model's device: Opacus draws the noise where the gradients are.
        self._dp_gen = (torch.Generator(device=device).manual_seed(secrets.randbits(63))
                        if dp is not None else None)

    @property
    def optimizer_(self) -> torch.optim.Optimizer:
        """The optimizer, built at first use: a torch optimizer imports torch's compiler
        (torch._dynamo, about 1 s of CPU) when first called, which the master and ``fedctl
        use``, which only read and write weights, should not wait for."""
        if self._optimizer is None:
            opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
            self._optimizer = opt[self.optimizer](self.model_.parameters(), lr=self.lr,
                                                  weight_decay=self.weight_decay,
                                                  **fused_kwargs(self.optimizer))
        return self._optimizer

    # -- parameters as named numpy arrays: what travels on the wire ------------------------
    def get_arrays(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The weights as named float32 arrays.

        Parameters
        ----------
        copy : bool, default True
            Copies, safe to keep while the model trains on. ``False`` gives views of the
            model's own memory (on the CPU): valid until the model is next trained or loaded.
        """
        arrays = {k: v.detach().cpu().numpy() for k, v in self.model_.state_dict().items()}
        return {k: a.copy() for k, a in arrays.items()} if copy else arrays

    def set_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Load weights from named arrays (e.g. the global model just received)."""
        # from_numpy shares the (read-only) received buffer; load_state_dict makes the one copy.
        with warnings.catch_warnings():  # torch warns about read-only buffers it only reads
            warnings.simplefilter("ignore", UserWarning)
            state = {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
            self.model_.load_state_dict(state, strict=True)

    # -- what a worker keeps between rounds ------------------------------------------------
    def local_state(self) -> dict[str, Any]:
        """What training carries from one round to the next besides the weights (which each
        round replaces): the optimizer's moments and the shuffling generator, as a state tree
        (:mod:`common.state`)."""
        out = {"optimizer": self.optimizer_.state_dict(), "shuffle": generator_state(self._gen)}
        stream = self.privacy_stream()
        if stream is not None:
            out["dp"] = stream
        return out

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`local_state` returned."""
        self.optimizer_.load_state_dict(state["optimizer"])
        set_generator_state(self._gen, state["shuffle"])
        if "dp" in state:
            self.resume_privacy_stream(state["dp"])

    def privacy_stream(self) -> dict[str, Any] | None:
        """DP-SGD's noise generator and step count (None without DP-SGD): what must only move
        forward (:meth:`worker.families.base.WorkerFamily.privacy_stream`)."""
        if self._dp_gen is None:
            return None
        return {"generator": generator_state(self._dp_gen), "steps": self.dp_steps_}

    def resume_privacy_stream(self, stream: Mapping[str, Any]) -> None:
        """Put back what :meth:`privacy_stream` returned."""
        if self._dp_gen is not None:
            set_generator_state(self._dp_gen, stream["generator"])
            self.dp_steps_ = int(stream["steps"])

    # -- scikit-learn style ----------------------------------------------------------------
    def fit(self, X: np.ndarray, y: np.ndarray, epochs: int | None = None,
            proximal_mu: float = 0.0, correction: list[np.ndarray] | None = None
            ) -> MLPClassifier:
        """Run ``epochs`` (default ``self.epochs``) passes of mini-batch training; with
        ``proximal_mu`` > 0 the loss has FedProx's ``μ/2 · ‖w − w_start‖²``, w_start the
        weights this call started from; with ``correction`` (one array per parameter, in
        ``named_parameters`` order: SCAFFOLD's ``c − c_i``) every step is followed by
        ``w −= lr · correction``. ``last_steps_``: the steps taken."""
        fix = (None if correction is None else
               [torch.as_tensor(np.asarray(c, dtype=np.float32), device=self.device)
                for c in correction])
        anchor = anchor_of(self.model_.parameters(), proximal_mu)
        x_t = torch.as_tensor(np.asarray(X, dtype=np.float32), device=self.device)
        y_t = torch.as_tensor(np.asarray(y, dtype=np.int64), device=self.device)
        n = len(x_t)
        if self.dp is not None:
            if anchor is not None or fix is not None:
                raise ValueError("DP-SGD clips each document's gradient of the data loss: "
                                 "FedProx's and SCAFFOLD's terms do not fit in it")
            return self._fit_dp(x_t, y_t, self.epochs if epochs is None else epochs)
        loss_fn = nn.CrossEntropyLoss()
        self.model_.train()
        steps = 0
        for _ in range(self.epochs if epochs is None else epochs):
            order = torch.randperm(n, generator=self._gen).to(self.device)
            total = 0.0
            for start in range(0, n, self.batch_size):
                idx = order[start:start + self.batch_size]
                self.optimizer_.zero_grad(set_to_none=True)
                loss = loss_fn(self.model_(x_t[idx]), y_t[idx])
                total += loss.item() * len(idx)  # the data's loss, without the proximal term
                if anchor is not None:
                    loss = loss + proximal_term(self.model_.parameters(), anchor, proximal_mu)
                loss.backward()
                self.optimizer_.step()
                steps += 1
                if fix is not None:
                    with torch.no_grad():
                        for p, c in zip(self.model_.parameters(), fix, strict=True):
                            p.sub_(self.lr * c)
            self.last_loss_ = total / max(n, 1)
        self.last_steps_ = steps
        return self

    def _fit_dp(self, x_t: torch.Tensor, y_t: torch.Tensor, epochs: int) -> MLPClassifier:
        """DP-SGD: Opacus computes the per-document gradients, clips them and adds the noise;
        the Poisson sampling is drawn here (the accountant's assumption), as many steps an
        epoch as fixed batches would take."""
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        assert self.dp is not None and self._dp_gen is not None
        n = len(x_t)
        q = sgd_sample_rate(self.batch_size, n)
        # The per-document gradients of a summed loss; the optimizer divides the noisy sum
        # by the expected batch size q·n (Opacus's estimator for Poisson batches).
        wrapped = GradSampleModule(self.model_, loss_reduction="sum")
        optimizer = DPOptimizer(self.optimizer_, noise_multiplier=self.dp.noise_multiplier,
                                max_grad_norm=self.dp.max_grad_norm,
                                expected_batch_size=self.batch_size, loss_reduction="mean",
                                generator=self._dp_gen)
        self.model_.train()
        steps = 0
        try:
            for _ in range(epochs):
                total, seen = 0.0, 0
                for _ in range(math.ceil(n / self.batch_size)):
                    take = torch.rand(n, generator=self._dp_gen, device=self.device) < q
                    idx = take.nonzero().squeeze(1)
                    optimizer.zero_grad(set_to_none=True)
                    # (an empty sample is a step too: noise only, as the accountant counts)
                    loss = nn.functional.cross_entropy(wrapped(x_t[idx]), y_t[idx],
                                                       reduction="sum")
                    with warnings.catch_warnings():  # Opacus's hooks on input-free layers
                        warnings.filterwarnings("ignore", "Full backward hook is firing")
                        loss.backward()
                    optimizer.step()
                    total, seen = total + loss.item(), seen + len(idx)
                    steps += 1
                self.last_loss_ = total / max(seen, 1)
        finally:
            wrapped._close()  # the plain module again: its weights' names travel
        self.dp_steps_ += steps
        self.last_steps_ = steps
        return self

    @torch.no_grad()
    def predict(self, X: np.ndarray) -> np.ndarray:
        self.model_.eval()
        x_t = torch.as_tensor(np.asarray(X, dtype=np.float32), device=self.device)
        return self.model_(x_t).argmax(dim=1).cpu().numpy()

    @torch.no_grad()
    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """Class probabilities (softmax of the logits), shape (n, n_classes)."""
        self.model_.eval()
        x_t = torch.as_tensor(np.asarray(X, dtype=np.float32), device=self.device)
        return torch.softmax(self.model_(x_t), dim=1).cpu().numpy()

    @torch.no_grad()
    def score(self, X: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Accuracy, macro-F1 and mean cross-entropy on (X, y), from one forward pass."""
        self.model_.eval()
        x_t = torch.as_tensor(np.asarray(X, dtype=np.float32), device=self.device)
        y_t = torch.as_tensor(np.asarray(y, dtype=np.int64), device=self.device)
        logits = self.model_(x_t)
        out = classification_metrics(np.asarray(y), logits.argmax(dim=1).cpu().numpy())
        out["loss"] = float(nn.functional.cross_entropy(logits, y_t)) if len(y_t) else 0.0
        return out
