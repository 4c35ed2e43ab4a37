"""Model families, master side, by their ``cluster.yaml`` name: the built-ins, then plug-ins
(:mod:`common.plugins`: entry points, ``package.module:Name``, registered ones)."""

from __future__ import annotations

from common.config import ClusterConfig, ConfigError
from common.plugins import LazyRegistry, family_half
from common.secagg.ring import COMPRESSION_BITS
from master.families.base import Payload, ServerFamily
from master.strategies import make_strategy
from master.strategies.dpfedavg import DPFedAvg

#: The built-ins, imported when a job names one (a master runs one family).
SERVER_FAMILIES = LazyRegistry({
    "mlp": "master.families.mlp:MLPServer",
    "nmf": "master.families.nmf:NMFServer",
    "prodlda": "master.families.ntm:ProdLDAServer",
    "combinedtm": "master.families.ntm:CombinedTMServer",
    "fstc": "master.families.fstc:FSTCServer",
    "lda": "master.families.lda:LDAServer",
    "sentencelda": "master.families.lda:SentenceLDAServer",
})


def server_family_class(cfg: ClusterConfig) -> type[ServerFamily]:
    """The master half of ``cfg.model.family``: a built-in, else a plug-in."""
    return family_half(cfg, SERVER_FAMILIES, "server", ServerFamily)


def make_server_family(cfg: ClusterConfig) -> ServerFamily:
    """The master side of ``cfg.model.family`` with its strategy ``cfg.strategy``."""
    cls = server_family_class(cfg)
    try:
        strategy = make_strategy(cfg.strategy["name"], **cfg.strategy_params)
    except (TypeError, ValueError) as exc:
        # (An option's own message starts with its name: strategy.eta: ...)
        sep = "." if str(exc).split(":", 1)[0] in cfg.strategy_params else ": "
        raise ConfigError(f"{cfg.source}: strategy{sep}{exc}") from None
    if cls.own_rule is not None and strategy.name != "fedavg":
        raise ConfigError(f"{cfg.source}: strategy: {strategy.name} would not be used by "
                          f"{cls.name} ({cls.own_rule}); remove `strategy`")
    if cls.compression_refusal is not None and cfg.compression["kind"] != "none":
        raise ConfigError(f"{cfg.source}: compression: {cfg.compression['kind']} would not be "
                          f"used by {cls.name} ({cls.compression_refusal}); remove "
                          f"`compression`")
    privacy = cfg.privacy
    for key, why in (("dp_sgd", cls.dp_sgd_refusal), ("client_dp", cls.client_dp_refusal)):
        if getattr(privacy, key) is not None and why is not None:
            raise ConfigError(f"{cfg.source}: privacy.{key}: {cls.name} cannot take it ({why})")
    if privacy.dp_sgd is not None and strategy.client_settings():
        raise ConfigError(f"{cfg.source}: privacy.dp_sgd: {strategy.name}'s local term "
                          f"({', '.join(strategy.client_settings())}) has no place in DP-SGD's "
                          f"clipped per-document gradients; use fedavg or a server strategy")
    if privacy.client_dp is not None:
        if strategy.name != "fedavg":
            raise ConfigError(f"{cfg.source}: privacy.client_dp: DP-FedAvg replaces the "
                              f"strategy (equal weights, clipped changes, noise); remove "
                              f"strategy {strategy.name}")
        dp = privacy.client_dp
        strategy = DPFedAvg(dp.clip, dp.noise_multiplier,
                            round(cfg.client_fraction * len(cfg.workers)))
    if privacy.secure_aggregation is not None:
        refusals = [("model", cls.secure_refusal(cfg.family_params)),
                    ("strategy", strategy.secure_aggregation_refusal and
                     f"{strategy.name}: {strategy.secure_aggregation_refusal}"),
                    ("compression", cfg.compression["kind"] not in COMPRESSION_BITS and
                     f"{cfg.compression['kind']} sends some coordinates of an update, and a "
                     f"masked input must hold them all; float16 and int8 compose (a 16-bit "
                     f"ring), or set compression: none"),
                    ("max_weight_fraction", cfg.max_weight_fraction is not None and
                     "the master cannot cap weights it does not see")]
        for what, why in refusals:
            if why:
                raise ConfigError(f"{cfg.source}: privacy.secure_aggregation: {what} "
                                  f"{cls.name + ' ' if what == 'model' else ''}cannot take part "
                                  f"({why})".replace("  ", " "))
    unmet = sorted(set(strategy.client_settings()) - cls.client_settings)
    if unmet:
        raise ConfigError(f"{cfg.source}: strategy: {strategy.name} needs the workers to apply "
                          f"{', '.join(unmet)}, which {cls.name}'s workers do not (proximal_mu: "
                          f"mlp, nmf, prodlda / combinedtm in mode fedavg; scaffold: mlp)")
    family = cls(cfg, strategy)
    if cfg.workers:
        note = strategy.few_updates_note(max(1, round(cfg.client_fraction * len(cfg.workers))))
        if note is not None:
            family.notes.append(note)
    return family


__all__ = ["Payload", "ServerFamily", "SERVER_FAMILIES", "server_family_class",
           "make_server_family"]
