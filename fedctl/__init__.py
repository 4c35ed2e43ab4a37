"""fedctl: a federated-learning cluster for text.

The public API, for plug-ins and for using what a run trained::

    import fedctl

    fedctl.__version__
    fedctl.ServerFamily, fedctl.ClientFamily   # the two halves of a model family
    fedctl.Payload, fedctl.FitResult            # what they exchange
    fedctl.Strategy, fedctl.ClientResult        # an aggregation rule
    fedctl.Family                               # a family's name and both halves
    fedctl.register_family(fedctl.Family("mine", MyServer, MyClient))
    fedctl.register_strategy("trimmed", MyStrategy)
    run = fedctl.load_run("runs/latest")        # a finished run's model, config and results
    model = fedctl.load_model("runs/latest")    # its model, with predict / transform

Families and strategies of other installed packages are found through the entry-point
groups ``fedctl.families`` and ``fedctl.strategies`` (docs/FAMILIES.md). The names below are
imported on first use, so ``import fedctl`` stays quick (the families import torch).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from common.plugins import FAMILIES, STRATEGIES, Family, register

try:
    __version__ = version("fedctl")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"

_LAZY = {
    "ServerFamily": "master.families.base", "Payload": "master.families.base",
    "ClientFamily": "worker.families.base", "FitResult": "worker.families.base",
    "Strategy": "master.strategies.base", "ClientResult": "master.strategies.base",
    "load_run": "fedctl.runs", "Run": "fedctl.runs", "list_runs": "fedctl.runs",
    "load_model": "fedctl.inference", "TrainedModel": "fedctl.inference",
}

__all__ = ["__version__", "Family", "register_family", "register_strategy", *_LAZY]


def register_family(family: Family) -> None:
    """Make ``family`` usable as ``model: {family: NAME}`` here and in every process that
    ``fedctl run`` starts from here. Its two halves must live in an importable module."""
    register(FAMILIES, family.name, family)


def register_strategy(name: str, strategy: type) -> None:
    """Make the :class:`Strategy` subclass ``strategy`` usable as ``strategy: NAME``."""
    register(STRATEGIES, name, strategy)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedctl' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, so that completion and ``dir(fedctl)`` offer them."""
    return sorted(set(globals()) | set(_LAZY))
