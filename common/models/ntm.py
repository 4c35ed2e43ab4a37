"""Neural topic models: ProdLDA (Srivastava & Sutton 2017) and CombinedTM (Bianchi et al. 2021).

One torch module serves both: an inference network maps a document's bag of words (and, for
CombinedTM, its sentence embedding concatenated to it) through two softplus layers of 100 to
the mean and log-variance of a logistic-normal posterior; a sample ``z = mu + sigma * eps``
gives the topic proportions ``theta = softmax(z)``; the product-of-experts decoder gives the
word distribution ``softmax(BN(theta @ beta))``. The loss of a document with counts ``x`` is
the negative ELBO

    L = -sum_w x_w log p_w  +  KL(N(mu, sigma^2) || N(mu_0, sigma_0^2))

against the Laplace approximation of a Dirichlet(1) prior (mu_0 = 0, sigma_0^2 = 1 - 1/K),
learned when ``learn_priors``. Defaults follow the reference implementation
(contextualized-topic-models): 2 hidden layers of 100, softplus, dropout 0.2, Adam lr 2e-3 with
beta_1 = 0.99, batch 64, learned priors, batch normalization without affine parameters.

Federated training (gFedNTM, Calvo-Bartolome & Arenas-Garcia) uses the same module in two
ways: :meth:`NeuralTopicModel.gradients` (one mini-batch's gradient at given weights, for the
synchronous mode) and :meth:`NeuralTopicModel.apply_gradients` (the optimizer step on them).

Exactness switches (for comparing a federated with a centralized run bit for bit):
``dropout=0``; ``batch_stats=False`` keeps every batch-norm layer in eval mode on its fixed
running statistics (mean 0, variance 1: a constant rescaling), so no document's output depends
on the others in its batch; ``doc_noise=True`` draws each document's reparameterization noise and
dropout masks from a generator seeded by (``random_state``, the document's global id, the
step), so a document gets the same draws whichever worker or batch holds it.
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from common.aggregate import weighted_average
from common.eval.topics import top_words
from common.models.ntm_sync_bn import (
    N_PHASES,
    SyncBNReducer,
    SyncBNStep,
    merge_moments,
    moved_running_stats,
)
from common.models.optimizers import fused_kwargs
from common.models.proximal import proximal_term
from common.state import generator_state, set_generator_state

__all__ = ["NTMParams", "NTMNet", "NeuralTopicModel", "MODES", "batch_schedule",
           "simulate_sync", "simulate_union", "relative_change"]

MODES = ("sync", "fedavg")
#: Largest x whose exp(x) a float holds.
LOG_FLOAT_MAX = math.log(sys.float_info.max)
#: Width of the all-MiniLM-L6-v2 sentence embedding CombinedTM concatenates to the BoW.
CONTEXT_SIZE = 384


@dataclass
class NTMParams:
    """Hyperparameters of the ``prodlda`` and ``combinedtm`` families (cluster.yaml ``model``).

    Parameters
    ----------
    n_topics : int, default 50
    hidden_sizes : tuple of int, default (100, 100)
    dropout : float, default 0.2
        On the hidden layers and on theta.
    lr : float, default 0.002
    beta1 : float, default 0.99
        Adam's first-moment decay (the reference's ``momentum``).
    batch_size : int, default 64
    learn_priors : bool, default True
    mode : {"sync", "fedavg"}, default "sync"
        ``sync``: a round is one synchronous mini-batch step (gradients travel, the master
        steps Adam); ``fedavg``: a round is ``local_epochs`` local epochs, weights travel.
    local_epochs : int, default 1
        (fedavg) passes over a worker's documents per round.
    vocab_size : int, default 2000
        Cap on the agreed vocabulary.
    min_df : int, default 2
        Fewest documents (summed over workers) a word must appear in.
    tol : float, default 0.0
        (sync) stop once the relative change of the weights in a step falls below ``tol``
        (0: never).
    patience : int, default 0
        (sync) stop once the relative change has not reached a new minimum for this many
        steps (0: never).
    eval_every : int, default 50
        (sync) the workers score the global model on their test split every this many steps
        (and at the last); other steps they only train, to keep a step cheap.
    batch_stats : bool, default True
        Batch normalization with batch statistics (False: fixed statistics, for exactness).
    doc_noise : bool, default False
        Reparameterization noise and dropout masks seeded per document (for exactness, and
        for comparisons with common random numbers).
    sync_batch_norm : bool, default True
        (sync, with ``batch_stats``) batch norm over the union of the workers' batches, as a
        centralized step over that union would: a step then takes five rounds
        (:mod:`common.models.ntm_sync_bn`), so ``rounds: 5000`` is 1000 steps. False: each
        worker normalizes its own batch (gFedNTM; one round a step, but on label-skewed
        workers a different model from centralized training).
    dtype : {"float32", "float64"}, default "float32"
    """

    n_topics: int = 50
    hidden_sizes: tuple = (100, 100)
    dropout: float = 0.2
    lr: float = 2e-3
    beta1: float = 0.99
    batch_size: int = 64
    learn_priors: bool = True
    mode: str = "sync"
    local_epochs: int = 1
    vocab_size: int = 2000
    min_df: int = 2
    tol: float = 0.0
    patience: int = 0
    eval_every: int = 50
    batch_stats: bool = True
    doc_noise: bool = False
    sync_batch_norm: bool = True
    dtype: str = "float32"

    @property
    def synced_batch_norm(self) -> bool:
        """Whether a synchronous step normalizes over the union batch (several rounds)."""
        return self.mode == "sync" and self.batch_stats and self.sync_batch_norm

    @property
    def rounds_per_step(self) -> int:
        """Cluster rounds one synchronous step takes."""
        return N_PHASES if self.synced_batch_norm else 1

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: expected float32 or float64, got {self.dtype!r}")
        for name in ("n_topics", "batch_size", "local_epochs", "vocab_size", "min_df",
                     "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1")
        if not self.hidden_sizes or not all(isinstance(h, int) and h >= 1
                                            for h in self.hidden_sizes):
            raise ValueError("hidden_sizes: expected a list of integers >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError("dropout: expected a number in [0, 1)")
        if not self.lr > 0 or not 0 <= self.beta1 < 1:
            raise ValueError("lr, beta1: expected lr > 0 and beta1 in [0, 1)")
        if self.tol < 0 or self.patience < 0:
            raise ValueError("tol, patience: expected numbers >= 0")

    def model(self, contextual_size: int = 0, random_state: int = 0, device: str = "cpu",
              noise_seed: int | None = None) -> NeuralTopicModel:
        """A fresh model with these hyperparameters."""
        return NeuralTopicModel(
            n_topics=self.n_topics, contextual_size=contextual_size,
            hidden_sizes=self.hidden_sizes, dropout=self.dropout, lr=self.lr, beta1=self.beta1,
            batch_size=self.batch_size, learn_priors=self.learn_priors,
            batch_stats=self.batch_stats, doc_noise=self.doc_noise, dtype=self.dtype,
            device=device, random_state=random_state, noise_seed=noise_seed)


@dataclass
class DocDraws:
    """The uniforms behind a batch's two dropout masks, drawn per document (``doc_noise``):
    for the last hidden layer and for theta."""

    hidden: torch.Tensor
    theta: torch.Tensor


# hand-written: contextualized-topic-models' network redone: federated modes split its passes
class NTMNet(nn.Module):
    """ProdLDA / CombinedTM network (``contextual_size`` 0 or the embedding width)."""

    def __init__(self, vocab_size: int, n_topics: int, contextual_size: int = 0,
                 hidden_sizes: Sequence[int] = (100, 100), dropout: float = 0.2,
                 learn_priors: bool = True) -> None:
        super().__init__()
        sizes = [vocab_size + contextual_size, *hidden_sizes]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:],
                                                                     strict=True))
        self.dropout = dropout
        self.f_mu = nn.Linear(sizes[-1], n_topics)
        self.f_sigma = nn.Linear(sizes[-1], n_topics)
        self.bn_mu = nn.BatchNorm1d(n_topics, affine=False)
        self.bn_sigma = nn.BatchNorm1d(n_topics, affine=False)
        var0 = 1.0 - 1.0 / n_topics  # Laplace approximation of Dirichlet(alpha = 1)
        self.prior_mean = nn.Parameter(torch.zeros(n_topics), requires_grad=learn_priors)
        self.prior_variance = nn.Parameter(torch.full((n_topics,), var0),
                                           requires_grad=learn_priors)
        self.beta = nn.Parameter(torch.empty(n_topics, vocab_size))
        nn.init.xavier_uniform_(self.beta)
        self.bn_beta = nn.BatchNorm1d(vocab_size, affine=False)
        self.contextual_size = contextual_size

    # hand-written: dropout from given uniforms (per document); nn.Dropout draws its own mask
    def _drop(self, h: torch.Tensor, gen: torch.Generator | None,
              u: torch.Tensor | None = None) -> torch.Tensor:
        """Inverted dropout: keep where the uniforms ``u`` (drawn per document, see
        ``doc_noise``), or fresh ones from ``gen`` (the model's own seeded generator, so that a
        run does not depend on what else used torch's global generator), reach the rate."""
        if not self.training or self.dropout == 0:
            return h
        if u is None:
            u = torch.rand(h.shape, generator=gen, dtype=torch.float64)
        keep = u >= self.dropout
        return h * keep.to(device=h.device, dtype=h.dtype) / (1 - self.dropout)

    def encode_unnormalized(self, bow: torch.Tensor, ctx: torch.Tensor | None,
                            gen: torch.Generator | None = None,
                            u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and log-variance before their batch norms (``u``: the dropout
        uniforms of the last hidden layer, if drawn per document)."""
        h = bow if ctx is None or self.contextual_size == 0 else torch.cat([bow, ctx], 1)
        for layer in self.hidden:
            h = nn.functional.softplus(layer(h))
        h = self._drop(h, gen, u)
        return self.f_mu(h), self.f_sigma(h)

    def encode(self, bow: torch.Tensor, ctx: torch.Tensor | None,
               gen: torch.Generator | None = None, u: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and log-variance."""
        mu, logvar = self.encode_unnormalized(bow, ctx, gen, u)
        return self.bn_mu(mu), self.bn_sigma(logvar)

    # hand-written: closed-form Gaussian KL with learned priors, as the reference code writes it
    def kl(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        """Per-document KL divergence of the posterior from the (learned) logistic-normal
        prior."""
        var0 = self.prior_variance
        k = mu.shape[1]
        return 0.5 * ((torch.exp(logvar) / var0).sum(1) + ((self.prior_mean - mu) ** 2 / var0)
                      .sum(1) - k + torch.log(var0).sum() - logvar.sum(1))

    def decode(self, theta: torch.Tensor) -> torch.Tensor:
        """Log word distribution of the product-of-experts decoder."""
        return torch.log_softmax(self.bn_beta(theta @ self.beta), dim=1)

    def loss(self, bow: torch.Tensor, ctx: torch.Tensor | None, eps: torch.Tensor | None,
             gen: torch.Generator | None = None, draws: DocDraws | None = None
             ) -> torch.Tensor:
        """Per-document negative ELBO; ``eps`` None uses the posterior mean (no sampling);
        ``draws``: the dropout uniforms drawn per document (else from ``gen``)."""
        mu, logvar = self.encode(bow, ctx, gen, draws and draws.hidden)
        z = mu if eps is None else mu + eps * torch.exp(0.5 * logvar)
        theta = self._drop(torch.softmax(z, dim=1), gen, draws and draws.theta)
        rec = -(bow * self.decode(theta)).sum(1)
        return rec + self.kl(mu, logvar)


# hand-written: endless seeded permutations; a DataLoader ties its order to torch's global RNG
class BatchStream:
    """Endless mini-batches of ``range(n)``: a fresh seeded permutation every epoch, cut into
    ``batch_size`` rows (the last batch of an epoch may be smaller).

    An iterator whose position is state (:meth:`state`, :meth:`load_state`), so that a worker
    going back to an earlier round draws the same batches again.
    """

    def __init__(self, n: int, batch_size: int, random_state: int) -> None:
        self.n, self.batch_size = n, batch_size
        self._rng = np.random.default_rng(random_state)
        self._order = np.empty(0, dtype=np.int64)
        self._pos = 0

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> np.ndarray:
        if self._pos >= len(self._order):
            self._order, self._pos = self._rng.permutation(self.n), 0
        rows = self._order[self._pos:self._pos + self.batch_size]
        self._pos += self.batch_size
        return rows

    def state(self) -> dict[str, Any]:
        return {"rng": generator_state(self._rng), "order": self._order, "pos": self._pos}

    def load_state(self, state: Mapping[str, Any]) -> None:
        set_generator_state(self._rng, state["rng"])
        self._order, self._pos = np.asarray(state["order"]), int(state["pos"])


def batch_schedule(n: int, batch_size: int, random_state: int) -> BatchStream:
    """:class:`BatchStream` of ``range(n)`` (the name the centralized fits use)."""
    return BatchStream(n, batch_size, random_state)


class NeuralTopicModel:
    """ProdLDA (``contextual_size=0``) or CombinedTM (``contextual_size=384``), sklearn style.

    Parameters
    ----------
    n_topics : int, default 50
    contextual_size : int, default 0
        Width of the sentence embedding concatenated to the bag of words (0: ProdLDA).
    hidden_sizes : tuple of int, default (100, 100)
    dropout : float, default 0.2
    lr : float, default 0.002
    beta1 : float, default 0.99
    batch_size : int, default 64
    learn_priors : bool, default True
    batch_stats : bool, default True
        False keeps batch normalization on fixed statistics (see the module docstring).
    doc_noise : bool, default False
        Seed each document's reparameterization noise and dropout masks by its id and the
        step.
    dtype : {"float32", "float64"}, default "float32"
    device : str, default "cpu"
    random_state : int, default 0
        Seeds the initial weights, the batch order and the noise.
    noise_seed : int or None, default None
        Seed of the per-document noise (None: ``random_state``); every worker of a federated
        run uses the cluster's seed, so a document's noise does not depend on who holds it.

    Attributes
    ----------
    net_ : NTMNet
    vocab_size_ : int
    steps_ : int
        Optimizer steps taken.
    last_loss_ : float
        Mean loss of the last mini-batch.
    """

    def __init__(self, n_topics: int = 50, contextual_size: int = 0,
                 hidden_sizes: Sequence[int] = (100, 100), dropout: float = 0.2,
                 lr: float = 2e-3, beta1: float = 0.99, batch_size: int = 64,
                 learn_priors: bool = True, batch_stats: bool = True, doc_noise: bool = False,
                 dtype: str = "float32", device: str = "cpu", random_state: int = 0,
                 noise_seed: int | None = None) -> None:
        self.n_topics = n_topics
        self.contextual_size = contextual_size
        self.hidden_sizes = tuple(hidden_sizes)
        self.dropout = dropout
        self.lr = lr
        self.beta1 = beta1
        self.batch_size = batch_size
        self.learn_priors = learn_priors
        self.batch_stats = batch_stats
        self.doc_noise = doc_noise
        self.dtype = dtype
        self.device = device
        self.random_state = random_state
        self.noise_seed = noise_seed

    # ------------------------------------------------------------------ construction
    @property
    def _torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32

    def initialize(self, vocab_size: int) -> NeuralTopicModel:
        """Build the network with seeded initial weights and a fresh optimizer."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.random_state)  # seeds the layers' own initializers
        try:
            self.net_ = NTMNet(vocab_size, self.n_topics, self.contextual_size,
                               self.hidden_sizes, self.dropout, self.learn_priors)
        finally:
            torch.random.set_rng_state(gen_state)
        self.net_.to(device=self.device, dtype=self._torch_dtype)
        self.vocab_size_ = vocab_size
        self._optimizer: torch.optim.Optimizer | None = None
        self.noise_ = torch.Generator(device="cpu").manual_seed(self.random_state)
        self.steps_ = 0
        self.last_loss_ = math.nan
        return self

    @property
    def optimizer_(self) -> torch.optim.Optimizer:
        """Adam on the trainable parameters, built at first use: a torch optimizer imports
        torch's compiler (torch._dynamo, about 1 s of CPU) when first called, which a master
        that only averages weights (``mode: fedavg``) should not wait for."""
        if self._optimizer is None:
            self._optimizer = torch.optim.Adam(self._trainable(), lr=self.lr,
                                               betas=(self.beta1, 0.999), **fused_kwargs("adam"))
        return self._optimizer

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.net_.parameters() if p.requires_grad]

    def param_names(self) -> list[str]:
        """Names of the trainable parameters (what gradients are named after)."""
        return [n for n, p in self.net_.named_parameters() if p.requires_grad]

    def buffer_names(self) -> list[str]:
        """Batch-norm running statistics that travel with the weights."""
        return [n for n, _ in self.net_.named_buffers() if not n.endswith("num_batches_tracked")]

    def local_state(self, weights: bool = True) -> dict[str, Any]:
        """What a worker's copy carries from one round to the next, as a state tree
        (:mod:`common.state`): the network (weights, running statistics and their counters),
        the optimizer's moments, the noise generator and the step count; without
        ``weights``, the last two only (for a copy that takes its weights from every round,
        as a synchronous step's worker does)."""
        state = {"noise": generator_state(self.noise_), "steps": self.steps_}
        if weights:
            state.update(net=self.net_.state_dict(), optimizer=self.optimizer_.state_dict())
        return state

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`local_state` returned (into an initialized model)."""
        if "net" in state:
            self.net_.load_state_dict(state["net"])
            self.optimizer_.load_state_dict(state["optimizer"])
        set_generator_state(self.noise_, state["noise"])
        self.steps_ = int(state["steps"])

    # ------------------------------------------------------------------ arrays on the wire
    def get_arrays(self) -> dict[str, np.ndarray]:
        """Every parameter and running statistic, by name (copies)."""
        out = {n: p.detach().cpu().numpy().copy() for n, p in self.net_.named_parameters()}
        bufs = dict(self.net_.named_buffers())
        out.update({n: bufs[n].detach().cpu().numpy().copy() for n in self.buffer_names()})
        return out

    def set_arrays(self, arrays: Mapping[str, np.ndarray]) -> NeuralTopicModel:
        """Load what :meth:`get_arrays` returned (builds the network if needed)."""
        if not hasattr(self, "net_"):
            self.initialize(int(np.shape(arrays["beta"])[1]))
        state = dict(self.net_.named_parameters())
        state.update(self.net_.named_buffers())
        with torch.no_grad():
            for name, value in arrays.items():
                state[name].copy_(torch.as_tensor(np.array(value)))  # received arrays are read-only
        return self

    # ------------------------------------------------------------------ training primitives
    def _tensors(self, X: Any, ctx: np.ndarray | None, rows: np.ndarray
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        xb = X[rows]
        xb = xb.toarray() if sp.issparse(xb) else np.asarray(xb)
        bow = torch.as_tensor(xb, dtype=self._torch_dtype, device=self.device)
        c = None
        if self.contextual_size:
            if ctx is None:
                raise ValueError("CombinedTM needs the documents' sentence embeddings")
            c = torch.as_tensor(np.asarray(ctx[rows]), dtype=self._torch_dtype,
                                device=self.device)
        return bow, c

    # hand-written: draws seeded per (document, step) for any worker; torch has no keyed RNG
    def _noise(self, n: int, doc_ids: np.ndarray | None, step: int
               ) -> tuple[torch.Tensor, DocDraws | None]:
        """The batch's reparameterization noise and, with ``doc_noise``, its dropout uniforms,
        each row from a generator seeded by (noise seed, document id, step): whichever worker
        or batch holds a document, it gets the same draws."""
        k = self.n_topics
        if not (self.doc_noise and doc_ids is not None):
            eps = torch.randn(n, k, generator=self.noise_, dtype=torch.float64)
            return eps.to(device=self.device, dtype=self._torch_dtype), None
        width = self.hidden_sizes[-1]
        eps = torch.empty(n, k, dtype=torch.float64)
        hidden = torch.empty(n, width, dtype=torch.float64)
        theta = torch.empty(n, k, dtype=torch.float64)
        g = torch.Generator(device="cpu")
        seed = self.random_state if self.noise_seed is None else self.noise_seed
        for i, d in enumerate(doc_ids):
            g.manual_seed((seed * 1_000_003 + int(d)) * 1_000_033 + step)
            eps[i] = torch.randn(k, generator=g, dtype=torch.float64)
            if self.dropout > 0:  # after the noise, so that it is what it was without them
                hidden[i] = torch.rand(width, generator=g, dtype=torch.float64)
                theta[i] = torch.rand(k, generator=g, dtype=torch.float64)
        draws = DocDraws(hidden.to(self.device), theta.to(self.device)) if self.dropout else None
        return eps.to(device=self.device, dtype=self._torch_dtype), draws

    def _mode(self, train: bool) -> None:
        self.net_.train(train)
        if not self.batch_stats:  # fixed statistics: batch norm always in eval mode
            for m in self.net_.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.eval()

    def batch_loss(self, X: Any, ctx: np.ndarray | None, rows: np.ndarray,
                   doc_ids: np.ndarray | None = None, step: int | None = None) -> torch.Tensor:
        """Mean negative ELBO of rows ``rows`` in training mode (graph kept for backward)."""
        self._mode(True)
        bow, c = self._tensors(X, ctx, rows)
        eps, draws = self._noise(len(rows), doc_ids, self.steps_ if step is None else step)
        return self.net_.loss(bow, c, eps, self.noise_, draws).mean()

    def gradients(self, X: Any, ctx: np.ndarray | None, rows: np.ndarray,
                  doc_ids: np.ndarray | None = None, step: int | None = None
                  ) -> dict[str, np.ndarray]:
        """Gradient of the mean loss of one mini-batch at the current weights, by parameter
        name, plus the batch-norm running statistics that batch moved (by buffer name)."""
        for p in self._trainable():
            p.grad = None
        loss = self.batch_loss(X, ctx, rows, doc_ids, step)
        loss.backward()
        self.last_loss_ = float(loss.detach())
        params = dict(self.net_.named_parameters())
        out = {n: params[n].grad.detach().cpu().numpy().copy() for n in self.param_names()}
        bufs = dict(self.net_.named_buffers())
        out.update({n: bufs[n].detach().cpu().numpy().copy() for n in self.buffer_names()})
        return out

    def apply_gradients(self, grads: Mapping[str, np.ndarray]) -> NeuralTopicModel:
        """One optimizer step along ``grads`` (by parameter name); running statistics among
        them are taken as they are."""
        params = dict(self.net_.named_parameters())
        for n in self.param_names():
            params[n].grad = torch.as_tensor(np.asarray(grads[n]), device=self.device,
                                             dtype=self._torch_dtype).clone()
        self.optimizer_.step()
        bufs = dict(self.net_.named_buffers())
        with torch.no_grad():
            for n in self.buffer_names():
                if n in grads:
                    bufs[n].copy_(torch.as_tensor(np.asarray(grads[n])))
        self.steps_ += 1
        return self

    # hand-written: node batch moments from running stats, pooled; torch has nothing for it
    def merge_running_stats(self, uploads: Sequence[Mapping[str, np.ndarray]],
                            sizes: Sequence[int]) -> dict[str, np.ndarray]:
        """The batch-norm running statistics one batch norm over the union of the nodes'
        batches would have reached, from the running statistics each node uploaded.

        Every node starts the step from this model's running statistics and moves them by
        ``momentum`` towards its own batch's mean and unbiased variance. Averaging the uploads
        by batch size gets the union's mean right but not its variance: that is the nodes'
        mean within-batch variance, short of the spread of the nodes' batch means (large when
        the nodes' data are skewed), so eval-mode batch norm would normalize by too small a
        scale. Here each node's batch moments are recovered from its upload and pooled (law of
        total variance, Bessel-corrected over the union), then the step is redone once.

        Parameters
        ----------
        uploads : sequence of mappings of str to numpy.ndarray
            Each node's arrays after its step (running statistics by buffer name; other names
            are ignored).
        sizes : sequence of int
            Each node's batch size (at least 2, as batch norm itself requires in training).

        Returns
        -------
        dict of str to numpy.ndarray
            ``<layer>.running_mean`` and ``<layer>.running_var`` of every batch-norm layer that
            tracks them, in the buffers' dtype.
        """
        n = np.asarray(sizes, dtype=np.float64)
        if n.shape != (len(uploads),) or not len(uploads) or (n < 2).any():
            raise ValueError("merge_running_stats: one batch size >= 2 per upload")
        out: dict[str, np.ndarray] = {}
        for prefix, bn in self.net_.named_modules():
            if not isinstance(bn, nn.BatchNorm1d) or bn.running_mean is None:
                continue
            mu = bn.momentum
            rm0 = bn.running_mean.detach().cpu().numpy().astype(np.float64)
            rv0 = bn.running_var.detach().cpu().numpy().astype(np.float64)
            rm = np.stack([np.asarray(u[f"{prefix}.running_mean"], np.float64) for u in uploads])
            rv = np.stack([np.asarray(u[f"{prefix}.running_var"], np.float64) for u in uploads])
            mean = (rm - (1 - mu) * rm0) / mu  # each batch's mean ...
            var = (rv - (1 - mu) * rv0) / mu * ((n - 1) / n)[:, None]  # ... and biased variance
            union = merge_moments([{"mean": m, "m2": v * k} for m, v, k in zip(mean, var, n,
                                                                               strict=True)], n)
            out[f"{prefix}.running_mean"], out[f"{prefix}.running_var"] = moved_running_stats(
                bn, union["mean"], union["var"], float(n.sum()))
        return out

    def sync_step(self, uploads: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int],
                  batch_stats: bool = True) -> NeuralTopicModel:
        """One synchronous step from the nodes' uploads: the batch-size weighted mean gradient
        (summed in float64, in the given order) and, with ``batch_stats``, the running
        statistics of the union of their batches (:meth:`merge_running_stats`; uploads from
        batches under 2 rows, which no batch norm step produces, are left out of the merge)."""
        update = weighted_average(uploads, sizes, accumulate=np.float64)
        real = [i for i, n in enumerate(sizes) if n >= 2]
        if batch_stats and real:
            update.update(self.merge_running_stats([uploads[i] for i in real],
                                                   [sizes[i] for i in real]))
        return self.apply_gradients(update)

    def step(self, X: Any, ctx: np.ndarray | None, rows: np.ndarray,
             doc_ids: np.ndarray | None = None, anchor: Sequence[torch.Tensor] | None = None,
             proximal_mu: float = 0.0) -> float:
        """One local Adam step on rows ``rows``; the batch's mean loss. With ``anchor`` (the
        trainable parameters' values at the round's start), FedProx's ``μ/2 · ‖w − anchor‖²``
        joins the loss (not the loss returned)."""
        self.optimizer_.zero_grad(set_to_none=True)
        loss = self.batch_loss(X, ctx, rows, doc_ids)
        self.last_loss_ = float(loss.detach())
        if anchor is not None:
            loss = loss + proximal_term(self._trainable(), anchor, proximal_mu)
        loss.backward()
        self.optimizer_.step()
        self.steps_ += 1
        return self.last_loss_

    # ------------------------------------------------------------------ sklearn API
    def fit(self, X: Any, contextual: np.ndarray | None = None, epochs: int = 10,
            steps: int | None = None, doc_ids: np.ndarray | None = None) -> NeuralTopicModel:
        """Train on a document-word count matrix.

        Parameters
        ----------
        X : sparse or dense matrix of shape (n_docs, n_words)
        contextual : array of shape (n_docs, contextual_size) or None, default None
            Sentence embeddings (CombinedTM).
        epochs : int, default 10
            Passes over X (ignored when ``steps`` is given).
        steps : int or None, default None
            Exactly this many mini-batch steps instead.
        doc_ids : array of int or None, default None
            Global ids of the rows, for ``doc_noise`` (default: the row numbers).
        """
        if not hasattr(self, "net_"):
            self.initialize(X.shape[1])
        n = X.shape[0]
        ids = np.arange(n) if doc_ids is None else np.asarray(doc_ids)
        total = steps if steps is not None else epochs * math.ceil(n / self.batch_size)
        batches = batch_schedule(n, self.batch_size, self.random_state)
        t0 = time.perf_counter()
        for _ in range(total):
            rows = next(batches)
            self.step(X, contextual, rows, ids[rows])
        self.fit_time_ = time.perf_counter() - t0
        return self

    @torch.no_grad()
    def _eval_chunks(self, X: Any, contextual: np.ndarray | None, chunk: int = 2048
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        self._mode(False)
        for start in range(0, X.shape[0], chunk):
            yield self._tensors(X, contextual, np.arange(start, min(start + chunk, X.shape[0])))

    @torch.no_grad()
    def transform(self, X: Any, contextual: np.ndarray | None = None) -> np.ndarray:
        """Document-topic proportions: softmax of the posterior mean (eval mode).

        Returns
        -------
        numpy.ndarray of shape (n_docs, n_topics)
        """
        out = [torch.softmax(self.net_.encode(b, c)[0], 1) for b, c in
               self._eval_chunks(X, contextual)]
        if not out:
            return np.zeros((0, self.n_topics))
        return torch.cat(out).cpu().numpy().astype(np.float64)

    # hand-written: exp(neg. ELBO / words), as the reference code; no library scores this model
    @torch.no_grad()
    def perplexity(self, X: Any, contextual: np.ndarray | None = None) -> float:
        """exp(sum of the documents' negative ELBO / total word count), at the posterior mean:
        an upper bound on the held-out perplexity. Empty documents are skipped."""
        total, words = 0.0, 0.0
        for b, c in self._eval_chunks(X, contextual):
            keep = b.sum(1) > 0
            if keep.any():
                b2 = b[keep]
                total += float(self.net_.loss(b2, None if c is None else c[keep], None).sum())
                words += float(b2.sum())
        if not words:
            return math.nan
        # Past float's range (a model blown up): inf, not an OverflowError that ended every
        # worker scoring it.
        bound = total / words
        return math.exp(bound) if not bound >= LOG_FLOAT_MAX else math.inf

    def get_topic_word_matrix(self) -> np.ndarray:
        """beta, shape (n_topics, n_words): the decoder's unnormalized topic-word weights."""
        return self.net_.beta.detach().cpu().numpy().astype(np.float64)

    @torch.no_grad()
    def get_topic_word_distribution(self) -> np.ndarray:
        """p(word | theta = e_k): the decoder's word distribution for a document made of topic
        k alone (eval mode, so batch norm uses its running statistics). Rows sum to 1."""
        self._mode(False)
        eye = torch.eye(self.n_topics, dtype=self._torch_dtype, device=self.device)
        return self.net_.decode(eye).exp().cpu().numpy().astype(np.float64)

    def get_topics(self, k: int = 10, vocabulary: Sequence[str] | None = None
                   ) -> list[list[str]]:
        """Each topic's ``k`` heaviest words (``vocabulary`` default: ``vocabulary_`` if set)."""
        vocab = vocabulary if vocabulary is not None else getattr(self, "vocabulary_", None)
        if vocab is None:
            raise ValueError("no vocabulary: pass one or set vocabulary_")
        return top_words(self.get_topic_word_matrix(), list(vocab), k)

    # ------------------------------------------------------------------ persistence
    def get_params(self) -> dict[str, Any]:
        keys = ("n_topics", "contextual_size", "hidden_sizes", "dropout", "lr", "beta1",
                "batch_size", "learn_priors", "batch_stats", "doc_noise", "dtype",
                "random_state", "noise_seed")
        return {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in keys}

    def save(self, path: str | Path) -> None:
        """Weights, hyperparameters and vocabulary in one ``.npz``."""
        meta = {"params": self.get_params(), "vocabulary": list(getattr(self, "vocabulary_",
                                                                          []) or [])}
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                 **self.get_arrays())
        Path(path).write_bytes(buf.getvalue())

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> NeuralTopicModel:
        """A model written by :meth:`save`."""
        with np.load(path) as npz:
            meta = json.loads(npz["__meta__"].tobytes().decode())
            arrays = {k: npz[k] for k in npz.files if k != "__meta__"}
        model = cls(**meta["params"], device=device)
        model.set_arrays(arrays)
        if meta["vocabulary"]:
            model.vocabulary_ = meta["vocabulary"]
        return model


# hand-written: one norm ratio over several named arrays, without stacking them
def relative_change(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]
                    ) -> float:
    """||after - before|| / ||before|| over all the named arrays of ``before``."""
    num = sum(float(np.sum((np.asarray(after[n], np.float64) - before[n]) ** 2))
              for n in before)
    den = sum(float(np.sum(np.asarray(before[n], np.float64) ** 2)) for n in before)
    return math.sqrt(num / max(den, 1e-300))


