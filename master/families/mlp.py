"""The MLP document classifier, master side: agree on classes, start the model, baselines."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.config import ClusterConfig, ConfigError, build_params
from common.data.reading import DataError, make_task
from common.data.shards import LocalData
from common.models.mlp_params import MLPParams
from common.net import errors
from common.net.wire import ProtocolError
from master.families.base import Payload, ServerFamily
from master.strategies import Strategy

log = logging.getLogger("fedctl.master")

MAX_CLASS_NAME = 200  # characters of one class name


class MLPServer(ServerFamily):
    """Master side of ``model: {family: mlp}``.

    The pre-training exchange agrees on the feature size and the class list (the union of the
    workers' classes), then the master initializes the network with ``cfg.seed``.
    """

    name = "mlp"
    dp_sgd_refusal = None
    client_dp_refusal = None
    secure_aggregation_refusal = None
    client_settings = frozenset({"proximal_mu", "scaffold"})
    info_fields = frozenset({"input_dim", "classes"})
    needs_labels = True
    embeds_text = True

    def __init__(self, cfg: ClusterConfig, strategy: Strategy) -> None:
        super().__init__(cfg, strategy)
        self.params = build_params(MLPParams, cfg.family_params, f"{cfg.source}: model")

    def check_shards(self, shards: Mapping[str, LocalData]) -> None:
        """The class list the setup will agree on, from the workers' training labels: fewer
        than two classes, or more than ``model.max_classes``, is a one-line error before
        anything starts (not the master's failure after the cluster has)."""
        d = self.cfg.data
        classes: set[str] = set()
        for name, shard in shards.items():
            labels = [shard.dataset.labels[i] for i in shard.train_index]
            try:
                classes.update(make_task(labels, task=d.task, positive=d.positive)[1])
            except DataError as exc:  # (said of the whole file, it read as the file's fault)
                raise ConfigError(
                    f"{self.cfg.source}: data: the training share of worker {name} "
                    f"({len(labels)} documents, partition {d.partition}) cannot be used: {exc} "
                    f"(more data with data.limit, partition iid or a larger data.alpha would "
                    f"help)") from None
        if len(classes) < 2:
            raise ConfigError(f"{self.cfg.source}: data: the workers' training documents hold "
                              f"{len(classes)} class(es) ({', '.join(sorted(classes)) or 'none'})"
                              f" and the classifier needs at least 2: another data.path, or "
                              f"data.task one_vs_rest with data.positive")
        if len(classes) > self.params.max_classes:
            raise ConfigError(f"{self.cfg.source}: model.max_classes: the workers' training "
                              f"documents hold {len(classes)} classes, more than "
                              f"{self.params.max_classes}")
        # A width with zeros too many (hidden: 100000000) passed, and the master then tried to
        # allocate the model: the master alone holds two copies (the model and an aggregate).
        n = self.params.n_parameters(_embedding_dim(d.embedding_model), len(classes))
        memory = physical_memory()
        if memory is not None and 2 * 4 * n > memory:
            raise ConfigError(f"{self.cfg.source}: model.hidden: {self.params.hidden} makes a "
                              f"network of {n:,} parameters, {4 * n / 2**30:.1f} GiB a copy in "
                              f"float32, and the master holds two: more than this machine's "
                              f"{memory / 2**30:.0f} GiB")

    def warm_up(self) -> None:
        import common.models.mlp  # noqa: F401  (torch: 1-2 s, not while workers wait)

    def check_info(self, info: Mapping[str, Any]) -> None:
        dim, classes = info.get("input_dim"), info.get("classes")
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 < dim <= 1 << 20:
            raise ProtocolError("register.info.input_dim: expected a feature count",
                                code=errors.BAD_FIELD)
        limit = self.params.max_classes
        if not isinstance(classes, list) or not 0 < len(classes) <= limit:
            raise ProtocolError(f"register.info.classes: expected a list of 1-{limit} class "
                                "names (model.max_classes)", code=errors.BAD_FIELD)
        if (not all(isinstance(c, str) and 0 < len(c) <= MAX_CLASS_NAME and c.isprintable()
                    for c in classes) or len(set(classes)) != len(classes)):
            raise ProtocolError("register.info.classes: expected distinct names of 1-"
                                f"{MAX_CLASS_NAME} printable characters", code=errors.BAD_FIELD)

    def setup(self, registrations: Mapping[str, Mapping[str, Any]]) -> Payload:
        dims = {int(info.get("input_dim", -1)) for info in registrations.values()}
        if len(dims) != 1 or min(dims) < 1:
            raise ProtocolError(f"workers disagree on the feature size: {sorted(dims)}",
                                code=errors.REJECTED)
        lists = [list(info.get("classes", [])) for info in registrations.values()]
        classes = lists[0] if all(c == lists[0] for c in lists) else sorted(set().union(*lists))
        if len(classes) > self.params.max_classes:
            raise ProtocolError(f"the workers' class lists hold {len(classes)} classes in all, "
                                f"more than model.max_classes={self.params.max_classes}",
                                code=errors.REJECTED)
        if len(classes) < 2:
            raise ProtocolError(f"need at least 2 classes, the workers have {classes}",
                                code=errors.REJECTED)
        for w, own in zip(registrations, lists, strict=True):  # (a worker's file of another task)
            others = set().union(*(c for v, c in zip(registrations, lists, strict=True)
                                   if v != w))
            if others and not set(own) & others:
                log.warning("mlp: %s's classes (%s) share none with the other workers' (%s): "
                            "the model learns them from it alone; is its data another task's?",
                            w, _names(own), _names(sorted(others)))
        (input_dim,) = dims
        model = self.params.classifier(input_dim, len(classes), random_state=self.cfg.seed)
        self.setup_info_ = {"classes": classes, "input_dim": input_dim}
        self.global_ = Payload({}, model.get_arrays())
        log.info("mlp: %d features, %d classes, %d parameters", input_dim, len(classes),
                 sum(a.size for a in self.global_.arrays.values()))
        return self.global_

    def admit(self, worker_id: str, info: Mapping[str, Any]) -> None:
        meta = self.setup_info_
        if int(info.get("input_dim", -1)) != meta["input_dim"]:
            raise ProtocolError(f"feature size {info.get('input_dim')} but the model takes "
                                f"{meta['input_dim']}", code=errors.REJECTED)
        unknown = set(info.get("classes", [])) - set(meta["classes"])
        if unknown:
            raise ProtocolError(f"classes {sorted(unknown)} are not in the model",
                                code=errors.REJECTED)


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _embedding_dim(model: str | None) -> int:
    """The sentence model's output width, from its config.json (``hidden_size``) without
    loading it; the bundled all-MiniLM-L6-v2's 384 when it does not say."""
    if model is not None:
        try:
            width = json.loads((Path(model) / "config.json").read_text()).get("hidden_size")
        except (OSError, ValueError, AttributeError):
            width = None
        if isinstance(width, int) and width > 0:
            return width
    return 384


def _names(classes: list[str], shown: int = 5) -> str:
    """A few class names for a log line (a worker may have thousands)."""
    return ", ".join(classes[:shown]) + (f" and {len(classes) - shown} more"
                                         if len(classes) > shown else "")
