"""FSTC clustering, worker side: local k-means for the k-FED start, local training against the
global centres, hard centres and counts each round, the head once at the end.

Clustering is transductive and unsupervised: a worker trains on all its documents (its train
and test rows: no label is read in training, so holding rows out protects nothing) and scores
the clustering of all of them against their labels (ACC, NMI, macro-F1 after the Hungarian
mapping).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from sklearn.metrics import normalized_mutual_info_score
from threadpoolctl import threadpool_limits

from common.config import ClusterConfig, build_params
from common.constants import FAR_FROM_START_NMI
from common.data.reading import DataError
from common.data.shards import LocalData, sentence_features
from common.models.fstc import (
    CENTERS,
    COUNTS,
    FSTCClusterer,
    FSTCParams,
    centers_as_sum,
    score_clustering,
    size_signals,
)
from common.models.kfed import local_kmeans
from worker.families.base import ClientFamily, FitResult

log = logging.getLogger("fedctl.worker")

class FSTCClient(ClientFamily):
    """Worker side of ``model: {family: fstc}``."""

    name = "fstc"
    sent_in_the_clear = ("each worker's k-means centres with their counts (init: kfed; a "
                         "centre of one document is its embedding)",)

    def __init__(self, cfg: ClusterConfig, data: LocalData, device: str, seed: int) -> None:
        super().__init__(cfg, data, device, seed)
        self.params = build_params(FSTCParams, cfg.family_params, f"{cfg.source}: model")
        self.rows = np.sort(np.concatenate([data.train_index, data.test_index]))
        X = sentence_features(cfg, data.dataset, device=device, progress=True)
        self.features = np.ascontiguousarray(X[self.rows])
        # The texts stay on the worker: the fine-tuned encoder reads them, and the neighbour
        # term finds its pairs on Φ joined with their local LSA (neighbor_lsa_dims).
        self.texts = [data.dataset.texts[i] for i in self.rows]
        self.inputs: Any = self.features if self.params.encoder == "frozen" else self.texts
        # For scoring only; without labels the scores are the clusters' sizes.
        self.y = data.y[self.rows] if data.labelled else None
        self.n_clusters = self.params.n_clusters or len(data.classes)
        if self.n_clusters < 2:
            raise DataError(f"{data.dataset.path}: no labels to count the clusters by: set "
                            f"model.n_clusters")
        self.model: FSTCClusterer | None = None
        self.start_labels_: np.ndarray | None = None  # the clusters of the k-FED start
        # torch pays a one-off cost on its first training step; pay it before joining, so it
        # does not count as round 1's training time.
        warm = FSTCClusterer(2, iterations=1, batch_size=8, random_state=seed)
        warm.fit(self.features[:16])

    @property
    def n_samples(self) -> int:
        return len(self.rows)

    def _new_model(self) -> FSTCClusterer:
        return self.params.clusterer(self.n_clusters, self.cfg.rounds * self.params.iterations,
                                     random_state=self.seed, device=self.device)

    def registration_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"n_clusters": self.n_clusters,
                                "dim": int(self.features.shape[1])}
        if self.params.init == "kfed":
            # k-FED's one message: K local centres and their sizes (K × 384 floats), no row.
            # One thread: k-means on a worker's few thousand rows only spins a thread pool.
            with threadpool_limits(1):
                centers, counts = local_kmeans(self.features, self.n_clusters,
                                               random_state=self.seed)
            info["centers"] = centers.astype(np.float32).tolist()
            info["counts"] = counts.tolist()
        return info

    def setup(self, setup: Mapping[str, Any]) -> None:
        self.n_clusters = int(setup["n_clusters"])
        self.model = self._new_model()

    def local_state(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        return {**self.model.local_state(), "start_labels": self.start_labels_}

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        if self.model is not None and state:
            self.model.load_local_state(state)
            self.start_labels_ = state.get("start_labels")

    def fit(self, round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
            ) -> FitResult:
        assert self.model is not None, "setup() first"
        if self.model.head_ is None:
            # Round 1 carries the master's initial head; a worker joining later starts from the
            # nearest-centre head of the global centres it receives.
            if "head.weight" in arrays:
                self.model.set_arrays(arrays)
            else:
                self.model.init_from_centers(arrays[CENTERS])
        if self.start_labels_ is None:
            self.start_labels_ = self.model.predict(self.inputs)
        t0 = time.perf_counter()
        self.model.fit(self.inputs, np.asarray(arrays[CENTERS]), texts=self.texts)
        train_time = time.perf_counter() - t0
        out = {CENTERS: self.model.cluster_centers_, COUNTS: self.model.counts_}
        if meta.get("final"):
            out.update(self.model.get_arrays())
        h = self.model.history_[-1]
        # The head's own clusters (argmax P) against the sizes the transport asks for.
        predicted = self.model.predicted_counts_
        sizes = size_signals(predicted, getattr(self.model, "marginal_", None))
        log.info("round %d: cluster sizes' entropy %.2f of its most (largest %.1f %%), %.2f "
                 "(total variation) from the transport's %s marginal", round_,
                 sizes["size_entropy"], 100 * predicted.max() / max(predicted.sum(), 1),
                 sizes["marginal_gap"], self.params.marginal)
        return FitResult(out, self.n_samples,
                         {"train_loss": h["loss"], "loss_c": h["loss_c"],
                          "loss_align": h["loss_align"], "loss_neighbor": h["loss_neighbor"],
                          "loss_balance": h["loss_balance"],
                          "kept": h["kept"], "pi": h["pi"], **sizes,
                          "train_time": train_time})

    def secure_vector(self, arrays: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray],
                      n_samples: int, n_max: int, clip: float) -> tuple[np.ndarray, float]:
        """Eq. 16 as a sum: each centre weighted by its count over ``n_max``, then those
        weights; in the final round the head weighted by ``n_samples / n_max``, then that
        weight (what ``master.families.fstc.FSTCServer.secure_result`` reads back)."""
        return centers_as_sum(arrays, n_samples, n_max, clip)

    def final_scores(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                     ) -> dict[str, float]:
        """:meth:`evaluate`, and how far the final clusters are from the k-FED start
        (``start_nmi``, no labels needed), with a warning when they are far."""
        if self.start_labels_ is None or "head.weight" not in arrays:
            return self.evaluate(meta, arrays)
        # What evaluate() scores, from one prediction of the final model that serves both.
        final = self._new_model().set_arrays(arrays).predict(self.inputs)
        scores = {**score_clustering(self.y, final), **self._local_scores()}
        nmi = float(normalized_mutual_info_score(self.start_labels_, final))
        scores["start_nmi"] = nmi
        if nmi < FAR_FROM_START_NMI:
            log.warning("FSTC's final clusters agree with its k-FED start at NMI %.2f only: it "
                        "moved far from it, which on unequal clusters has meant worse clusters "
                        "(docs/FSTC.md); compare with the local-only baseline", nmi)
        return scores

    def evaluate(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
        """The payload's clustering of this worker's documents: by its head when it carries one
        (round 1's initialization, the final model), else by the nearest global centre. While
        training, also this worker's own head (``local_*``)."""
        if "head.weight" in arrays:
            scores = self._new_model().set_arrays(arrays).score(self.inputs, self.y)
        else:
            H = self.model.transform(self.inputs) if self.model is not None else self.features
            C = np.asarray(arrays[CENTERS], dtype=np.float32)
            d2 = (H**2).sum(1)[:, None] - 2 * H @ C.T + (C**2).sum(1)[None, :]
            scores = score_clustering(self.y, d2.argmin(axis=1))
        return {**scores, **self._local_scores()}

    def _local_scores(self) -> dict[str, float]:
        """While training, this worker's own head's scores (``local_*``)."""
        if self.model is None or self.model.head_ is None:
            return {}
        local = self.model.score(self.inputs, self.y)
        return {f"local_{k}": local[k] for k in ("accuracy", "nmi") if k in local}

    def local_baseline(self) -> dict[str, float]:
        """The same model and budget (rounds × iterations) on this worker's documents alone:
        local k-means start, no global centres."""
        model = self.params.clusterer(self.n_clusters, random_state=self.seed,
                                      device=self.device,
                                      iterations=self.cfg.rounds * self.params.iterations)
        model.fit(self.inputs, texts=self.texts)
        return model.score(self.inputs, self.y)
