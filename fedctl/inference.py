"""Trained models, used without the cluster: ``fedctl.load_model(run)`` and ``fedctl predict``.

A run's folder holds ``model.npz`` (the final global arrays) and ``model.json`` (what they are:
family, hyperparameters, classes or vocabulary, the sentence model that made the features).
:func:`load_model` turns them back into an object with scikit-learn's verbs:

* a classifier (``mlp``): ``predict(texts)`` -> labels, ``predict_proba(texts)``;
* a clusterer (``fstc``): ``predict`` -> clusters, ``predict_proba``;
* a topic model (``nmf``, ``prodlda``, ``combinedtm``, ``lda``, ``sentencelda``):
  ``transform(texts)`` -> each document's topic mixture, ``predict`` -> its top topic,
  ``get_topics(n)`` -> each topic's top words.

Each takes a list of texts (embedded with the run's sentence model, cached as in training) or,
for the families that embed text, an array of features already made by that model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.data.embedding import embed_texts, embedding_identity
from common.data.reading import text_problem
from common.data.text import bow_matrix
from fedctl.errors import one_line
from fedctl.runs import Run, load_run

__all__ = ["TrainedModel", "Classifier", "Clusterer", "TopicModel", "load_model",
           "ModelError"]

Texts = Sequence[str] | np.ndarray


class ModelError(ValueError):
    """A model that cannot be used as asked; the message is one line saying why."""


def _texts(texts: Any) -> list[str]:
    """``texts`` as a list of strings: one string alone is refused, as scikit-learn's text
    vectorizers refuse it (iterated, it would be one document a character)."""
    if isinstance(texts, (str, bytes)):
        raise ModelError("expected a list of texts, got one string: wrap it in a list")
    if isinstance(texts, Mapping):  # iterated, it would be its keys
        raise ModelError(f"expected a list of texts, got a {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ModelError(f"texts[{i}]: expected a string, got {type(t).__name__}")
        if problem := text_problem(t):
            raise ModelError(f"texts[{i}]: {problem}")
    return texts


def _known(bow: Any) -> np.ndarray:
    """Each document's count of known words, from its counts over the vocabulary."""
    return np.asarray(bow.sum(axis=1)).ravel().astype(int)


def _blank(texts: Texts) -> list[bool]:
    """Which documents hold no text at all (features given instead of texts: none): a model
    would still give them a confident label, that of the embedding of nothing."""
    if _is_features(texts):
        return [False] * len(texts)
    return [not t.strip() for t in _texts(texts)]


def _is_features(x: Any) -> bool:
    """A numeric array is features; an array of strings (``np.array(texts)``) is texts."""
    return isinstance(x, np.ndarray) and x.dtype.kind in "biuf"


