"""Model families, master side, by their ``cluster.yaml`` name: the built-ins, then plug-ins
(:mod:`common.plugins`: entry points, ``package.module:Name``, registered ones)."""

from __future__ import annotations

from common.config import ClusterConfig, ConfigError
from common.plugins import FAMILIES, PluginError, available, find
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


def server_family_class(cfg: ClusterConfig) -> type[ServerFamily]:
    """The master half of ``cfg.model.family``: a built-in, else a plug-in."""
    cls = SERVER_FAMILIES.get(cfg.family)
    if cls is not None:
        return cls
    try:
        plugin = find(FAMILIES, cfg.family)
        if plugin is not None:
            cls = plugin.server_class()
    except PluginError as exc:
        raise ConfigError(f"{cfg.source}: model.family: {exc}") from None
    if cls is None:
        known = sorted(set(SERVER_FAMILIES) | set(available(FAMILIES)))
        raise ConfigError(f"{cfg.source}: model.family: unknown family {cfg.family!r} "
                          f"(known: {', '.join(known)})")
    if not (isinstance(cls, type) and issubclass(cls, ServerFamily)):
        raise ConfigError(f"{cfg.source}: model.family: {cfg.family!r}'s master half is not a "
                          f"ServerFamily")
    return cls


def make_server_family(cfg: ClusterConfig) -> ServerFamily:
    """The master side of ``cfg.model.family`` with its strategy ``cfg.strategy``."""
    cls = server_family_class(cfg)
    try:
        strategy = make_strategy(cfg.strategy["name"], **cfg.strategy_params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg.source}: strategy: {exc}") from None
    return cls(cfg, strategy)


__all__ = ["Payload", "ServerFamily", "SERVER_FAMILIES", "server_family_class",
           "make_server_family"]
