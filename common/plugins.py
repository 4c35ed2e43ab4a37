"""Finding model families and strategies that live outside fedctl.

A family or strategy is named in ``cluster.yaml`` by one of:

* a built-in name (``mlp``, ``fedavg``...): the master's and the worker's registries answer;
* a name another installed package declares under the entry-point group ``fedctl.families``
  or ``fedctl.strategies`` (``[project.entry-points."fedctl.families"] my_family =
  "my_pkg:FAMILY"``);
* ``"package.module:Name"``, imported as it stands;
* a name registered in this process with :func:`register` (``fedctl.register_family``).

What is registered in a process also reaches the processes ``fedctl run`` starts: the
references travel in the environment variable :data:`PLUGINS_ENV` (as ``module:Name``
strings, so only what is defined in an importable module can travel; what is defined in
``__main__`` is refused with a one-line error saying so).

This module is the bottom layer's: it knows names and references, never the built-in
families (``master/`` and ``worker/`` keep those).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from common.config import ClusterConfig, ConfigError

__all__ = ["FAMILIES", "STRATEGIES", "PLUGINS_ENV", "Family", "LazyRegistry", "PluginError",
           "register", "find", "family_half", "load_object", "reference", "available"]

FAMILIES = "fedctl.families"      # entry-point group of model families (values: a Family)
STRATEGIES = "fedctl.strategies"  # entry-point group of strategies (values: a Strategy class)
PLUGINS_ENV = "FEDCTL_PLUGINS"    # JSON {group: {name: reference}} handed to child processes


class PluginError(ValueError):
    """A plug-in that cannot be found or loaded; the message is one line."""


@dataclass(frozen=True)
class Family:
    """A model family: its ``cluster.yaml`` name and its two halves.

    Parameters
    ----------
    name : str
        What ``model.family`` says.
    server : type or str
        The master half, a :class:`master.families.base.ServerFamily` subclass, or its
        ``"package.module:Name"`` (imported only by the process that needs it).
    client : type or str
        The worker half, a :class:`worker.families.base.ClientFamily` subclass, or its
        reference.
    """

    name: str
    server: type | str
    client: type | str

    def server_class(self) -> type:
        """The master half, imported if it was given as a reference."""
        return load_object(self.server) if isinstance(self.server, str) else self.server

    def client_class(self) -> type:
        """The worker half, imported if it was given as a reference."""
        return load_object(self.client) if isinstance(self.client, str) else self.client

    def references(self) -> dict[str, str]:
        return {"server": reference(self.server), "client": reference(self.client)}


_registered: dict[str, dict[str, Any]] = {FAMILIES: {}, STRATEGIES: {}}


class LazyRegistry(MutableMapping[str, Any]):
    """Built-ins by name, each given as its ``"package.module:Name"`` and imported the first
    time it is asked for.

    A process runs one family, and the families' modules bring in torch, scikit-learn and
    numba between them: importing them all cost a master 1.7 s and 0.4 GB before its first
    message. Listing the names imports nothing; an entry may also be set to the object itself.
    """

    def __init__(self, references: Mapping[str, Any]) -> None:
        self._entries: dict[str, Any] = dict(references)

    def __getitem__(self, name: str) -> Any:
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = self._entries[name] = load_object(entry)
        return entry

    def __setitem__(self, name: str, obj: Any) -> None:
        self._entries[name] = obj

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def load_object(ref: str) -> Any:
    """Import ``"package.module:Name"`` (``Name`` may be dotted) and return the object."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise PluginError(f"{ref!r} is not of the form 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(f"cannot import {module!r} for {ref!r}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"module {module!r} has no {attr!r}") from None
    return obj


def reference(obj: type | str) -> str:
    """The ``module:Name`` by which another process imports ``obj``."""
    if isinstance(obj, str):
        return obj
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or module == "__main__" or "<locals>" in name:
        raise PluginError(f"{obj!r} is not defined at the top of an importable module, so the "
                          f"processes fedctl starts cannot import it; move it into a module")
    return f"{module}:{name}"


def register(group: str, name: str, obj: Any) -> None:
    """Make ``obj`` (a :class:`Family` or a strategy class) findable as ``name`` in this process
    and in the processes it starts."""
    if group not in _registered:
        raise PluginError(f"unknown plug-in group {group!r}")
    ref: Any = obj.references() if isinstance(obj, Family) else reference(obj)
    _registered[group][name] = obj
    handed = _from_env()
    handed.setdefault(group, {})[name] = ref
    os.environ[PLUGINS_ENV] = json.dumps(handed, sort_keys=True)


def _from_env() -> dict[str, dict[str, Any]]:
    raw = os.environ.get(PLUGINS_ENV)
    if not raw:
        return {}
    try:
        handed = json.loads(raw)
    except ValueError:
        raise PluginError(f"{PLUGINS_ENV} is not JSON") from None
    return handed if isinstance(handed, dict) else {}


def _as_plugin(group: str, name: str, obj: Any) -> Any:
    if group == FAMILIES:
        if isinstance(obj, dict):  # handed down by a parent process
            return Family(name, obj["server"], obj["client"])
        if not isinstance(obj, Family):
            raise PluginError(f"family {name!r}: expected a fedctl Family, got "
                              f"{type(obj).__name__}")
    elif isinstance(obj, str):
        return load_object(obj)
    return obj


def _entry_point(group: str, name: str) -> Any | None:
    for ep in entry_points(group=group):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure is the plug-in's
                raise PluginError(f"{group} entry point {name!r} ({ep.value}) failed to "
                                  f"load: {type(exc).__name__}: {exc}") from None
    return None


def find(group: str, name: str) -> Any | None:
    """The plug-in ``name`` of ``group`` (a :class:`Family`, or a strategy class), or None.

    Looked up in this order: registered in this process, handed down by the parent process,
    installed packages' entry points, then ``name`` itself as ``package.module:Name``.
    """
    if name in _registered.get(group, {}):
        return _registered[group][name]
    handed = _from_env().get(group, {})
    if name in handed:
        return _as_plugin(group, name, handed[name])
    obj = _entry_point(group, name)
    if obj is None and ":" in name:
        obj = load_object(name)
    return None if obj is None else _as_plugin(group, name, obj)


def available(group: str) -> list[str]:
    """Names of the plug-ins of ``group`` this process can see (built-ins excluded)."""
    names = set(_registered.get(group, {})) | set(_from_env().get(group, {}))
    names |= {ep.name for ep in entry_points(group=group)}
    return sorted(names)


def family_half(cfg: ClusterConfig, builtins: Mapping[str, type], half: str, base: type
                ) -> type:
    """The ``half`` (``"server"`` or ``"client"``) of ``cfg.model.family``: a built-in of
    ``builtins``, else a plug-in's; a :class:`ConfigError` naming the field otherwise."""
    cls = builtins.get(cfg.family)
    if cls is not None:
        return cls
    try:
        plugin = find(FAMILIES, cfg.family)
        if plugin is not None:
            cls = plugin.server_class() if half == "server" else plugin.client_class()
    except PluginError as exc:
        raise ConfigError(f"{cfg.source}: model.family: {exc}") from None
    if cls is None:
        known = sorted(set(builtins) | set(available(FAMILIES)))
        raise ConfigError(f"{cfg.source}: model.family: unknown family {cfg.family!r} "
                          f"(known: {', '.join(known)})")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{cfg.source}: model.family: {cfg.family!r}'s {half} half is not a "
                          f"{base.__name__}")
    return cls