class TrainedModel(ABC):
    """A run's final model, read back (see the module docstring).

    Attributes
    ----------
    run : Run
        The run folder it comes from.
    family : str
    params : dict
        The family's hyperparameters (the ``model`` section it was trained with).
    keep_embeddings : bool
        Whether the texts' embeddings are kept in the cache (default False: the cache is read,
        not written, or a model called again and again on new texts would leave two files a
        call there for ever; ``fedctl predict`` of a file keeps them, for the next model
        scored on the same documents).
    """

    kind: str = "model"

    def __init__(self, run: Run, device: str = "cpu") -> None:
        self.run = run
        self.family = run.family
        self.params = dict(run.model.get("params") or run.config.family_params)
        self.setup = dict(run.model.get("setup") or {})
        self.device = device
        self.keep_embeddings = False

    # -- input --------------------------------------------------------------------------
    def features(self, texts: Texts, progress: bool = False) -> np.ndarray:
        """Sentence features of ``texts`` by the run's sentence model (cached on disk), or
        ``texts`` itself when it is already a feature array of the right width."""
        expected = self.run.model.get("embedding")
        if _is_features(texts):
            width = self.input_dim
            if texts.ndim != 2 or (width and texts.shape[1] != width):
                raise ModelError(f"features of shape {texts.shape}, but this model takes "
                                 f"{width} per document ({(expected or {}).get('name')})")
            bad = ~np.isfinite(texts).all(axis=1)
            if bad.any():  # else NaN probabilities, in silence
                raise ModelError(f"features: {int(bad.sum())} row(s) hold NaN or infinity "
                                 f"(the first: row {int(np.argmax(bad))})")
            return np.asarray(texts, dtype=np.float32)
        texts = _texts(texts)
        if not texts:
            return np.zeros((0, self.input_dim or 0), dtype=np.float32)
        cfg = self.run.config
        if expected is not None:
            found = embedding_identity(cfg.data.embedding_model)
            if found["sha256"] != expected["sha256"]:
                raise ModelError(f"{self.run.path}: trained on features of {expected['name']} "
                                 f"(sha256 {expected['sha256'][:12]}), but the sentence model "
                                 f"here is {found['name']} (sha256 {found['sha256'][:12]})")
        # The backend the workers embedded with (data.embedding_backend): another one's
        # features differ in the last digits, and its cache entry is another file. The cache
        # is read (a file the cluster trained on costs no embedding), written only where asked.
        features = embed_texts(texts, model_path=cfg.data.embedding_model,
                               cache_dir=cfg.data.cache_dir, device=self.device,
                               progress=progress, backend=cfg.data.embedding_backend,
                               keep=self.keep_embeddings)
        if self.input_dim and features.shape[1] != self.input_dim:  # (a cache file replaced)
            raise ModelError(f"the sentence model gave {features.shape[1]} features a "
                             f"document, this model takes {self.input_dim}")
        return features

    @property
    def input_dim(self) -> int | None:
        """Features per document the model takes, where it takes features."""
        return None

    @abstractmethod
    def records(self, texts: Texts, progress: bool = False) -> list[dict[str, Any]]:
        """One JSON-able record per document: what ``fedctl predict`` writes."""


class Classifier(TrainedModel):
    """The ``mlp`` family: a document classifier on sentence features."""

    kind = "classifier"

    def __init__(self, run: Run, device: str = "cpu") -> None:
        super().__init__(run, device)
        from common.config import build_params
        from common.models.mlp_params import MLPParams

        self.classes_ = list(self.setup["classes"])
        params = build_params(MLPParams, self.params, f"{run.path}/model.json: params")
        self.model_ = params.classifier(int(self.setup["input_dim"]), len(self.classes_),
                                        device=device)
        self.model_.set_arrays(run.arrays)

    @property
    def input_dim(self) -> int:
        return int(self.setup["input_dim"])

    def predict_proba(self, texts: Texts, progress: bool = False) -> np.ndarray:
        """Class probabilities, shape (n_documents, n_classes), columns in ``classes_`` order."""
        return self.model_.predict_proba(self.features(texts, progress))

    def predict(self, texts: Texts, progress: bool = False) -> np.ndarray:
        """Each document's most probable class name (a blank text gets the class of the
        embedding of nothing: :meth:`records` marks it empty instead)."""
        return np.asarray(self.classes_)[self.predict_proba(texts, progress).argmax(axis=1)]

    def records(self, texts: Texts, progress: bool = False) -> list[dict[str, Any]]:
        texts = texts if _is_features(texts) else _texts(texts)  # (read twice: not a generator)
        proba = self.predict_proba(texts, progress)
        return [{"label": None, "proba": None, "empty": True} if blank else
                {"label": self.classes_[int(p.argmax())],
                 "proba": {c: round(float(v), 6) for c, v in zip(self.classes_, p, strict=True)}}
                for p, blank in zip(proba, _blank(texts), strict=True)]


