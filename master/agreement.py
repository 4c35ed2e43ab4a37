"""Whether a worker's configuration agrees with the master's on what makes the job.

Each node reads its own ``cluster.yaml``; nothing else makes them agree. A worker whose model,
strategy, seed, task, privacy or compression differs from the master's used to train silently
on other terms (another positive class made a three-class model; another width failed in the
middle of round 1 with a message cut short). Its registration now carries those terms
(:func:`common.config.job_terms`) and the master refuses it, naming each difference. What
differs by node is not compared: paths, devices, ports, output folders, round counts (a
worker trains the master's, which it is told on joining). A worker that reads its share of the
shared data file also sends how the shares are cut (:func:`common.config.share_terms`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from common.config import ClusterConfig, ConfigError, build_params, job_terms, share_terms

#: Differences named in one refusal; the rest are counted.
SHOWN = 3


#: The most nodes (maps, lists and values) a worker's job may hold: a few dozen is what
#: job_terms gives; a plug-in's model section may add some.
MAX_JOB_NODES = 2000


def _within(tree: Any, limit: int) -> bool:
    """Whether ``tree`` holds at most ``limit`` nodes; the walk stops at the limit."""
    todo, seen = [tree], 0
    while todo:
        node = todo.pop()
        seen += 1
        if seen > limit:
            return False
        if isinstance(node, Mapping):
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    return True


def _flat(tree: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """``{"model.hidden": 16, ...}``; a deep or odd tree (a hostile one) is cut at depth 4."""
    if isinstance(tree, Mapping) and depth < 4:
        out: dict[str, Any] = {}
        for k, v in list(tree.items())[:200]:
            out.update(_flat(v, f"{prefix}{str(k)[:40]}.", depth + 1))
        return out
    return {prefix.rstrip("."): tree}


def _model(family: Any, section: Mapping[str, Any]) -> dict[str, Any]:
    """The model section with the family's defaults filled in (``hidden`` left out and
    ``hidden: 64`` are the same model), where the family's hyperparameters are a dataclass."""
    params = getattr(family, "params", None)
    rest = {k: v for k, v in section.items() if k != "family"}
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        try:
            filled = dataclasses.asdict(build_params(type(params), rest, "model"))
        except (ConfigError, TypeError, ValueError) as exc:
            return {"family": section.get("family"), "(invalid)": str(exc)[:80]}
        return {"family": section.get("family"), **filled}
    return dict(section)


def job_differences(cfg: ClusterConfig, family: Any, theirs: Any, there: str = "there",
                    here: str = "here") -> list[str]:
    """Each term on which ``theirs`` (a worker's :func:`~common.config.job_terms`) differs from
    this master's, as ``"model.hidden: 32 there, 16 here"``; empty when they agree.

    Compared: every term this master has (the model's with the family's defaults filled in; a
    privacy mechanism the worker leaves out is a difference). Not compared: a term only the
    worker has (a later version's), a strategy option written on one side only (a server
    learning rate is the master's alone), and the family's name, which the worker has
    compared already, resolved (a plug-in may be named two ways).
    """
    if not isinstance(theirs, Mapping):
        return [f"job: expected a mapping, got {type(theirs).__name__}"]
    if not _within(theirs, MAX_JOB_NODES):
        # Compared whole, a job of 65,536 terms took the master 60-90 ms a registration: a
        # flood of them, from one admitted key, starved the honest workers' requests.
        return [f"job: more than {MAX_JOB_NODES} terms (a job has a few dozen)"]
    ours = job_terms(cfg)
    their_data = theirs.get("data")
    if isinstance(their_data, Mapping) and "partition" in their_data:  # it reads a share
        ours["data"] |= share_terms(cfg)
    mine_model, their_model = ours.pop("model"), theirs.get("model")
    found = []
    if isinstance(their_model, Mapping):
        a = _flat(_model(family, their_model), "model.")
        b = _flat(_model(family, mine_model), "model.")
    else:
        a, b = {"model": their_model}, {"model": mine_model}
    a |= _flat({k: v for k, v in theirs.items() if k != "model"})
    b |= _flat(ours)
    for key in sorted(b):
        one_sided = key.startswith("strategy.") and key != "strategy.name" and key not in a
        if key == "model.family" or one_sided:
            continue
        if a.get(key) != b.get(key):
            if key.endswith("_digest"):  # a long list's fingerprint: its value says nothing
                found.append(f"{key[:-len('_digest')]}: not the same {there} and {here}")
            else:
                found.append(f"{key}: {_show(a.get(key))} {there}, {_show(b.get(key))} {here}")
    return found


def _show(value: Any) -> str:
    text = "unset" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def listed(differences: list[str]) -> str:
    """The first :data:`SHOWN` differences on one line, the rest counted."""
    more = len(differences) - SHOWN
    return f"{'; '.join(differences[:SHOWN])}{f' (and {more} more)' if more > 0 else ''}"


def refusal(worker_id: str, differences: list[str]) -> str:
    """What a worker whose terms differ is told."""
    return f"{worker_id}'s configuration differs from the master's: {listed(differences)}"
