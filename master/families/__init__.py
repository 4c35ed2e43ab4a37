"""Model families, master side, by their ``cluster.yaml`` name."""

from __future__ import annotations

from common.config import ClusterConfig, ConfigError
from master.families.base import Payload, ServerFamily
from master.families.fstc import FSTCServer
from master.families.lda import LDAServer, SentenceLDAServer
from master.families.mlp import MLPServer
from master.families.nmf import NMFServer
from master.families.ntm import CombinedTMServer, ProdLDAServer
from master.strategies import make_strategy

SERVER_FAMILIES: dict[str, type[ServerFamily]] = {
    cls.name: cls for cls in (MLPServer, NMFServer, ProdLDAServer, CombinedTMServer,
                              FSTCServer, LDAServer, SentenceLDAServer)
}


def make_server_family(cfg: ClusterConfig) -> ServerFamily:
    """The master side of ``cfg.model.family`` with its strategy ``cfg.strategy``."""
    cls = SERVER_FAMILIES.get(cfg.family)
    if cls is None:
        raise ConfigError(f"{cfg.source}: model.family: unknown family {cfg.family!r} "
                          f"(known: {', '.join(sorted(SERVER_FAMILIES))})")
    try:
        strategy = make_strategy(cfg.strategy["name"], **cfg.strategy_params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg.source}: strategy: {exc}") from None
    return cls(cfg, strategy)


__all__ = ["Payload", "ServerFamily", "SERVER_FAMILIES", "make_server_family"]