class Clusterer(TrainedModel):
    """The ``fstc`` family: short-text clusters on sentence features."""

    kind = "clusterer"

    def __init__(self, run: Run, device: str = "cpu") -> None:
        super().__init__(run, device)
        from common.config import build_params
        from common.models.fstc import FSTCParams

        params = build_params(FSTCParams, self.params, f"{run.path}/model.json: params")
        if "head.weight" not in run.arrays:
            raise ModelError(f"{run.path}: model.npz holds no clustering head (head.weight)")
        self.n_clusters_ = int(run.arrays["head.weight"].shape[0])
        self.encoder = params.encoder
        self.model_ = params.clusterer(self.n_clusters_, device=device).set_arrays(run.arrays)

    @property
    def input_dim(self) -> int:
        return int(self.run.arrays["head.weight"].shape[1])

    def _inputs(self, texts: Texts, progress: bool) -> Any:
        if self.encoder != "frozen":  # a fine-tuned encoder reads the texts themselves
            if _is_features(texts):
                raise ModelError("this model fine-tuned its encoder: give it texts")
            return _texts(texts)
        return self.features(texts, progress)

    def predict_proba(self, texts: Texts, progress: bool = False) -> np.ndarray:
        """Cluster probabilities, shape (n_documents, n_clusters)."""
        return self.model_.predict_proba(self._inputs(texts, progress))

    def predict(self, texts: Texts, progress: bool = False) -> np.ndarray:
        """Each document's cluster."""
        return self.predict_proba(texts, progress).argmax(axis=1)

    def records(self, texts: Texts, progress: bool = False) -> list[dict[str, Any]]:
        texts = texts if _is_features(texts) else _texts(texts)  # (read twice: not a generator)
        proba = self.predict_proba(texts, progress)
        return [{"cluster": None, "proba": None, "empty": True} if blank else
                {"cluster": int(p.argmax()), "proba": [round(float(v), 6) for v in p]}
                for p, blank in zip(proba, _blank(texts), strict=True)]


