"""Aggregation strategies, one file each, and the registry that finds them by name."""

from __future__ import annotations

from typing import Any

from master.strategies.base import ClientResult, Strategy
from master.strategies.fedadagrad import FedAdagrad
from master.strategies.fedadam import FedAdam
from master.strategies.fedavg import FedAvg
from master.strategies.fedopt import FedOpt
from master.strategies.fedyogi import FedYogi
from master.strategies.mean_pooling import MeanPooling

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (MeanPooling, FedAvg, FedAdagrad, FedYogi, FedAdam)
}


def make_strategy(name: str, **params: Any) -> Strategy:
    """Build a strategy by its ``cluster.yaml`` name (``mean``, ``fedavg``, ``fedadagrad``,
    ``fedyogi``, ``fedadam``) with its keyword parameters."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r} (known: {', '.join(sorted(STRATEGIES))})"
        ) from None
    return cls(**params)


__all__ = ["ClientResult", "Strategy", "STRATEGIES", "make_strategy", "FedAvg", "MeanPooling",
           "FedOpt", "FedAdagrad", "FedYogi", "FedAdam"]
