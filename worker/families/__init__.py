"""Model families, worker side, by their ``cluster.yaml`` name."""

from __future__ import annotations

from common.config import ClusterConfig, ConfigError
from common.data.shards import LocalData
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


def make_client_family(cfg: ClusterConfig, data: LocalData, device: str, seed: int
                       ) -> ClientFamily:
    """The worker side of ``cfg.model.family``."""
    cls = CLIENT_FAMILIES.get(cfg.family)
    if cls is None:
        raise ConfigError(f"{cfg.source}: model.family: unknown family {cfg.family!r} "
                          f"(known: {', '.join(sorted(CLIENT_FAMILIES))})")
    return cls(cfg, data, device, seed)


__all__ = ["ClientFamily", "FitResult", "CLIENT_FAMILIES", "make_client_family"]