class TopicModel(TrainedModel):
    """The topic families: ``nmf``, ``prodlda``, ``combinedtm``, ``lda``, ``sentencelda``."""

    kind = "topics"

    def __init__(self, run: Run, device: str = "cpu") -> None:
        super().__init__(run, device)
        self.vocabulary_ = list(self.setup["vocabulary"])
        self._build()

    def _build(self) -> None:
        from common.config import build_params

        fam = self.family
        where = f"{self.run.path}/model.json: params"
        if fam == "nmf":
            from common.models.nmf import NMFParams
            self.model_ = build_params(NMFParams, self.params, where).model(device=self.device)
            self.model_.set_arrays(self.run.arrays)
        elif fam in ("prodlda", "combinedtm"):
            from common.models.ntm import NTMParams
            self.contextual_size = int(self.setup.get("contextual_size", 0))
            self.model_ = build_params(NTMParams, self.params, where).model(
                self.contextual_size, 0, self.device)
            self.model_.initialize(len(self.vocabulary_)).set_arrays(self.run.arrays)
        else:  # lda, sentencelda: the merged topics, K x V, rows summing to one
            from common.models.lda_mh import TOPICS, LDAParams
            self.lda_params = build_params(LDAParams, self.params, where)
            self.topic_word_ = np.asarray(self.run.arrays[TOPICS], dtype=np.float64)

    @property
    def n_topics(self) -> int:
        return int(self.topic_word().shape[0])

    def topic_word(self) -> np.ndarray:
        """Topics over the vocabulary, shape (n_topics, n_words)."""
        if self.family == "nmf":
            return np.asarray(self.model_.components_, dtype=np.float64)
        if self.family in ("prodlda", "combinedtm"):  # the decoder's weights, as it ranks them
            return self.model_.get_topic_word_matrix()
        return self.topic_word_

    def get_topics(self, n: int = 10) -> list[list[str]]:
        """Each topic's ``n`` most probable words."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ModelError(f"n: expected an integer >= 1, got {n!r}")
        from common.eval.topics import top_words
        return top_words(self.topic_word(), self.vocabulary_, n)

    def transform(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Each document's topic mixture, shape (n_documents, n_topics): the same map the
        workers scored with (NMF: weights with the topics fixed; ProdLDA / CombinedTM: the
        encoder's mean θ; LDA: Gibbs fold-in under the merged topics, seeded by each
        document's words: one document, one answer, whatever the batch). A document with no
        word of the vocabulary (empty, another language) gets the mixture of nothing, the
        prior's (:meth:`predict` gives it -1, :meth:`records` no topic): check
        :meth:`known_words` before using rows as features."""
        if _is_features(texts):
            raise ModelError("a topic model reads texts, not features")
        texts = _texts(texts)
        return self._transform(texts, bow_matrix(texts, self.vocabulary_), progress)

    def _transform(self, texts: list[str], bow: Any, progress: bool) -> np.ndarray:
        """:meth:`transform` of ``texts``, whose counts over the vocabulary ``bow`` are made
        once (predict and records count the known words from it too)."""
        if self.family == "nmf":
            return np.asarray(self.model_.transform(bow))
        if self.family in ("prodlda", "combinedtm"):
            ctx = self.features(texts, progress) if self.contextual_size else None
            return np.asarray(self.model_.transform(bow, ctx))
        from common.models.lda_mh import corpus_from_texts, fold_in
        p = self.lda_params
        return fold_in(self.topic_word_, corpus_from_texts(texts, self.vocabulary_), p.alpha,
                       p.eval_iter, self.run.config.seed, per_document=True)

    def predict(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Each document's most weighted topic; -1 for a document with no word of the
        model's vocabulary (empty, another language), which no topic describes."""
        theta, known, blank = self._read(texts, progress)
        topic = theta.argmax(axis=1)
        topic[~self._placed(known, blank)] = -1
        return topic

    def known_words(self, texts: Sequence[str]) -> np.ndarray:
        """How many of each document's words are in the model's vocabulary."""
        return _known(bow_matrix(_texts(texts), self.vocabulary_))

    def _read(self, texts: Sequence[str], progress: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``transform(texts)``, ``known_words(texts)`` (the texts counted once) and which
        texts are blank."""
        if _is_features(texts):
            raise ModelError("a topic model reads texts, not features")
        texts = _texts(texts)
        bow = bow_matrix(texts, self.vocabulary_)
        return self._transform(texts, bow, progress), _known(bow), np.array(_blank(texts),
                                                                              dtype=bool)

    def _placed(self, known: np.ndarray, blank: np.ndarray) -> np.ndarray:
        """Which documents the model can place: those with a known word; for CombinedTM,
        which reads the document's sentence embedding too, every one with any text (a blank
        one got the topic of the embedding of nothing)."""
        return ~blank if getattr(self, "contextual_size", 0) else known > 0

    def records(self, texts: Texts, progress: bool = False) -> list[dict[str, Any]]:
        theta, known, blank = self._read(texts, progress)
        heads = self.get_topics(5)
        out = []
        for row, n, placed, empty in zip(theta, known, self._placed(known, blank), blank,
                                         strict=True):
            if not placed:  # nothing to go on: no topic, rather than topic 0 at weight 0
                out.append({"topic": None, "mixture": None, "top_topics": [],
                            "known_words": 0, **({"empty": True} if empty else {})})
                continue
            total = float(row.sum())
            mix = row / total if total > 0 else row
            top = np.argsort(-mix)[:3]
            out.append({"topic": int(top[0]), "mixture": [round(float(v), 6) for v in mix],
                        "top_topics": [{"topic": int(k), "weight": round(float(mix[k]), 6),
                                        "words": heads[k]} for k in top],
                        "known_words": int(n)})
        return out


_KINDS: dict[str, type[TrainedModel]] = {
    "mlp": Classifier, "fstc": Clusterer, "nmf": TopicModel, "prodlda": TopicModel,
    "combinedtm": TopicModel, "lda": TopicModel, "sentencelda": TopicModel}


def load_model(run: str | Path | Run, device: str = "cpu") -> TrainedModel:
    """The final model of a run folder (``runs/latest``, ``runs/<time>-<id>``) as an object
    with ``predict`` and ``predict_proba`` / ``transform`` / ``get_topics``.

    Raises
    ------
    FileNotFoundError
        The folder holds no finished run.
    ModelError
        A family this version cannot read back (e.g. a plug-in's), or a model that does not
        match what it is given.
    """
    from common.data.embedding import DataError, resolve_device

    try:  # "cuda" on a machine without one: one line, not torch's AssertionError
        device = resolve_device(str(device))  # (a torch.device too)
    except DataError as exc:
        raise ModelError(f"device: {exc}") from None
    run = run if isinstance(run, Run) else load_run(run)
    cls = _KINDS.get(run.family)
    if cls is None:
        raise ModelError(f"{run.path}: family {run.family!r} has no reader here "
                         f"(readable: {', '.join(sorted(_KINDS))})")
    try:
        return cls(run, device)
    except ModelError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        # model.npz of another run, or a model.json edited by hand: the arrays do not fit
        raise ModelError(f"{run.path}: model.npz and model.json do not make one "
                         f"{run.family} model ({type(exc).__name__}: {one_line(exc)})"
                         ) from None
