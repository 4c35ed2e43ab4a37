"""Aggregation strategies, one file each, and the registry that finds them by name."""

from __future__ import annotations

import inspect
import math
from typing import Any

from common.plugins import STRATEGIES as STRATEGY_GROUP
from common.plugins import PluginError, available, find
from master.strategies.base import ClientResult, Strategy
from master.strategies.fedadagrad import FedAdagrad
from master.strategies.fedadam import FedAdam
from master.strategies.fedavg import FedAvg
from master.strategies.fedavgm import FedAvgM
from master.strategies.fedmedian import FedMedian
from master.strategies.fedopt import FedOpt
from master.strategies.fedprox import FedProx
from master.strategies.fedtrimmedavg import FedTrimmedAvg
from master.strategies.fedyogi import FedYogi
from master.strategies.krum import Krum
from master.strategies.mean_pooling import MeanPooling
from master.strategies.scaffold import Scaffold

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (MeanPooling, FedAvg, FedAdagrad, FedYogi, FedAdam, FedAvgM,
                              FedMedian, FedTrimmedAvg, Krum, FedProx, Scaffold)
}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy called ``name``: a built-in, else a plug-in (:mod:`common.plugins`)."""
    cls = STRATEGIES.get(name)
    if cls is None:
        try:
            cls = find(STRATEGY_GROUP, name)
        except PluginError as exc:
            raise ValueError(str(exc)) from None
    if cls is None:
        known = sorted(set(STRATEGIES) | set(available(STRATEGY_GROUP)))
        raise ValueError(f"unknown strategy {name!r} (known: {', '.join(known)})")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"strategy {name!r} is not a Strategy subclass")
    return cls


def check_options(cls: type[Strategy], params: dict[str, Any]) -> None:
    """Refuse an option ``cls`` does not take, or a value not of its default's kind (a
    number for a number), naming the option: the constructor's own TypeError named Python's
    internals (``FedAvg.__init__() got an unexpected keyword argument 'eta'``, ``'>' not
    supported between instances of 'str' and 'int'``)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return  # a plug-in taking anything: its own checks speak
    options = {p.name: p for p in parameters
               if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key, value in params.items():
        if key not in options:
            takes = ", ".join(sorted(options)) or "none"
            raise ValueError(f"{key}: {cls.name} takes no option {key!r} (its options: "
                             f"{takes})")
        default = options[key].default
        number = isinstance(default, (int, float)) and not isinstance(default, bool)
        if number and (isinstance(value, bool) or not isinstance(value, (int, float))
                       or not math.isfinite(value)):
            raise ValueError(f"{key}: expected a number, got {value!r}")


def make_strategy(name: str, **params: Any) -> Strategy:
    """Build a strategy by its ``cluster.yaml`` name (``mean``, ``fedavg``, ``fedadagrad``,
    ``fedyogi``, ``fedadam``, ``fedavgm``, ``fedmedian``, ``fedtrimmedavg``, ``krum``,
    ``fedprox``, ``scaffold``, or a plug-in's) with its keyword parameters.

    Raises
    ------
    ValueError
        An unknown name, an option the strategy does not take, or a value it refuses.
    """
    cls = strategy_class(name)
    check_options(cls, params)
    return cls(**params)


__all__ = ["ClientResult", "Strategy", "STRATEGIES", "strategy_class", "make_strategy", "FedAvg",
           "MeanPooling", "FedOpt", "FedAdagrad", "FedYogi", "FedAdam", "FedAvgM", "FedMedian",
           "FedTrimmedAvg", "Krum", "FedProx", "Scaffold"]
