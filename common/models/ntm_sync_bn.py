"""Synchronized batch norm for the synchronous neural-topic-model step.

ProdLDA and CombinedTM normalize three things over the mini-batch: the encoder's two outputs
(posterior mean and log-variance, ``bn_mu`` and ``bn_sigma``) and the decoder's logits
(``bn_beta``). A centralized step normalizes the union of the nodes' batches; with batch norm
computed per node, each node normalizes its own, and on label-skewed nodes the federated run
trains a different model (held-out perplexity +5 % on dbpedia_10k; see
``benchmarks/results/ntm_real.md``). Here every batch norm uses the statistics of the union
batch in the forward pass and the union's sums in the backward pass, as PyTorch's
``SyncBatchNorm`` does across GPUs, so that a step over the cluster computes exactly the
gradient of one centralized step over the union batch. Only per-feature sums cross the network;
no document does.

The decoder's input depends on the normalized encoder output and the backward pass runs in the
reverse order, so one step takes five exchanges, each one cluster round:

=====  ================  ================================  ===================================
phase  name              the master publishes              each worker uploads
=====  ================  ================================  ===================================
0      encoder_stats     the weights                       mean, M2 of its encoder outputs (2K)
1      decoder_stats     union mean, variance, size        mean, M2 of its decoder logits (V)
2      decoder_grad      union mean, variance              sum g, sum g*x_hat at the logits (V)
3      encoder_grad      union sums                        the same at the encoder outputs (2K)
4      gradients         union sums                        its share of the parameter gradient
=====  ================  ================================  ===================================

after which the master takes the Adam step and moves the running statistics by the union's
moments. :class:`SyncBNStep` is a worker's side of one step, :class:`SyncBNReducer` the
master's; the cluster families and :func:`common.models.ntm.simulate_sync` both drive them.

Batch norm's backward pass, for ``y = (x - mean) / sqrt(var + eps)`` over the union of ``N``
rows and ``g = dL/dy`` of the union's mean loss, is
``dL/dx = (g - sum(g) / N - y * sum(g * y) / N) / sqrt(var + eps)``: each worker needs only
the two sums over the union.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.aggregate import weighted_average

if TYPE_CHECKING:
    from common.models.ntm import NeuralTopicModel

__all__ = ["PHASES", "N_PHASES", "SyncBNStep", "SyncBNReducer", "merge_moments",
           "moved_running_stats", "sum_uploads", "ABSTAIN"]

PHASES = ("encoder_stats", "decoder_stats", "decoder_grad", "encoder_grad", "gradients")
N_PHASES = len(PHASES)
#: The one array of an upload from a worker that cannot take part in the phase (it holds no
#: state of this step: it restarted, or joined mid-step); the master then redoes the step.
ABSTAIN = "abstain"


# hand-written: float64 mean and M2 for Chan's merge; torch.var_mean gives no M2
def _moments(x: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-feature mean and sum of squared deviations (M2) of the rows, in float64."""
    x64 = x.detach().to(torch.float64)
    mean = x64.mean(0)
    return {"mean": mean.cpu().numpy(), "m2": ((x64 - mean) ** 2).sum(0).cpu().numpy()}