def simulate_sync(shards: Sequence[tuple[Any, np.ndarray | None]], params: NTMParams,
                  steps: int, random_state: int = 0, contextual_size: int = 0,
                  doc_ids: Sequence[np.ndarray] | None = None) -> NeuralTopicModel:
    """Synchronous federated training in one process (what the cluster does over the wire).

    Each step, node ``i`` computes the gradient of its own next mini-batch (its own seeded
    order, seed ``random_state + 1 + i``) at the global weights; the gradients are averaged
    weighted by batch size and one Adam step is taken. With ``params.synced_batch_norm`` the
    step runs the five phases of :mod:`common.models.ntm_sync_bn` (batch norm over the union
    of the nodes' batches); otherwise each node normalizes its own batch and the batch-norm
    running statistics become those of the union of the nodes' batches
    (:meth:`NeuralTopicModel.merge_running_stats`). Returns the global model.

    Parameters
    ----------
    shards : sequence of (X, contextual)
        Each node's count matrix (over the common vocabulary) and embeddings (or None).
    params : NTMParams
    steps : int
    random_state : int, default 0
        Seeds the global initialization; node i's model uses ``random_state + 1 + i``.
    contextual_size : int, default 0
    doc_ids : sequence of arrays or None
        Global document ids per node (for ``doc_noise``).
    """
    vocab_size = shards[0][0].shape[1]
    glob = params.model(contextual_size, random_state).initialize(vocab_size)
    nodes = [params.model(contextual_size, random_state + 1 + i,
                          noise_seed=random_state).initialize(vocab_size)
             for i in range(len(shards))]
    orders = [batch_schedule(X.shape[0], params.batch_size, random_state + 1 + i)
              for i, (X, _) in enumerate(shards)]
    reducer = SyncBNReducer(glob)
    for t in range(steps):
        arrays = glob.get_arrays()
        grads, sizes, syncs = [], [], []
        for i, ((X, ctx), node) in enumerate(zip(shards, nodes, strict=True)):
            rows = next(orders[i])
            node.set_arrays(arrays)
            ids = None if doc_ids is None else np.asarray(doc_ids[i])[rows]
            sizes.append(len(rows))
            if params.synced_batch_norm:
                syncs.append(SyncBNStep(node, X, ctx, rows, ids, step=t))
            else:
                grads.append(node.gradients(X, ctx, rows, ids, step=t))
        if not params.synced_batch_norm:
            glob.sync_step(grads, sizes, params.batch_stats)
            continue
        published: Mapping[str, np.ndarray] = arrays
        for phase in range(N_PHASES):
            uploads = [s.upload(phase, published) for s in syncs]
            published = reducer.reduce(phase, uploads, sizes)
        glob.last_loss_ = float(np.average([s.loss_ for s in syncs], weights=sizes))
    return glob


