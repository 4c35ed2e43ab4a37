"""NMF topic model trained by mini-batch stochastic gradient, optionally with a mutual-information
term (FedNMF / FedNMF+MI, Si et al., IJCNN 2022).

A corpus of N documents over V words is a count matrix X (N x V, scikit-learn's orientation:
documents are rows). NMF factorizes X ~ H C with the document-topic weights H (N x k) and the
topic-word matrix C (k x V, ``components_`` as in scikit-learn; the paper's W is its
transpose). Per mini-batch S of B documents the loss is

    L = 1/B sum_{j in S} ||x_j - h_j C||^2  -  lambda * I_SMILE(x_S, h_S)

with C, H >= 0 and I_SMILE the SMILE bound of the mutual information between a document's
counts and its topic weights (:mod:`common.models.smile`; the critic scores proportions, see
:func:`_critic_inputs`); its critic theta is trained to maximize the bound. lambda = 0 is plain
NMF by SGD.

Used three ways with the same code: by each worker (C and theta travel, H stays), by the
centralized baselines (NMF by SGD, +MI), and to score any topic-word matrix (``transform``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.decomposition import non_negative_factorization
from torch import nn

from common.eval.topics import svm_scores, top_words
from common.models.proximal import anchor_of, proximal_term
from common.models.smile import SmileCritic
from common.state import generator_state, set_generator_state

__all__ = ["NMFParams", "SGDNMF", "init_scale", "reconstruction_loss", "heldout_scores",
           "OPTIMIZERS"]

OPTIMIZERS = ("sgd", "adam")
CRITIC_AGGREGATIONS = ("fedavg", "strategy", "local")
#: Epochs of training with the MI term beyond which the paper's update loses F1 and then
#: collapses the topics (benchmarks/results/fednmf_mi_long.md); the master warns past it.
MI_STABLE_EPOCHS = 30
#: Smooths the critic's view of the topic proportions h / (sum(h) + eps) (see SGDNMF).
PROPORTION_EPS = 0.05
#: Name of the topic-word matrix among the arrays that travel; the critic's are "critic.*".
COMPONENTS = "components"
CRITIC_PREFIX = "critic."


# hand-written: scikit-learn's init='random' scale, which it does not expose as a function
def init_scale(mean_count: float, n_topics: int) -> float:
    """Scale of random non-negative initial factors: sqrt(mean(X) / k), scikit-learn's
    ``init="random"`` rule, so that H C starts at the data's average magnitude."""
    return float(np.sqrt(max(mean_count, 1e-12) / n_topics))