# hand-written: the two sums batch norm's backward needs (what SyncBatchNorm all-reduces)
def _sums(g: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    g64, y64 = g.detach().to(torch.float64), y.detach().to(torch.float64)
    return {"sum_g": g64.sum(0).cpu().numpy(), "sum_gy": (g64 * y64).sum(0).cpu().numpy()}


def _check_published(phase: int, arrays: Mapping[str, np.ndarray], width: int) -> None:
    """Refuse a payload that is not what the master publishes for ``phase``, in one line."""
    names = {1: ("mean", "var", "n"), 2: ("mean", "var"), 3: ("sum_g", "sum_gy"),
             4: ("sum_g", "sum_gy")}.get(phase)
    if names is None:
        raise ValueError(f"phase {phase}: a step has phases 0 to {N_PHASES - 1}")
    for name in names:
        shape = () if name == "n" else (width,)
        if name not in arrays or np.shape(arrays[name]) != shape:
            raise ValueError(f"phase {phase} ({PHASES[phase]}): expected array {name!r} of "
                             f"shape {shape} from the master, got "
                             f"{np.shape(arrays[name]) if name in arrays else 'none'}")


# hand-written: Chan et al.'s merge of (mean, M2, n) summaries; numpy and scipy have none
def merge_moments(uploads: Sequence[Mapping[str, np.ndarray]], sizes: Sequence[int]
                  ) -> dict[str, np.ndarray]:
    """The union's per-feature mean and biased variance (what batch norm normalizes by) from
    each part's mean and M2 (Chan et al.'s pairwise update), and the union's size ``n``."""
    n = np.asarray(sizes, dtype=np.float64)
    means = np.stack([np.asarray(u["mean"], np.float64) for u in uploads])
    total = n.sum()
    mean = n @ means / total
    m2 = sum(np.asarray(u["m2"], np.float64) for u in uploads) + n @ (means - mean) ** 2
    return {"mean": mean, "var": m2 / total, "n": np.asarray(total)}


# hand-written: BatchNorm1d's running-stat update in numpy; torch applies it only in forward
def moved_running_stats(bn: torch.nn.BatchNorm1d, mean: np.ndarray, var: np.ndarray,
                        n: float) -> tuple[np.ndarray, np.ndarray]:
    """``bn``'s running mean and variance after one training batch of ``n`` rows with these
    per-feature ``mean`` and biased ``var``, moved as the layer itself moves them (by its
    momentum, towards the unbiased variance), in the buffers' dtype."""
    m = bn.momentum  # None (a cumulative average) is not used by NTMNet
    rm = bn.running_mean.detach().cpu().numpy()
    rv = bn.running_var.detach().cpu().numpy()
    new_mean = (1 - m) * rm.astype(np.float64) + m * np.asarray(mean, np.float64)
    new_var = (1 - m) * rv.astype(np.float64) + m * np.asarray(var, np.float64) * n / max(n - 1, 1)
    return new_mean.astype(rm.dtype), new_var.astype(rv.dtype)


def sum_uploads(uploads: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Element-wise sums over the uploads, in float64, in the given order."""
    return {k: np.sum([np.asarray(u[k], np.float64) for u in uploads], axis=0)
            for k in uploads[0]}


# hand-written: SyncBatchNorm needs a torch.distributed group; here sums go by cluster rounds
class SyncBNStep:
    """One worker's side of a synchronized-batch-norm step on its mini-batch ``rows``.

    Built at phase 0 from the model holding the global weights; :meth:`upload` then answers
    each phase in turn from what the master published for it. Dropout and the
    reparameterization noise are drawn as in :meth:`NeuralTopicModel.batch_loss`.

    Parameters
    ----------
    model : NeuralTopicModel
        Holds the global weights; its parameters' gradients are overwritten.
    X, ctx, rows, doc_ids, step
        As for :meth:`NeuralTopicModel.gradients`.
    """

    def __init__(self, model: NeuralTopicModel, X: Any, ctx: np.ndarray | None,
                 rows: np.ndarray, doc_ids: np.ndarray | None, step: int) -> None:
        self.model = model
        self.step = step
        self.phase = 0
        self.n_local = len(rows)
        net = model.net_
        model._mode(True)
        for p in model._trainable():
            p.grad = None
        self.bow, c = model._tensors(X, ctx, rows)
        self.eps, self.draws = model._noise(len(rows), doc_ids, step)
        # Both encoder batch norms' inputs side by side: one exchange serves the two.
        self.a = torch.cat(net.encode_unnormalized(self.bow, c, model.noise_,
                                                   self.draws and self.draws.hidden), 1)
        self.loss_ = float("nan")

    # hand-written: batch norm by given statistics, as a leaf whose grad is g; F.batch_norm hides it
    def _normalize(self, x: torch.Tensor, stats: Mapping[str, np.ndarray], eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch norm's output by the union's statistics, as a leaf (its gradient is the
        ``g`` of the backward formula), and 1 / sqrt(var + eps)."""
        t = self.a
        inv = torch.as_tensor(1.0 / np.sqrt(np.asarray(stats["var"]) + eps), dtype=t.dtype,
                              device=t.device)
        # A copy (torch.tensor, not as_tensor): the published arrays are read-only views of
        # the received frames, which torch must not share.
        mean = torch.tensor(np.asarray(stats["mean"]), dtype=t.dtype, device=t.device)
        return ((x.detach() - mean) * inv).requires_grad_(), inv

    # hand-written: batch norm's input gradient from the union's sums, as SyncBatchNorm's backward
    def _backward_input(self, y: torch.Tensor, inv: torch.Tensor,
                        sums: Mapping[str, np.ndarray]) -> torch.Tensor:
        """dL/dx of the rows from their dL/dy (``y.grad``) and the union's sums."""
        t = y.grad
        assert t is not None
        mean_g = torch.as_tensor(np.asarray(sums["sum_g"]) / self.n_union, dtype=t.dtype,
                                 device=t.device)
        mean_gy = torch.as_tensor(np.asarray(sums["sum_gy"]) / self.n_union, dtype=t.dtype,
                                  device=t.device)
        return (t - mean_g - y.detach() * mean_gy) * inv

    def upload(self, phase: int, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What this worker uploads in ``phase``, from the arrays the master published for it
        (the weights, already loaded into the model, in phase 0)."""
        if phase != self.phase:
            raise ValueError(f"phase {phase} out of turn: this step is at phase {self.phase}")
        net = self.model.net_
        k = self.model.n_topics
        if phase > 0:
            _check_published(phase, arrays, 2 * k if phase in (1, 4) else net.beta.shape[1])
        self.phase += 1
        if phase == 0:
            return _moments(self.a)
        if phase == 1:
            self.n_union = float(np.asarray(arrays["n"]))
            self.y1, self.inv1 = self._normalize(self.a, arrays, net.bn_mu.eps)
            mu, logvar = self.y1[:, :k], self.y1[:, k:]
            z = mu + self.eps * torch.exp(0.5 * logvar)
            theta = net._drop(torch.softmax(z, dim=1), self.model.noise_,
                              self.draws and self.draws.theta)
            self.d = theta @ net.beta
            self.kl = net.kl(mu, logvar)
            return _moments(self.d)
        if phase == 2:
            self.y2, self.inv2 = self._normalize(self.d, arrays, net.bn_beta.eps)
            rec = -(self.bow * torch.log_softmax(self.y2, dim=1)).sum(1)
            self.loss_ = float((rec.detach() + self.kl.detach()).mean())
            (rec.sum() / self.n_union).backward()  # only y2 is upstream: y2.grad = g
            return _sums(self.y2.grad, self.y2)
        if phase == 3:
            dd = self._backward_input(self.y2, self.inv2, arrays)
            torch.autograd.backward([self.d, self.kl.sum() / self.n_union], [dd, None])
            return _sums(self.y1.grad, self.y1)
        if phase == 4:
            self.a.backward(self._backward_input(self.y1, self.inv1, arrays))
            # Scaled so that the master's batch-size weighted mean is the sum of the shares.
            scale = self.n_union / self.n_local
            params = dict(net.named_parameters())
            return {n: (params[n].grad * scale).detach().cpu().numpy()
                    for n in self.model.param_names()}
        raise ValueError(f"phase {phase}: a step has phases 0 to {N_PHASES - 1}")


class SyncBNReducer:
    """The master's side of synchronized-batch-norm steps on ``model`` (the global model).

    :meth:`reduce` takes a phase's uploads and returns what the master publishes for the
    next phase; after the last phase it takes the Adam step and returns the new weights.
    """

    def __init__(self, model: NeuralTopicModel) -> None:
        self.model = model
        self.enc_: dict[str, np.ndarray] | None = None
        self.dec_: dict[str, np.ndarray] | None = None

    def expected_upload(self, phase: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Name -> (shape, dtype) of the arrays a worker uploads in ``phase``."""
        k2, v = 2 * self.model.n_topics, self.model.vocab_size_
        f64 = np.dtype(np.float64)
        if phase in (0, 1):
            width = k2 if phase == 0 else v
            return {"mean": ((width,), f64), "m2": ((width,), f64)}
        if phase in (2, 3):
            width = v if phase == 2 else k2
            return {"sum_g": ((width,), f64), "sum_gy": ((width,), f64)}
        params = dict(self.model.net_.named_parameters())
        return {n: (tuple(params[n].shape), np.dtype(self.model.dtype))
                for n in self.model.param_names()}

    def reduce(self, phase: int, uploads: Sequence[Mapping[str, np.ndarray]],
               sizes: Sequence[int]) -> dict[str, np.ndarray]:
        """Uploads of ``phase`` -> the arrays published for phase ``phase + 1`` (after the last
        phase: the new weights and running statistics)."""
        if phase == 0:
            self.enc_ = merge_moments(uploads, sizes)
            return self.enc_
        if phase == 1:
            self.dec_ = merge_moments(uploads, sizes)
            return {k: self.dec_[k] for k in ("mean", "var")}
        if phase in (2, 3):
            return sum_uploads(uploads)
        if phase == 4:
            assert self.enc_ is not None and self.dec_ is not None, "phases 0 and 1 first"
            update = weighted_average(uploads, sizes, accumulate=np.float64)
            update.update(self._running_stats())
            self.model.apply_gradients(update)
            self.enc_ = self.dec_ = None
            return self.model.get_arrays()
        raise ValueError(f"phase {phase}: a step has phases 0 to {N_PHASES - 1}")

    def _running_stats(self, phases: tuple[int, ...] = (0, 1)) -> dict[str, np.ndarray]:
        """Each batch norm's running statistics moved by the union batch's moments, as one
        batch norm over the union would (unbiased variance): those whose moments ``phases``
        merged (0: the encoder's two, 1: the decoder's)."""
        net, k = self.model.net_, self.model.n_topics
        out: dict[str, np.ndarray] = {}
        for phase, name, bn, cols in ((0, "bn_mu", net.bn_mu, slice(0, k)),
                                      (0, "bn_sigma", net.bn_sigma, slice(k, 2 * k)),
                                      (1, "bn_beta", net.bn_beta, slice(None))):
            if phase not in phases:
                continue
            st = self.enc_ if phase == 0 else self.dec_
            assert st is not None, f"phase {phase} first"
            out[f"{name}.running_mean"], out[f"{name}.running_var"] = moved_running_stats(
                bn, st["mean"][cols], st["var"][cols], float(st["n"]))
        return out

    def running_stats_move(self, phase: int) -> tuple[dict[str, np.ndarray],
                                                      dict[str, np.ndarray]]:
        """The running statistics of the batch norms whose moments ``phase`` (0 or 1) merged:
        as they are, and as this step will leave them (for the master's growth check, where a
        member's moments far off would otherwise show only at the step's end)."""
        moved = self._running_stats((phase,))
        buffers = dict(self.model.net_.named_buffers())
        return {n: buffers[n].detach().cpu().numpy() for n in moved}, moved
