"""FSTC clustering, master side: the k-FED start, the count-weighted centre aggregation (eq. 16)
each round, and the sample-weighted average of the client models at the end.

What travels:

* ``register.info``: ``n_clusters``, ``dim`` and, for ``init: kfed``, the worker's local k-means
  centres (K lists of ``dim`` floats) and their sizes.
* round 1: ``centers`` (K × dim, the k-FED or pooled k-means centres) and the initial head
  ``head.weight`` / ``head.bias``; rounds 2…R: ``centers`` only. ``meta.final`` is true in the
  last round.
* updates: ``centers`` and ``counts`` (K) every round; in the final round also the worker's
  model (``head.*``, and ``encoder.*`` when fine-tuned).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.cluster import KMeans

from common.aggregate import weighted_average
from common.config import ClusterConfig, ConfigError, build_params
from common.data.shards import LocalData, local_data, sentence_features, simulated
from common.models.fstc import (
    CENTERS,
    COUNTS,
    MAX_CLUSTERS,
    FSTCClusterer,
    FSTCParams,
    aggregate_centers,
    centers_from_sum,
    centers_size,
)
from common.models.kfed import combine_centers
from common.net import errors
from common.net.wire import ProtocolError
from master.families.base import Payload, ServerFamily
from master.screening import aggregate_problem, distance, norm, outliers
from master.strategies import ClientResult, Strategy

log = logging.getLogger("fedctl.master")

#: Largest magnitude of a k-FED centre's coordinate: sentence embeddings are under 1, and the
#: nearest-centre head's bias, -|c|^2 / 2 tau, stays finite in float32 far beyond this.
MAX_COORDINATE = 1e6


#: How many times the workers' lower median of their largest k-FED centre's norm a worker's
#: largest may be before its centres are left out of the start. A centre is a mean of its
#: worker's representations, so honest ones stay near each other's norms (0.24 to 0.66 in
#: the example's unit embeddings; a one-document cluster's is 1). One worker's six centres of
#: norm 3.9, one document each, took 4 of the 6 global clusters, and training went NaN on
#: every worker (review).
KFED_NORM_FACTOR = 3.0


#: How many times the round's lower median distance a final head may be from the
#: nearest-centre head of the last centres: every worker's came from the same number of Adam
#: steps (4.20, 4.11 and 4.17 in the review's honest run), so the general factor (20) let a
#: bias that still took every document into one cluster through.
HEAD_OUTLIER_FACTOR = 4.0


#: A worker's counts are its documents' (soft) assignments, summing to its documents; float32
#: sums may pass that by rounding.
COUNT_SLACK = 1e-3


def _far_kfed_centres(registrations: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The workers whose largest non-empty k-FED centre's norm is past
    :data:`KFED_NORM_FACTOR` times the workers' lower median of theirs -> why; none with fewer
    than three workers (of two, the lower median is either one's: a hostile member's tiny
    centres would put the honest one's out)."""
    largest = {}
    for wid, info in registrations.items():
        centers = np.asarray(info["centers"], dtype=np.float64)
        held = np.asarray(info["counts"]) > 0
        largest[wid] = float(np.linalg.norm(centers[held], axis=1).max()) if held.any() else 0.0
    if len(largest) < 3:
        return {}
    ordered = sorted(largest.values())
    reference = ordered[(len(ordered) - 1) // 2]
    return {w: (f"its largest centre's norm, {n:.3g}, is over {KFED_NORM_FACTOR:g} times "
                f"{reference:.3g}, the workers' lower median (KFED_NORM_FACTOR)")
            for w, n in largest.items() if n > KFED_NORM_FACTOR * reference}


def _counts_within(result: ClientResult) -> np.ndarray:
    """A result's counts, scaled down to sum to its ``n_samples`` where that is less: the
    weight caps (``max_weight_fraction``) lower ``n_samples``, and eq. 16 weighs each centre
    by its count, so unscaled counts would escape the cap."""
    counts = result.arrays[COUNTS]
    total = float(np.asarray(counts, dtype=np.float64).sum())
    if total <= result.n_samples:
        return counts  # as it came (an honest worker's: its documents' count exactly)
    return (counts * (result.n_samples / total)).astype(counts.dtype)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class FSTCServer(ServerFamily):
    """Master side of ``model: {family: fstc}``.

    The ``strategy`` of cluster.yaml is not used: centres are combined by eq. 16 and the final
    models by their sample counts, as the paper prescribes.
    """

    transductive = True

    name = "fstc"
    dp_sgd_refusal = ("its loss ties the documents of a batch together through the transport's "
                      "pseudo-labels")
    client_dp_refusal = "its uploads are cluster centres and counts, combined by eq. 16"
    own_rule = ("the paper's eq. 16 combines the centres; each worker's head stays its own "
                "until the final sample-weighted average, so FedProx has no global head to "
                "keep it near")
    info_fields = frozenset({"n_clusters", "dim", "centers", "counts"})
    embeds_text = True

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        super().__init__(cfg, strategy)
        self.params = build_params(FSTCParams, cfg.family_params, f"{cfg.source}: model")
        self._encoder_shapes: dict[str, tuple[int, ...]] | None = None  # _encoder_form's
        if self.params.encoder == "finetune":
            # Read now, not at the final round: loading the encoder takes seconds, which the
            # master's loop must not stop for while workers wait (and heartbeats count).
            try:
                self._encoder_form()
            except Exception as exc:  # sentence-transformers' many errors
                raise ConfigError(f"{cfg.source}: model.encoder: finetune: the master reads the "
                                  f"bundled encoder's arrays to check the final updates, and "
                                  f"could not load it ({type(exc).__name__}: {exc})") from None
        if self.params.init == "pooled" and not simulated(cfg):
            raise ConfigError(f"{cfg.source}: model.init: 'pooled' clusters every worker's "
                              "representations on the master, which only a simulated cluster "
                              "(workers sharing data.path) can do; use 'kfed'")

    def check_shards(self, shards: Mapping[str, LocalData]) -> None:
        """More clusters than any worker has documents is refused: each worker
        clusters its own documents (k-FED's k-means clips K to them), and K = 3,000 for 1,197
        documents a worker passed check, then spent rounds past their deadline, saying
        nothing."""
        k = self.params.n_clusters
        # (transductive: a worker clusters all its documents, its test share too)
        sizes = {w: len(d.train_index) + len(d.test_index) for w, d in shards.items()}
        most = max(sizes, key=lambda w: sizes[w], default=None)
        if k and most is not None and k > sizes[most]:
            raise ConfigError(f"{self.cfg.source}: model.n_clusters: {k}, more than any "
                              f"worker's documents (the most: {sizes[most]}, {most}): fewer "
                              f"clusters, or fewer workers")

    # ------------------------------------------------------------------ joining
    def check_info(self, info: Mapping[str, Any]) -> None:
        k, dim = info.get("n_clusters"), info.get("dim")
        if not _count(k) or not 2 <= k <= MAX_CLUSTERS:
            raise ProtocolError(f"register.info.n_clusters: expected a cluster count from 2 "
                                f"to {MAX_CLUSTERS:,}", code=errors.BAD_FIELD)
        if not _count(dim) or not 0 < dim <= 1 << 16:
            raise ProtocolError("register.info.dim: expected a feature count",
                                code=errors.BAD_FIELD)
        if self.params.init != "kfed":
            return
        centers, counts = info.get("centers"), info.get("counts")
        if (not isinstance(centers, list) or not 0 < len(centers) <= k
                or not all(isinstance(c, list) and len(c) == dim for c in centers)
                or not all(_number(x) for c in centers for x in c)):  # not bytes numpy reads
            raise ProtocolError(f"register.info.centers: expected at most {k} lists of {dim} "
                                "numbers", code=errors.BAD_FIELD)
        if (not isinstance(counts, list) or len(counts) != len(centers)
                or not all(_count(n) and n >= 0 for n in counts) or sum(counts) < 1):
            raise ProtocolError("register.info.counts: expected one count per centre",
                                code=errors.BAD_FIELD)
        try:
            arr = np.asarray(centers, dtype=np.float64)
        except (TypeError, ValueError):
            raise ProtocolError("register.info.centers: expected numbers",
                                code=errors.BAD_FIELD) from None
        if not np.isfinite(arr).all():
            raise ProtocolError("register.info.centers: NaN or Inf", code=errors.BAD_FIELD)
        if np.abs(arr).max() > MAX_COORDINATE:
            raise ProtocolError(f"register.info.centers: a coordinate past {MAX_COORDINATE:g}",
                                code=errors.BAD_FIELD)

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        ks = {int(info["n_clusters"]) for info in registrations.values()}
        dims = {int(info["dim"]) for info in registrations.values()}
        if len(ks) != 1 or len(dims) != 1:
            raise ProtocolError(f"workers disagree on K {sorted(ks)} or the feature size "
                                f"{sorted(dims)}", code=errors.REJECTED)
        (k,), (dim,) = ks, dims
        if self.params.init == "kfed":
            far = _far_kfed_centres(registrations)
            for wid, why in far.items():
                log.warning("fstc: %s's k-FED centres are left out of the start: %s", wid, why)
            infos = [i for w, i in registrations.items() if w not in far]
            centers = combine_centers([np.asarray(i["centers"]) for i in infos],
                                      [np.asarray(i["counts"]) for i in infos], k,
                                      random_state=self.cfg.seed)
        else:
            centers = self._pooled_kmeans(k)
        centers = centers.astype(np.float32)
        head = FSTCClusterer(k, temperature=self.params.temperature).init_from_centers(centers)
        start = {CENTERS: centers, **head.get_arrays()}
        if not all(np.isfinite(a).all() for a in start.values()):  # never published
            raise ProtocolError("the k-FED start is not finite in float32",
                                code=errors.REJECTED)
        self.setup_info_ = {"n_clusters": k, "dim": dim}
        self.global_ = Payload({"final": self.cfg.rounds == 1}, start)
        log.info("fstc: %d clusters of %d-d representations, %s start from %d worker(s), "
                 "variant %s", k, dim, self.params.init,
                 len(infos) if self.params.init == "kfed" else len(registrations),
                 self.params.variant)
        return self.global_

    # Read off setup_info_, which checkpoints keep: a resumed master knows K and the feature
    # size without a new pre-training exchange.
    @property
    def n_clusters(self) -> int:
        return int(self.setup_info_.get("n_clusters", 0))

    @property
    def dim(self) -> int:
        return int(self.setup_info_.get("dim", 0))

    def _pooled_kmeans(self, k: int) -> np.ndarray:
        """The paper's start: k-means on every worker's representations (simulation only)."""
        shards = [local_data(self.cfg, w.name) for w in self.cfg.workers]
        X = sentence_features(self.cfg, shards[0].dataset)
        rows = np.concatenate([np.concatenate([s.train_index, s.test_index]) for s in shards])
        return KMeans(k, n_init=10, random_state=self.cfg.seed).fit(X[rows]).cluster_centers_

    def admit(self, worker_id: str, info: Mapping[str, Any]) -> None:
        if info.get("n_clusters") != self.n_clusters or info.get("dim") != self.dim:
            raise ProtocolError(f"K={info.get('n_clusters')}, dim={info.get('dim')} but the "
                                f"model has K={self.n_clusters}, dim={self.dim}",
                                code=errors.REJECTED)

    # ------------------------------------------------------------------ rounds
    def check_update(self, arrays: Mapping[str, np.ndarray]) -> None:
        """``centers`` (K × dim) and ``counts`` (K), float32; the model's arrays (``head.*``,
        ``encoder.*``) may come along, as float32 and finite."""
        k, dim = self.n_clusters, self.dim
        expect = {CENTERS: (k, dim), COUNTS: (k,), "head.weight": (k, dim), "head.bias": (k,)}
        for name in (CENTERS, COUNTS):
            if name not in arrays:
                raise ProtocolError(f"update without {name!r}", code=errors.SHAPE)
        for name, a in arrays.items():
            if name not in expect and not name.startswith("encoder."):
                raise ProtocolError(f"unexpected array {name!r}", code=errors.SHAPE)
            if name.startswith("encoder.") and self.params.encoder != "finetune":
                raise ProtocolError(f"array {name!r}: the encoder is frozen", code=errors.SHAPE)
            if a.dtype != np.float32:
                raise ProtocolError(f"array {name!r}: dtype {a.dtype}, expected float32",
                                    code=errors.DTYPE)
            if name in expect and a.shape != expect[name]:
                raise ProtocolError(f"array {name!r}: shape {a.shape}, expected "
                                    f"{expect[name]}", code=errors.SHAPE)
            if not np.isfinite(a).all():
                raise ProtocolError(f"array {name!r} holds NaN or Inf", code=errors.NOT_FINITE)
        if arrays[CENTERS].size and np.abs(arrays[CENTERS]).max() > MAX_COORDINATE:
            raise ProtocolError(f"centers: a coordinate past {MAX_COORDINATE:g}",
                                code=errors.BAD_FIELD)
        if (arrays[COUNTS] < 0).any():
            raise ProtocolError("counts must be >= 0", code=errors.REJECTED)
        if ("head.weight" in arrays) != ("head.bias" in arrays):
            raise ProtocolError("head.weight and head.bias come together", code=errors.SHAPE)
        # The model travels up once, in the final round (the worker's fit sends it then):
        # one sent earlier would be published as the global head.
        final = bool(self.global_.meta.get("final"))
        if final != ("head.weight" in arrays) or (not final and len(arrays) > 2):
            raise ProtocolError("the model's arrays (head.*, encoder.*) come with the final "
                                "round's update, and only then", code=errors.SHAPE)
        if final and self.params.encoder == "finetune":
            # Exactly the encoder's own arrays: the average kept the form most members sent,
            # and with two a tie went to the lower id (a hostile w1's made-up form won).
            form = self._encoder_form()
            sent = {n: a.shape for n, a in arrays.items() if n.startswith("encoder.")}
            if sent != form:
                odd = sorted(set(sent) ^ set(form)) or sorted(
                    n for n in sent if sent[n] != form[n])
                raise ProtocolError(f"the encoder's arrays are not the model's ({len(odd)} "
                                    f"differ, e.g. {odd[0]!r})", code=errors.SHAPE)

    def _check_head(self, head: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray],
                    round_: int) -> None:
        """ValueError where the final head is further from the head the workers started
        from than training could take it: past the growth limit times that start (``start``,
        :meth:`_start_head` of the last centres: the start itself is neither kept nor
        checkpointed) and past all its ``round_`` × ``iterations`` Adam steps at
        ``lr_head`` (a start small at a high temperature cannot bound an honest head alone)."""
        size = sum(a.size for a in start.values())
        steps = round_ * self.params.iterations
        reach = norm(start) + ADAM_STEP_BOUND * self.params.lr_head * steps * math.sqrt(size)
        problem = aggregate_problem(start, head)
        if problem is not None and norm(head) > reach:
            raise ValueError(f"the head: {problem}, and past the {reach:.3g} its {steps} Adam "
                             f"steps at lr_head {self.params.lr_head:g} could reach")

    def _start_head(self, centers: np.ndarray) -> dict[str, np.ndarray]:
        """The nearest-centre head of ``centers`` (``head.*``), what a head is measured from."""
        head = FSTCClusterer(self.n_clusters, temperature=self.params.temperature
                             ).init_from_centers(centers).get_arrays()
        return {n: a for n, a in head.items() if n.startswith("head.")}

    def _heads_screened(self, with_model: list[ClientResult], start: Mapping[str, np.ndarray],
                        round_: int) -> list[ClientResult]:
        """The final round's models less those whose head is an outlier (the round's rule,
        :func:`master.screening.outliers`, at :data:`HEAD_OUTLIER_FACTOR`) in its distance
        from ``start``, the last centres' nearest-centre head; with fewer than three, the final
        model's own check (:meth:`_check_head`) alone. The master's own screen measured the
        whole upload against a model of centres alone, counts included: one member of three
        adding 600 to one cluster's bias sent every document to that cluster (NMI 0 for
        all, review)."""
        far = outliers({r.worker_id: distance({n: r.arrays[n] for n in start}, start)
                        for r in with_model}, HEAD_OUTLIER_FACTOR)
        for wid, why in far.items():
            log.warning("round %d: the head of %s is left out of the final model: %s",
                        round_, wid, why)
        kept = [r for r in with_model if r.worker_id not in far]
        if not kept:
            raise ValueError("every final head is an outlier")
        return kept

    def _encoder_form(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the fine-tuned encoder's arrays (``encoder.*``, as a worker's
        FSTCClusterer.get_arrays names them), from the bundled model every worker starts
        from; read once."""
        if self._encoder_shapes is None:
            self._encoder_shapes = dict(_bundled_encoder_form())
        return self._encoder_shapes

    def model_problem(self) -> str | None:
        if "head.weight" in self.global_.arrays:
            return None
        # (a review's hostile k-FED start made every worker's head NaN: refused, and the
        # run ended a success, its model.npz without a head that `fedctl predict` could use)
        return ("no clustering head: every model sent in the final round was refused or left "
                "out (the log says why); model.npz holds the centres alone")

    def declared_documents(self, info: Mapping[str, Any]) -> tuple[str, float] | None:
        return "counts", sum(info["counts"])  # the k-FED start weighs centres by them

    def check_claims(self, arrays: Mapping[str, np.ndarray], n_samples: int) -> None:
        # Eq. 16 weighs each centre by its count: 3,000 claimed by a worker of 10 documents
        # pulled every centre onto its own vector, round after round, under the outlier screen.
        total = float(np.asarray(arrays[COUNTS], dtype=np.float64).sum())
        if total > n_samples * (1 + COUNT_SLACK):
            raise ProtocolError(f"counts sum to {total:.6g}, more than the update's "
                                f"{n_samples} documents", code=errors.BAD_FIELD)

    @classmethod
    def secure_refusal(cls, params: Mapping[str, Any]) -> str | None:
        if params.get("encoder", "frozen") == "finetune":
            return ("a fine-tuned encoder's weights do not fit a clipping range; secure rounds "
                    "take FSTC's centres and head with encoder: frozen")
        return None

    def secure_size(self) -> int:
        return centers_size(self.n_clusters, self.dim, bool(self.global_.meta.get("final")))

    def secure_result(self, total: np.ndarray, n_max: int, members: int,
                      weights_sent: float | None = None, tolerance: float = 0.0
                      ) -> dict[str, np.ndarray]:
        # (Eq. 16's weights are the counts, which no declaration bounds: centres_from_sum
        # refuses what no clipped input can give instead.)
        sa = self.cfg.privacy.secure_aggregation
        assert sa is not None
        return centers_from_sum(total, self.n_clusters, self.dim,
                                bool(self.global_.meta.get("final")), n_max,
                                self.global_.arrays[CENTERS], sa.clip)

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        """Eq. 16 for the centres; the sample-weighted average of the models that came with
        the final round's updates.

        Raises ValueError where the centres, or the final head, grow past the growth limit
        (:func:`master.screening.aggregate_problem`): the master's own check compares whole
        models and would miss them, since the published arrays change from round to round.
        """
        previous = self.global_.arrays[CENTERS]
        centers = aggregate_centers([r.arrays[CENTERS] for r in results],
                                    [_counts_within(r) for r in results], previous=previous)
        arrays: dict[str, np.ndarray] = {CENTERS: centers}
        _check_growth("centres", {CENTERS: previous}, {CENTERS: centers})
        with_model = [r for r in results if "head.weight" in r.arrays]
        if with_model:  # the final round (only its updates carry the model)
            start = self._start_head(previous)
            with_model = self._heads_screened(with_model, start, round_)
            # One form: check_update held each to the head's shapes and the encoder's arrays.
            names = set(with_model[0].arrays) - {CENTERS, COUNTS}
            arrays.update(weighted_average([{n: r.arrays[n] for n in names} for r in with_model],
                                           [r.n_samples for r in with_model]))
            self._check_head({n: arrays[n] for n in ("head.weight", "head.bias")},
                             start, round_)
        self.global_ = Payload({"final": round_ + 1 == self.cfg.rounds}, arrays)
        return self.global_


#: How far Adam moves a coordinate in one step, at most, in learning rates: (1 − β1) / √(1 − β2)
#: ≈ 3.2 at its first, bias-corrected steps, about 1 after.
ADAM_STEP_BOUND = 4.0


def _check_growth(what: str, before: Mapping[str, np.ndarray],
                  after: Mapping[str, np.ndarray]) -> None:
    problem = aggregate_problem(before, after)
    if problem is not None:
        raise ValueError(f"the {what}: {problem}")


@functools.cache
def _bundled_encoder_form() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``encoder.*`` name and shape of each of the bundled encoder's floating arrays, read
    once a process (the master builds several families while it looks for a worker to blame
    at setup, and loading the model takes seconds)."""
    encoder = FSTCClusterer(2, encoder="finetune")._load_encoder()
    return tuple((f"encoder.{k}", tuple(v.shape)) for k, v in encoder.state_dict().items()
                 if v.dtype.is_floating_point)