@dataclass
class NMFParams:
    """Hyperparameters of the ``nmf`` family (the ``model`` section of cluster.yaml).

    Parameters
    ----------
    n_topics : int, default 50
        Topics k.
    mi_weight : float, default 0.0
        lambda, the weight of the mutual-information term; 0 is plain FedNMF. On clients
        whose labels differ (Dir(0.1), 5 local epochs) lambda = 10 with ``mi_keeps_scale``
        raised the macro-F1 of topic weights solved from the topics by 0.016 on average, and
        lowered that of the clients' own learned weights; on clients that agree it changed
        nothing (docs/FEDNMF.md).
    local_epochs : int, default 1
        Passes over a worker's documents per round (E).
    batch_size : int, default 32
        Documents per mini-batch (B). The critic scores all B^2 pairs of a batch, so the MI
        term costs B times more per document than the reconstruction: at B = 32 a step with
        it takes ~4 ms on one CPU core, at B = 64 ~25 ms.
    lr : float, default 0.5
        Learning rate of C, H and the critic.
    optimizer : {"sgd", "adam"}, default "sgd"
        The local optimizer: plain SGD as in the paper, or Adam (C and the critic with
        ``torch.optim.Adam``, H with ``torch.optim.SparseAdam`` so only the batch's rows
        move). On 3,000 stackoverflow titles (K = 10, 50 rounds of 5 local epochs), SGD at
        lr 0.5 reached a lower held-out reconstruction error and a higher macro-F1 than Adam
        at lr 0.01 or 0.05, with FedAvg and with FedAdam.
    vocab_size : int, default 2000
        Words in the agreed vocabulary.
    min_df : int, default 2
        Fewest documents (summed over workers) a word of the vocabulary must appear in.
    tau : float, default 5.0
        SMILE clip.
    critic_aggregation : {"fedavg", "strategy", "local"}, default "fedavg"
        How the master combines the workers' critics: their sample-weighted mean whatever the
        strategy, or the strategy itself (as C). See :class:`master.families.nmf.NMFServer`.
        ``"local"``: the critic never leaves its worker (like H); each worker estimates the
        mutual information of its own documents with its own critic, and only C travels.
    transform_max_iter : int, default 200
        Coordinate-descent iterations when solving for H with C fixed.
    mi_keeps_scale : bool, default True
        The MI term's step on each title's topic weights h keeps their sum: the term only
        redistributes a title's weight among topics, and the reconstruction alone sets its
        scale. False is the paper's update, under which the term lengthens H and shrinks C
        until long training collapses the topics (docs/FEDNMF.md, "Long training"). With the
        MI term, True needs ``optimizer: sgd``; set it to false to train the term with adam.
    """

    n_topics: int = 50
    mi_weight: float = 0.0
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.5
    optimizer: str = "sgd"
    vocab_size: int = 2000
    min_df: int = 2
    tau: float = 5.0
    critic_aggregation: str = "fedavg"
    transform_max_iter: int = 200
    mi_keeps_scale: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if self.critic_aggregation not in CRITIC_AGGREGATIONS:
            raise ValueError(f"critic_aggregation: expected one of "
                             f"{', '.join(CRITIC_AGGREGATIONS)}, got {self.critic_aggregation!r}")
        for name in ("n_topics", "local_epochs", "batch_size", "vocab_size", "min_df",
                     "transform_max_iter"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1")
        if self.batch_size < 2 and self.mi_weight > 0:
            raise ValueError("batch_size: the MI term needs batches of at least 2")
        if not self.lr > 0:
            raise ValueError("lr: expected a number > 0")
        if self.mi_weight < 0:
            raise ValueError("mi_weight: expected a number >= 0")
        if self.mi_weight > 0 and self.mi_keeps_scale and self.optimizer != "sgd":
            raise ValueError("mi_keeps_scale: true needs optimizer: sgd (set it to false to "
                             "train the MI term with adam)")
        if not self.tau > 0:
            raise ValueError("tau: expected a number > 0")

    @property
    def critic_travels(self) -> bool:
        """Whether the critic is in the payloads (every ``critic_aggregation`` but local)."""
        return self.critic_aggregation != "local"

    def model(self, device: str = "cpu", random_state: int = 0) -> SGDNMF:
        """A fresh model with these hyperparameters."""
        return SGDNMF(n_topics=self.n_topics, mi_weight=self.mi_weight,
                      epochs=self.local_epochs, batch_size=self.batch_size, lr=self.lr,
                      optimizer=self.optimizer, tau=self.tau,
                      transform_max_iter=self.transform_max_iter,
                      mi_keeps_scale=self.mi_keeps_scale, device=device,
                      random_state=random_state)


# hand-written: sklearn's NMF / MiniBatchNMF have no MI term nor a local H beside a shared C
class SGDNMF:
    """NMF (+ a SMILE mutual-information term) by mini-batch stochastic gradient, in torch.

    Non-negativity is kept by projection: after every step C and the batch's rows of H are
    clamped at 0.

    Each column of H appears in one document's term only, so H follows the gradient of its
    own document's loss (the mini-batch mean times B); otherwise, with plain SGD, a document
    seen once per epoch would move B times slower than C. The critic follows the gradient of
    -I_SMILE itself, whatever lambda (it is rescaled by 1/lambda after the joint backward
    pass), so that it keeps maximizing the bound; it has its own optimizer of the same kind.

    Parameters
    ----------
    n_topics : int, default 50
    mi_weight : float, default 0.0
        lambda; 0 makes no critic and is exactly plain NMF by projected SGD.
    epochs : int, default 1
        Passes over the data per call to :meth:`fit`.
    batch_size : int, default 32
    lr : float, default 0.5
    optimizer : {"sgd", "adam"}, default "sgd"
    tau : float, default 5.0
        SMILE clip.
    critic_hidden : tuple of int, default (32, 256)
    transform_max_iter : int, default 200
    critic_lr : float or None, default None
        The critic's learning rate; None: ``lr``.
    mi_keeps_scale : bool, default True
        Take the MI term's step on H apart from the reconstruction's, after it, and rescale
        each h back to the sum it had between the two: h1 = [h - lr B d(recon)/dh]+,
        h = [h1 + lr B lambda dI/dh]+ * sum(h1) / sum([h1 + lr B lambda dI/dh]+), with both
        gradients at the batch's h before the step. The critic sees h's proportions, so the
        bound's gradient is nearly orthogonal to h, and each such step lengthens h; with
        this option only the reconstruction sets a title's scale. No effect without the MI
        term. False is the paper's update. With the MI term, True needs ``optimizer="sgd"``.
    random_state : int, default 0
        Seeds the initial factors, the critic and the batch order.
    device : str, default "cpu"

    Attributes
    ----------
    components_ : numpy.ndarray of shape (n_topics, n_words)
        C, the topic-word matrix (a copy; set it with :meth:`set_arrays`).
    doc_topic_ : numpy.ndarray of shape (n_docs, n_topics)
        H of the documents of the last :meth:`fit` (a copy).
    critic_ : SmileCritic or None
    last_loss_ : float
        Mean reconstruction loss ||x - h C||^2 per document over the last epoch.
    last_mi_ : float
        Mean I_SMILE over the last epoch's batches (nan without the MI term).
    n_steps_ : int
        Optimizer steps taken so far.

    Notes
    -----
    :meth:`fit` continues from the current state: C and the critic from the last
    :meth:`fit` or :meth:`set_arrays`, H from the last :meth:`fit` if it had as many documents
    (a worker's H persists across rounds and never leaves it). So does H's optimizer state;
    C's and the critic's restart whenever :meth:`set_arrays` loads new values.
    """

    def __init__(self, n_topics: int = 50, mi_weight: float = 0.0, epochs: int = 1,
                 batch_size: int = 32, lr: float = 0.5, optimizer: str = "sgd",
                 tau: float = 5.0, critic_hidden: tuple[int, ...] = (32, 256),
                 transform_max_iter: int = 200, critic_lr: float | None = None,
                 mi_keeps_scale: bool = True, random_state: int = 0,
                 device: str = "cpu") -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.n_topics = n_topics
        self.mi_weight = mi_weight
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.optimizer = optimizer
        self.tau = tau
        self.critic_hidden = tuple(critic_hidden)
        self.transform_max_iter = transform_max_iter
        self.critic_lr = critic_lr
        self.mi_keeps_scale = mi_keeps_scale
        self.random_state = random_state
        self.device = device
        self._check_keeps_scale()
        self._gen = torch.Generator().manual_seed(random_state)
        self._rng = np.random.default_rng(random_state)
        self._C: torch.Tensor | None = None  # (k, V), a leaf with grad
        self._H: nn.Embedding | None = None  # (N, k) rows looked up by document
        self.critic_: SmileCritic | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._opt_h: torch.optim.Optimizer | None = None
        self._opt_c: torch.optim.Optimizer | None = None
        self.last_loss_ = float("nan")
        self.last_mi_ = float("nan")
        self.n_steps_ = 0

    # -- state --------------------------------------------------------------------------
    @property
    def n_words(self) -> int | None:
        return None if self._C is None else int(self._C.shape[1])

    @property
    def components_(self) -> np.ndarray:
        if self._C is None:
            raise AttributeError("components_: not fitted (call fit or set_arrays first)")
        return self._C.detach().cpu().numpy().copy()

    @property
    def doc_topic_(self) -> np.ndarray:
        if self._H is None:
            raise AttributeError("doc_topic_: not fitted")
        return self._H.weight.detach().cpu().numpy().copy()

    def initialize(self, n_words: int, mean_count: float = 1.0) -> SGDNMF:
        """Draw C (and the critic) from scratch: |N(0, 1)| * :func:`init_scale`, seeded."""
        scale = init_scale(mean_count, self.n_topics)
        c = np.abs(self._rng.standard_normal((self.n_topics, n_words))) * scale
        self._C = torch.tensor(c, dtype=torch.float32, device=self.device, requires_grad=True)
        self.critic_ = None
        if self.mi_weight > 0:
            with torch.random.fork_rng(devices=[]):  # seed the critic, leave the global RNG be
                torch.manual_seed(self.random_state)
                self.critic_ = SmileCritic(n_words, self.n_topics, self.critic_hidden)
            self.critic_.to(self.device)
        self._opt = None
        return self

    def get_arrays(self, critic: bool = True) -> dict[str, np.ndarray]:
        """C (``"components"``) and, with the MI term and ``critic``, the critic
        (``"critic.*"``) as named float32 arrays (copies): what a worker sends. H is never
        among them."""
        out = {COMPONENTS: self.components_.astype(np.float32)}
        if critic and self.critic_ is not None:
            out.update({CRITIC_PREFIX + k: v.detach().cpu().numpy().copy()
                        for k, v in self.critic_.state_dict().items()})
        return out

    def set_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Load C (and the critic) from named arrays, e.g. the global model just received.

        Without ``"critic.*"`` arrays the model keeps its own critic (a fresh one if it had
        none): the ``critic_aggregation: local`` case. The optimizer state of C and the critic
        starts afresh (its moments described another trajectory); H's, which only this model
        ever touches, is kept.
        """
        comp = np.asarray(arrays[COMPONENTS], dtype=np.float32)
        if comp.ndim != 2 or comp.shape[0] != self.n_topics:
            raise ValueError(f"components: shape {comp.shape}, expected ({self.n_topics}, V)")
        if self._C is None or tuple(self._C.shape) != comp.shape:
            self.initialize(comp.shape[1])
        with torch.no_grad():
            self._C.copy_(torch.tensor(comp))  # a copy: arrays off the wire are read-only
        state = {k[len(CRITIC_PREFIX):]: torch.as_tensor(np.array(v, copy=True))
                 for k, v in arrays.items() if k.startswith(CRITIC_PREFIX)}
        if self.critic_ is not None and state:
            self.critic_.load_state_dict(state, strict=True)
        self._opt = None

    def local_state(self) -> dict[str, Any]:
        """What a worker's model carries from one round to the next, as a state tree
        (:mod:`common.state`): its own H and H's optimizer, the critic (which stays here with
        ``critic_aggregation: local``), C as last loaded (so that loading the next round's C
        does not draw a fresh one), the generators and the step count. C's and the critic's
        optimizers start afresh every round (:meth:`set_arrays`) and are not kept."""
        return {"components": self._C, "critic": None if self.critic_ is None
                else self.critic_.state_dict(),
                "doc_topic": None if self._H is None else self._H.weight,
                "doc_topic_optimizer": None if self._opt_h is None else self._opt_h.state_dict(),
                "shuffle": generator_state(self._gen), "rng": generator_state(self._rng),
                "n_steps": self.n_steps_}

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`local_state` returned."""
        set_generator_state(self._gen, state["shuffle"])
        set_generator_state(self._rng, state["rng"])
        self.n_steps_ = int(state["n_steps"])
        self._C, self.critic_, self._opt = None, None, None
        if state["components"] is not None:
            comp = state["components"].to(torch.float32)
            self._C = comp.to(self.device).requires_grad_(True)
        if state["critic"] is not None:
            with torch.random.fork_rng(devices=[]):  # its draws are overwritten at once
                self.critic_ = SmileCritic(self._C.shape[1], self.n_topics, self.critic_hidden)
            self.critic_.load_state_dict(state["critic"])
            self.critic_.to(self.device)
        self._H, self._opt_h = None, None
        if state["doc_topic"] is not None:
            h = state["doc_topic"]
            self._H = nn.Embedding(h.shape[0], self.n_topics, sparse=True).to(self.device)
            with torch.no_grad():
                self._H.weight.copy_(h)
        if state["doc_topic_optimizer"] is not None:
            cls = torch.optim.SparseAdam if self.optimizer == "adam" else torch.optim.SGD
            self._opt_h = cls(self._H.parameters(), lr=self.lr)
            self._opt_h.load_state_dict(state["doc_topic_optimizer"])

    def _check_keeps_scale(self) -> None:
        # its MI step on H is a plain gradient step at lr B, which only matches plain SGD
        if self.mi_weight > 0 and self.mi_keeps_scale and self.optimizer != "sgd":
            raise ValueError("mi_keeps_scale=True needs optimizer='sgd' (pass "
                             "mi_keeps_scale=False to train the MI term with adam)")

    def _init_doc_topic(self, n_docs: int, mean_count: float) -> None:
        h = np.abs(self._rng.standard_normal((n_docs, self.n_topics)))
        h *= init_scale(mean_count, self.n_topics)
        self._H = nn.Embedding(n_docs, self.n_topics, sparse=True).to(self.device)
        with torch.no_grad():
            self._H.weight.copy_(torch.from_numpy(h.astype(np.float32)))
        self._opt_h = None

    def _optimizers(self) -> None:
        if self._opt is None:
            cls = torch.optim.Adam if self.optimizer == "adam" else torch.optim.SGD
            self._opt = cls([self._C], lr=self.lr)
            if self.critic_ is not None:
                self._opt_c = cls(self.critic_.parameters(), lr=self.critic_lr or self.lr)
        if self._opt_h is None:
            cls = torch.optim.SparseAdam if self.optimizer == "adam" else torch.optim.SGD
            self._opt_h = cls(self._H.parameters(), lr=self.lr)

    # -- scikit-learn style -----------------------------------------------------------------
    def fit(self, X: sp.spmatrix | np.ndarray, epochs: int | None = None,
            doc_topic: np.ndarray | None = None, proximal_mu: float = 0.0) -> SGDNMF:
        """Run ``epochs`` (default ``self.epochs``) passes of mini-batch training on X.

        Parameters
        ----------
        X : sparse or dense matrix of shape (n_docs, n_words)
            Word counts.
        epochs : int or None, default None
        doc_topic : array of shape (n_docs, n_topics) or None, default None
            Initial H (non-negative); default: H of the previous call if it had n_docs
            documents, else random.
        proximal_mu : float, default 0.0
            FedProx: ``μ/2 · ‖C − C_start‖²`` joins the loss, C_start the topics this call
            started from. H is the worker's own and is not held back; nor is the critic,
            whose gradient the MI step rescales.
        """
        self._check_keeps_scale()  # mi_weight may have been set since __init__
        X = sp.csr_matrix(X, dtype=np.float32)
        n, v = X.shape
        mean = float(X.sum()) / max(n * v, 1)
        if self._C is None or self.n_words != v:
            self.initialize(v, mean)
        if doc_topic is not None:
            doc_topic = np.asarray(doc_topic, dtype=np.float32)
            if doc_topic.shape != (n, self.n_topics) or (doc_topic < 0).any():
                raise ValueError(f"doc_topic: expected non-negative ({n}, {self.n_topics})")
            self._init_doc_topic(n, mean)
            with torch.no_grad():
                self._H.weight.copy_(torch.from_numpy(doc_topic))
        elif self._H is None or self._H.num_embeddings != n:
            self._init_doc_topic(n, mean)
        self._optimizers()
        anchor = anchor_of([self._C], proximal_mu)
        lam = self.mi_weight
        for _ in range(self.epochs if epochs is None else epochs):
            order = torch.randperm(n, generator=self._gen)
            total, mi_sum, mi_batches = 0.0, 0.0, 0
            for start in range(0, n, self.batch_size):
                idx = order[start:start + self.batch_size]
                b = len(idx)
                xb = torch.from_numpy(X[idx.numpy()].toarray()).to(self.device)
                ids = idx.to(self.device)
                hb = self._H(ids)
                recon = ((xb - hb @ self._C) ** 2).sum(dim=1).mean()
                loss = recon
                use_mi = self.critic_ is not None and lam > 0 and b >= 2
                apart = use_mi and self.mi_keeps_scale
                if use_mi:
                    # apart: the bound's gradient on h collects in h_mi.grad, not in H's
                    h_mi = hb.detach().requires_grad_(True) if apart else hb
                    mi = self.critic_.bound(*_critic_inputs(xb, h_mi), self.tau)
                    loss = recon - lam * mi
                if anchor is not None:
                    loss = loss + proximal_term([self._C], anchor, proximal_mu)
                self._opt.zero_grad(set_to_none=True)
                self._opt_h.zero_grad(set_to_none=True)
                if use_mi:
                    self._opt_c.zero_grad(set_to_none=True)
                loss.backward()
                if use_mi:
                    for p in self.critic_.parameters():
                        p.grad.div_(lam)
                    mi_sum += float(mi.detach())
                    mi_batches += 1
                self._H.weight.grad.mul_(b)  # each row: its own document's term
                self._opt.step()
                self._opt_h.step()
                if use_mi:
                    self._opt_c.step()
                with torch.no_grad():
                    self._C.clamp_(min=0)
                    h = self._H.weight[ids].clamp(min=0)
                    if apart:
                        h = _step_keeping_sums(h, h_mi.grad.mul_(-b * self.lr))
                    self._H.weight[ids] = h
                self.n_steps_ += 1
                total += float(recon.detach()) * b
            self.last_loss_ = total / max(n, 1)
            self.last_mi_ = mi_sum / mi_batches if mi_batches else float("nan")
        return self

    def transform(self, X: sp.spmatrix | np.ndarray) -> np.ndarray:
        """H of (new) documents with C fixed: min ||X - H C||^2 over H >= 0.

        Solved for all documents at once by scikit-learn's coordinate-descent NMF solver
        (``non_negative_factorization`` with ``update_H=False``).

        Returns
        -------
        numpy.ndarray of shape (n_docs, n_topics), float32
        """
        X = sp.csr_matrix(X, dtype=np.float32)
        if X.shape[0] == 0:
            return np.zeros((0, self.n_topics), dtype=np.float32)
        H, _, _ = non_negative_factorization(
            X, H=self.components_.astype(np.float32), n_components=self.n_topics,
            update_H=False, solver="cd", max_iter=self.transform_max_iter, tol=1e-4)
        return H.astype(np.float32, copy=False)

    def reconstruction_loss(self, X: sp.spmatrix | np.ndarray,
                            doc_topic: np.ndarray | None = None) -> float:
        """Mean ||x - h C||^2 per document; H from :meth:`transform` unless given."""
        X = sp.csr_matrix(X, dtype=np.float64)
        if X.shape[0] == 0:
            return float("nan")
        H = self.transform(X) if doc_topic is None else doc_topic
        return reconstruction_loss(X, H, self.components_)

    def get_topics(self, vocab: Sequence[str], n: int = 10) -> list[list[str]]:
        """Each topic's ``n`` heaviest words."""
        return top_words(self.components_, vocab, n)


