"""What a model family implements on the master's side."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import constants as C
from common.aggregate import all_finite
from common.config import ClusterConfig
from common.data.shards import LocalData, local_data, sentence_features, simulated
from common.net import errors
from common.net.wire import ProtocolError
from common.secagg.ring import from_sum, vector_size
from master.screening import largest_value
from master.strategies import ClientResult, Strategy


@dataclass
class Payload:
    """What the master sends a worker for a round: small metadata and named arrays."""

    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class ServerFamily(ABC):
    """Master side of a model family: the pre-training exchange and aggregation.

    Parameters
    ----------
    cfg : ClusterConfig
        The cluster; ``cfg.family_params`` holds this family's hyperparameters.
    strategy : Strategy
        The aggregation rule from ``cfg.strategy``.

    Notes
    -----
    A family whose workers each get their own model (iFTM) sets ``per_worker = True`` and
    answers :meth:`payload_for`; the master then publishes one payload per worker on that
    worker's own topic instead of one broadcast.
    """

    name: str = "family"
    per_worker: bool = False
    #: Whether a round's updates are screened by their distance to the model each was built on
    #: (``master.screening.outliers``). False for a family whose uploads are bounded by their
    #: form and built on a model the others' uploads compose (iFTM).
    distance_screened: bool = True
    #: The keys a registration's ``info`` may carry; any other is refused before it is stored.
    #: None (the default, for plug-ins that do not say) accepts any key.
    info_fields: frozenset[str] | None = None
    #: The family learns from labels (a classifier): ``fedctl check`` refuses a file without.
    needs_labels: bool = False
    #: Scores on the documents it trained on (clustering: no label is read in training, so
    #: holding documents out protects nothing): the final table says so.
    transductive: bool = False
    #: The strategy settings its workers apply in training (``Strategy.client_settings``, e.g.
    #: FedProx's ``proximal_mu``); a strategy needing another is refused at start.
    client_settings: frozenset[str] = frozenset()
    #: The family's own rule for combining the workers' uploads, where it has one (FSTC's
    #: eq. 16, iFTM's merge): a strategy other than the default fedavg is then refused at
    #: start rather than silently not used. None: the strategy aggregates.
    own_rule: str | None = None
    #: Why its workers send their uploads uncompressed (they are not a change of the model
    #: they received): a ``compression`` other than none is then refused at start rather than
    #: silently not used. None: the workers compress as configured.
    compression_refusal: str | None = None
    #: Why the family cannot train by record-level DP-SGD (``privacy.dp_sgd``); None: it can.
    dp_sgd_refusal: str | None = "its training is not per-document gradient steps"
    #: Why its updates cannot be averaged by DP-FedAvg (``privacy.client_dp``); None: they can.
    client_dp_refusal: str | None = "its uploads are not a model FedAvg averages"
    #: Why its rounds cannot be summed securely (``privacy.secure_aggregation``: workers send
    #: masked, weighted changes of the global model, the master learns their sum); None: they
    #: can.
    secure_aggregation_refusal: str | None = "its uploads are not a model FedAvg averages"

    @classmethod
    def secure_refusal(cls, params: Mapping[str, Any]) -> str | None:
        """:attr:`secure_aggregation_refusal` for these model settings."""
        return cls.secure_aggregation_refusal

    @classmethod
    def secure_clip_text(cls, params: Mapping[str, Any], clip: float) -> str:
        """How this family's secure inputs are clipped, for ``fedctl check``'s summary."""
        return f"clip {clip:g}"

    def secure_size(self) -> int:
        """Length of each worker's secure input this round: by default the model's
        coordinates and the weight (:func:`common.secagg.ring.to_vector`)."""
        return vector_size(self.global_.arrays)

    def secure_ring(self, bits: int) -> tuple[int, float]:
        """The ring's width and the clipping range of this round's secure inputs, given the
        width ``bits`` the job's compression allows: by default that width and
        ``secure_aggregation.clip`` (a change of the model)."""
        sa = self.cfg.privacy.secure_aggregation
        assert sa is not None
        return bits, sa.clip

    def secure_refused(self) -> None:
        """A secure round's sum was refused (the model restored as it was): what the family
        must do before its next round. Nothing by default: the round is run again."""

    def secure_kind(self) -> int | None:
        """Which of the family's secure sums this round takes (a synchronized step's phase),
        beside its length: the master counts refused sums kind by kind. None: one kind."""
        return None

    def secure_distance(self, result: Mapping[str, np.ndarray]) -> float | None:
        """The size a secure round's result is held to against the last rounds' (None: not
        held; a model's growth is checked anyway): :meth:`screening.DistanceHistory.sum_problem`,
        for the results a server optimizer steps by, whose step its own learning rate bounds
        whatever their size."""
        return None

    def secure_result(self, total: np.ndarray, n_max: int, members: int,
                      weights_sent: float | None = None, tolerance: float = 0.0
                      ) -> dict[str, np.ndarray]:
        """The round's aggregate input from the unmasked float sum of the workers' secure
        inputs (the client half's ``secure_vector``) of ``members`` workers: by default the
        weighted average model, handed to :meth:`aggregate` as the one result.

        Each member's weight is at most 1 (its samples over the largest registration's), so
        weights summing to more than the members can send betray one sent out of range, which
        the sum hides: refused (ValueError). ``weights_sent``: what the weights must sum to,
        from the members' declared documents (each update's ``n_samples`` travels in the
        clear), within ``tolerance``: a member that sent a weight of nothing beside a change
        at the clip made the others' weights divide the change (a model of 1e9 published)."""
        sa = self.cfg.privacy.secure_aggregation
        assert sa is not None
        average, weights = from_sum(total, self.global_.arrays, sa.clip)
        if weights > members * C.SECURE_WEIGHT_SLACK:
            raise ValueError(f"the weights sum to {weights:.4g}, more than {members} members "
                             f"can send (at most 1 each): a member's weight is out of range")
        if weights_sent is not None and abs(weights - weights_sent) > tolerance:
            raise ValueError(f"the weights sum to {weights:.6g}, not the {weights_sent:.6g} "
                             f"the members' declared documents give: a member's weight was "
                             f"forged")
        # Each member sends r * clip(change) beside r * clip, so no coordinate of an honest
        # sum passes clip times the weights. A ring value past what quantization gives (the
        # sum wraps modulo 2^b) let one member set a coordinate anywhere within the members'
        # whole range, sign included: refused rather than averaged.
        largest = largest_value({"sum": np.asarray(total)[:-1]})
        if largest > sa.clip * (weights + tolerance):
            raise ValueError(f"a coordinate of the secure sum is {largest:.4g}, past the "
                             f"{sa.clip * weights:.4g} the clipping range ({sa.clip:g}) times "
                             f"the weights allows: a member's input was forged")
        return average

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.global_: Payload = Payload()
        self.setup_info_: dict[str, Any] = {}
        #: What the user should know of the settings without their being wrong (logged by the
        #: master; `fedctl check` and `fedctl run` print them too).
        self.notes: list[str] = []

    def warm_up(self) -> None:
        """Load what :meth:`setup` will need (a model's library), at the master's start: once
        the workers have registered, a master busy importing for seconds is a master they
        hear nothing from. ``fedctl check`` builds the family too, and never calls this."""

    @abstractmethod
    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        """Pre-training exchange: from each worker's registration ``info``, the first payload.

        Sets ``setup_info_``: what every worker needs once before training (a class list, a
        vocabulary). The master delivers it with round 1, in every ``fetch`` reply and in a
        late joiner's ``welcome``, so rounds themselves stay small. Returns ``global_``, whose
        ``meta`` travels with every round.
        """

    def check_info(self, info: Mapping[str, Any]) -> None:
        """Check a registration's ``info`` before it is accepted; raise ProtocolError
        (``bad_field``) for one :meth:`setup` could not use."""

    def declared_documents(self, info: Mapping[str, Any]) -> tuple[str, float] | None:
        """The documents a registration's ``info`` (already checked) says it counted, as
        ``(field, count)``, or None (the default): the master refuses a count past the
        registration's ``n_samples``, which bounds everything else a worker claims."""
        return None

    def check_shards(self, shards: Mapping[str, LocalData]) -> None:
        """``fedctl check`` / ``fedctl run``, before anything starts: raise ConfigError (one
        line naming the field) for workers' data this family cannot train on (e.g. no word
        surviving the vocabulary's filters). ``shards``: worker id -> its documents."""

    def admit(self, worker_id: str, info: Mapping[str, Any]) -> None:
        """Check a worker that registers after :meth:`setup`; raise ProtocolError to refuse."""

    def aggregate(self, round_: int, results: Sequence[ClientResult]) -> Payload:
        """Fold a round's results into the global payload with the strategy (the default)."""
        arrays = self.strategy.aggregate(self.global_.arrays, results)
        self.global_ = Payload(self.global_.meta, arrays)
        return self.global_

    def savepoint(self) -> Callable[[], None]:
        """A way back to the family as it is now, for an aggregate the master refuses (it holds
        NaN, or grew past the limit): by default the published payload and the strategy's
        state. A family whose :meth:`aggregate` changes more of itself (an optimizer it steps,
        the phase of a step) saves that too, or the retry without the update left out would
        build on a half-made aggregate."""
        before, strategy_state = self.global_, dict(self.strategy.state())

        def back() -> None:
            self.global_ = before
            self.strategy.load_state(strategy_state)

        return back

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What the family keeps beyond ``global_`` and ``setup_info_`` (e.g. each worker's
        own model), as JSON-able metadata and arrays, for checkpoints. Nothing returned may
        change afterwards: the checkpoint writer's thread serializes it while training goes
        on (copy what the family goes on updating in place, such as torch tensors' memory)."""
        return {}, {}

    def load_state(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned."""

    def snapshot(self) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
        """Everything the family holds, for a checkpoint: JSON-able metadata (``setup_info``,
        ``global_meta``, ``family_meta``) and arrays in three groups (``global``,
        ``strategy``, ``family``). The master checkpoints through this and :meth:`restore`
        and never writes the family's fields itself."""
        meta, arrays = self.state()
        return ({"setup_info": self.setup_info_, "global_meta": self.global_.meta,
                 "family_meta": meta},
                {"global": dict(self.global_.arrays), "strategy": self.strategy.state(),
                 "family": dict(arrays)})

    def restore(self, meta: Mapping[str, Any], arrays: Mapping[str, Mapping[str, np.ndarray]]
                ) -> None:
        """Take back what :meth:`snapshot` returned (``fedctl master --resume``)."""
        self.setup_info_ = dict(meta["setup_info"])
        self.global_ = Payload(dict(meta["global_meta"]), dict(arrays["global"]))
        self.strategy.load_state(arrays["strategy"])
        self.load_state(meta["family_meta"], arrays["family"])

    def trained(self, version: int) -> dict[str, int]:
        """What the run trained, for the closing summary: ``{"rounds": aggregations}`` by
        default; a family whose unit of training spans rounds adds it (``steps``). The first
        value 0 means nothing was trained, and the run does not end as a success."""
        return {"rounds": version}

    def model_problem(self) -> str | None:
        """Why the model training ended with cannot be used although rounds were applied (a
        part only the last round aggregates never came), or None; the run then fails."""
        return None

    def budget_spent(self, round_: int) -> bool:
        """True when round ``round_`` was the run's last: after ``rounds`` rounds by default.
        A family whose unit of training spans rounds counts its budget in those units, so a
        unit redone after a worker dropped out costs no training."""
        return round_ >= self.cfg.rounds

    def base_round(self, round_: int) -> int:
        """The round whose worker state round ``round_`` builds on (sent as ``base``): the one
        before by default. A family that redoes work from an earlier point (a step of several
        rounds started again) names that point, and workers go back to their state then."""
        return round_ - 1

    def resume_base(self, round_: int) -> int:
        """:meth:`base_round` of round ``round_`` as a master resumed from a checkpoint of
        now will publish it (stored in the checkpoint; workers keep their snapshots from
        there). The same by default."""
        return self.base_round(round_)

    def finished(self) -> bool:
        """True to stop before ``rounds`` (e.g. the weights stopped changing); checked after
        every aggregation."""
        return False

    def payload_for(self, worker_id: str) -> Payload:
        """The payload one worker gets (the global one unless ``per_worker``)."""
        return self.global_

    def participants(self) -> list[str] | None:
        """The workers the next round must go to, or None (the default) to let the master
        sample them (``client_fraction``). A family whose step spans several rounds keeps the
        step's participants for all of them."""
        return None

    def max_weight(self, n_samples: int, info: Mapping[str, Any]) -> int:
        """The largest ``n_samples`` an update of a worker that registered ``n_samples`` and
        ``info`` may claim (its weight in an average). By default the registered count; a
        family that weighs by something else (tokens) bounds it from the registration."""
        return n_samples

    def abstained(self, result: ClientResult) -> bool:
        """True for an upload that declines its part (a multi-round step's abstention): the
        master counts it as silence, and excludes a worker that keeps doing it."""
        return False

    def check_update(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Refuse an update whose arrays differ in name, shape or dtype, or are not finite."""
        check_arrays(arrays, {n: (a.shape, a.dtype) for n, a in self.global_.arrays.items()})

    def check_claims(self, arrays: Mapping[str, np.ndarray], n_samples: int) -> None:
        """Refuse a plain update whose arrays claim more than its ``n_samples`` (already
        bounded by the registration) could give: a family that weighs by counts it receives
        (FSTC's per-cluster counts) checks them here. By default nothing."""

    def simulation_baselines(self) -> dict[str, Any] | None:
        """Baselines only a simulated cluster allows, where the master can see all the data.

        The built-in families' live in :mod:`master.baselines`; a plug-in family overrides
        this to have its own. Returns ``None`` (the default, and for a real deployment) or a
        dict with
        ``centralized``: worker id -> scores on that worker's test split of a model trained on
        all workers' training data pooled; and ``pooled``: model name -> scores on all the
        workers' test splits together, for each worker's local-only model, the federated model
        and the centralized one.
        """
        return None

    #: The workers embed their documents with the sentence model: :meth:`prepare` embeds a
    #: simulated cluster's shared dataset once, before they start.
    embeds_text: bool = False

    @classmethod
    def prepare(cls, cfg: ClusterConfig, progress: bool = True) -> None:
        """Work worth doing once per machine before a local cluster starts (``fedctl run``).

        By default, for a family that :attr:`embeds_text`, embedding the shared dataset (with
        a progress bar unless ``progress`` is False) so every process hits the cache."""
        if cls.embeds_text and simulated(cfg):
            sentence_features(cfg, local_data(cfg, cfg.workers[0].name).dataset,
                              progress=progress)


def check_arrays(arrays: Mapping[str, np.ndarray],
                 expected: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Raise ProtocolError unless ``arrays`` has exactly the names of ``expected`` (name ->
    (shape, dtype)), each of that shape and dtype and finite."""
    if set(arrays) != set(expected):
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        raise ProtocolError(f"arrays do not match the model: missing {missing}, "
                            f"unexpected {extra}", code=errors.SHAPE)
    for name, (shape, dtype) in expected.items():
        a = arrays[name]
        if a.dtype != dtype:
            raise ProtocolError(f"array {name!r}: dtype {a.dtype} but the model has "
                                f"{np.dtype(dtype)}", code=errors.DTYPE)
        if a.shape != tuple(shape):
            raise ProtocolError(f"array {name!r}: shape {a.shape} but the model has "
                                f"{tuple(shape)}", code=errors.SHAPE)
        if not all_finite(a):
            raise ProtocolError(f"array {name!r} holds NaN or Inf", code=errors.NOT_FINITE)
