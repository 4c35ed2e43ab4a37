"""Model families, worker side, by their ``cluster.yaml`` name: the built-ins, then plug-ins
(:mod:`common.plugins`: entry points, ``package.module:Name``, registered ones)."""

from __future__ import annotations

from common.config import ClusterConfig
from common.data.shards import LocalData
from common.plugins import LazyRegistry, family_half
from worker.families.base import ClientFamily, FitResult

#: The built-ins, imported when a job names one (a worker runs one family).
CLIENT_FAMILIES = LazyRegistry({
    "mlp": "worker.families.mlp:MLPClient",
    "nmf": "worker.families.nmf:NMFClient",
    "prodlda": "worker.families.ntm:ProdLDAClient",
    "combinedtm": "worker.families.ntm:CombinedTMClient",
    "fstc": "worker.families.fstc:FSTCClient",
    "lda": "worker.families.lda:LDAClient",
    "sentencelda": "worker.families.lda:SentenceLDAClient",
})


def client_family_class(cfg: ClusterConfig) -> type[ClientFamily]:
    """The worker half of ``cfg.model.family``: a built-in, else a plug-in."""
    return family_half(cfg, CLIENT_FAMILIES, "client", ClientFamily)


def make_client_family(cfg: ClusterConfig, data: LocalData, device: str, seed: int
                       ) -> ClientFamily:
    """The worker side of ``cfg.model.family``."""
    return client_family_class(cfg)(cfg, data, device, seed)


__all__ = ["ClientFamily", "FitResult", "CLIENT_FAMILIES", "client_family_class",
           "make_client_family"]