def model_summary(params: NTMParams) -> dict[str, Any]:
    """The hyperparameters as a JSON-able dict."""
    d = asdict(params)
    d["hidden_sizes"] = list(d["hidden_sizes"])
    return d


def simulate_union(shards: Sequence[tuple[Any, np.ndarray | None]], params: NTMParams,
                   steps: int, random_state: int = 0, contextual_size: int = 0,
                   doc_ids: Sequence[np.ndarray] | None = None) -> NeuralTopicModel:
    """Centralized counterpart of :func:`simulate_sync`: one model on the pooled data, each
    step on the union of the mini-batches the nodes would draw (same seeds), same initial
    weights. Without dropout, batch statistics and shared noise, the two coincide."""
    X_all = sp.vstack([sp.csr_matrix(X) for X, _ in shards]).tocsr()
    ctx_all = (np.concatenate([np.asarray(c) for _, c in shards]) if contextual_size
               else None)
    offsets = np.cumsum([0] + [X.shape[0] for X, _ in shards])
    ids_all = (np.concatenate([np.asarray(d) for d in doc_ids]) if doc_ids is not None
               else None)
    model = params.model(contextual_size, random_state, noise_seed=random_state)
    model.initialize(X_all.shape[1])
    orders = [batch_schedule(X.shape[0], params.batch_size, random_state + 1 + i)
              for i, (X, _) in enumerate(shards)]
    for t in range(steps):
        rows = np.concatenate([offsets[i] + next(o) for i, o in enumerate(orders)])
        model.optimizer_.zero_grad(set_to_none=True)
        loss = model.batch_loss(X_all, ctx_all, rows,
                                None if ids_all is None else ids_all[rows], step=t)
        loss.backward()
        model.optimizer_.step()
        model.steps_ += 1
        model.last_loss_ = float(loss.detach())
    return model