# hand-written: the scale-keeping MI step on H (mi_keeps_scale), specific to this model
def _step_keeping_sums(h: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[h + step]+ rescaled, per row, to h's sum (rows whose step zeroes them stay zero)."""
    moved = (h + step).clamp(min=0)
    before, after = h.sum(dim=1, keepdim=True), moved.sum(dim=1, keepdim=True)
    return moved * torch.where(after > 0, before / after.clamp(min=1e-12),
                               torch.zeros_like(after))


# hand-written: row proportions with an eps floor on H; sklearn's normalize has no floor
def _critic_inputs(x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the critic scores: word proportions and topic proportions.

    On raw weights the bound can be raised without end by inflating H (the critic separates
    documents better the larger their weights), which then fights the reconstruction; measured
    on stackoverflow, H's norm doubled within a few epochs and the loss rose. Proportions take
    that direction away. ``eps`` keeps the map smooth (its gradient below 1/eps) for rows of H
    near zero.
    """
    return (x / x.sum(dim=1, keepdim=True).clamp(min=1.0),
            h / (h.sum(dim=1, keepdim=True) + PROPORTION_EPS))


# hand-written: ||X - HC||^2 without the dense product; sklearn's _beta_divergence is private
def reconstruction_loss(X: sp.spmatrix | np.ndarray, doc_topic: np.ndarray,
                        components: np.ndarray) -> float:
    """Mean squared reconstruction error per document, ||X - H C||_F^2 / n_docs, computed
    without forming the dense n_docs x n_words product:
    ||X||^2 - 2 <X, H C> + ||H C||^2, with <X, H C> = sum((X C^T) * H)."""
    X = sp.csr_matrix(X, dtype=np.float64)
    H = np.asarray(doc_topic, dtype=np.float64)
    C = np.asarray(components, dtype=np.float64)
    xx = float(X.multiply(X).sum())
    cross = float(np.sum(np.asarray(X @ C.T) * H))
    hh = float(np.sum((H.T @ H) * (C @ C.T)))
    return max(xx - 2 * cross + hh, 0.0) / X.shape[0]


def heldout_scores(model: SGDNMF, x_train: sp.spmatrix, y_train: np.ndarray,
                   x_test: sp.spmatrix, y_test: np.ndarray, random_state: int = 0
                   ) -> dict[str, float]:
    """A topic model's scores on held-out documents, what a worker reports each round.

    ``loss``: mean reconstruction error per test document, H solved with the topics fixed.
    ``macro_f1``, ``accuracy``: :func:`common.eval.topics.svm_scores` on topic weights
    solved with the topics fixed for both the training and the test documents (so both come
    from the same map); absent when fewer than two classes are there to train on.
    """
    h_test = model.transform(x_test)
    out = {"loss": model.reconstruction_loss(x_test, h_test)}
    out.update(svm_scores(model.transform(x_train), y_train, h_test, y_test, random_state))
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}
