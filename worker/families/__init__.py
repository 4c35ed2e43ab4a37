"""Model families, worker side, by their ``cluster.yaml`` name: the built-ins, then plug-ins
(:mod:`common.plugins`: entry points, ``package.module:Name``, registered ones)."""

from __future__ import annotations

from common.config import ClusterConfig, ConfigError
from common.data.shards import LocalData
from common.plugins import FAMILIES, PluginError, available, find
from worker.families.base import ClientFamily, FitResult
from worker.families.fstc import FSTCClient
from worker.families.lda import LDAClient, SentenceLDAClient
from worker.families.mlp import MLPClient
from worker.families.nmf import NMFClient
from worker.families.ntm import CombinedTMClient, ProdLDAClient

CLIENT_FAMILIES: dict[str, type[ClientFamily]] = {
    cls.name: cls for cls in (MLPClient, NMFClient, ProdLDAClient, CombinedTMClient,
                              FSTCClient, LDAClient, SentenceLDAClient)
}


def client_family_class(cfg: ClusterConfig) -> type[ClientFamily]:
    """The worker half of ``cfg.model.family``: a built-in, else a plug-in."""
    cls = CLIENT_FAMILIES.get(cfg.family)
    if cls is not None:
        return cls
    try:
        plugin = find(FAMILIES, cfg.family)
        if plugin is not None:
            cls = plugin.client_class()
    except PluginError as exc:
        raise ConfigError(f"{cfg.source}: model.family: {exc}") from None
    if cls is None:
        known = sorted(set(CLIENT_FAMILIES) | set(available(FAMILIES)))
        raise ConfigError(f"{cfg.source}: model.family: unknown family {cfg.family!r} "
                          f"(known: {', '.join(known)})")
    if not (isinstance(cls, type) and issubclass(cls, ClientFamily)):
        raise ConfigError(f"{cfg.source}: model.family: {cfg.family!r}'s worker half is not a "
                          f"ClientFamily")
    return cls


def make_client_family(cfg: ClusterConfig, data: LocalData, device: str, seed: int
                       ) -> ClientFamily:
    """The worker side of ``cfg.model.family``."""
    return client_family_class(cfg)(cfg, data, device, seed)


__all__ = ["ClientFamily", "FitResult", "CLIENT_FAMILIES", "client_family_class",
           "make_client_family"]
