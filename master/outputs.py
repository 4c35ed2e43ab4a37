"""The job's final outputs: the model, the comparison table and the summary.

Each file written atomically: ``model.npz`` and ``model.json`` (the final global parameters
and what they are) as soon as training is over, and again at the end; then
``comparison.md`` / ``comparison.json`` (local-only vs federated vs centralized,
:mod:`master.report`) and ``summary.json``.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from common.atomic import atomic_write_bytes
from common.config import ClusterConfig, config_to_dict
from common.constants import FAR_FROM_START_NMI
from common.data.embedding import embedding_identity
from common.data.shards import simulated
from master.families import ServerFamily
from master.report import METRICS, comparison_rows, format_table

log = logging.getLogger("fedctl.master")


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _finite(obj: Any) -> Any:
    """``obj`` with every float that is not finite as None: a baseline's perplexity on a few
    documents came out NaN, which JSON has no word for (a strict reader refused the file),
    and a mean over it was n/a where the other workers' values stood."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(_finite(obj), indent=2, allow_nan=False).encode())


def write_config(out: Path, cfg: ClusterConfig) -> None:
    """``cluster.yaml``: the configuration the run was started with."""
    import yaml

    atomic_write_bytes(out / "cluster.yaml",
                       yaml.safe_dump(config_to_dict(cfg), sort_keys=False).encode())


def write_model(out: Path, family: ServerFamily, cfg: ClusterConfig, rounds: int,
                version: int, run_id: str) -> None:
    """``model.npz`` (the final global arrays) and ``model.json``: everything needed to use
    them without the cluster (``fedctl predict``, ``fedctl.load_model``): the family and its
    hyperparameters, the set-up (classes, vocabulary), the task, the sentence model that made
    the features (name and a hash of its files) and the fedctl that wrote it."""
    final = family.global_
    atomic_write_bytes(out / "model.npz", npz_bytes(final.arrays))
    try:
        fedctl_version = importlib.metadata.version("fedctl")
    except importlib.metadata.PackageNotFoundError:
        fedctl_version = "0.0.0+source"
    task = {"task": cfg.data.task}
    if cfg.data.task != "multiclass":  # a multiclass model has no positive class
        task["positive"] = cfg.data.positive
    _write_json(out / "model.json", {
        "family": cfg.family, "params": cfg.family_params, "setup": family.setup_info_,
        "meta": final.meta, "task": task,
        "embedding": embedding_identity(cfg.data.embedding_model) if family.embeds_text
        else None, "rounds": rounds, "version": version, "run_id": run_id,
        "fedctl_version": fedctl_version})


def privacy_spent(privacy: Mapping[str, Any]) -> list[str]:
    """The ε a private run spent, as summary.json's ``privacy`` says, in words: record-level
    (DP-SGD) and client-level (DP-FedAvg), each where it applies."""
    return [f"{label} ε {privacy[key]:.2f}" for key, label in
            (("epsilon", "record-level (DP-SGD, the largest of the workers')"),
             ("client_epsilon", "client-level (DP-FedAvg)"))
            if isinstance(privacy.get(key), int | float)]


def write_results(out: Path, family: ServerFamily, reports: Mapping[str, Any],
                  baselines: bool, run: dict[str, Any], errors_served: int
                  ) -> tuple[dict[str, Any], str]:
    """The comparison table (with the simulation's baselines when ``baselines``) and
    ``summary.json`` (``run``'s fields, the comparison, ``errors_served``); returns the
    summary and the table."""
    sim, mismatch = None, None
    if baselines:
        # the models: only at the end
        from master.baselines import simulation_baselines, simulation_mismatch

        try:
            if simulated(family.cfg):
                mismatch = simulation_mismatch(family.cfg, reports)
            if mismatch is None:
                log.info("training the centralized baseline on the pooled data")
                sim = simulation_baselines(family)
            else:
                log.info("no centralized baseline: %s", mismatch)
        except Exception as exc:  # a baseline must not cost the run its summary and table
            log.error("the baselines failed, the table's baseline columns are n/a: %s: %s",
                      type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            sim = {}
        if sim is None and mismatch is None:
            log.info("%s has no centralized baseline here (a real deployment, or a family "
                     "without one): the table's centralized columns are n/a", family.name)
    no_centralized = baselines and sim is None
    sim = _finite(sim or {})
    rows = comparison_rows(reports, sim.get("centralized"))
    table = format_table(rows, sim.get("pooled"))
    if no_centralized:  # say why the columns are n/a, in the table a user reads
        table += (f"\n\nCentralized: n/a: {mismatch}." if mismatch is not None else
                  "\n\nCentralized: n/a: the workers' documents are not all on this machine."
                  if not simulated(family.cfg) else
                  f"\n\nCentralized: n/a: {family.name} has no centralized baseline (the "
                  f"local-only and federated models are compared).")
    lost = sorted({k.removeprefix("local_only_") for r in rows for k, v in r.items()
                   if k.startswith("local_only_") and v is not None}
                  - {k.removeprefix("federated_") for r in rows for k, v in r.items()
                     if k.startswith("federated_") and v is not None})
    lost = [m for m in lost if m not in ("n_train", "n_test")]
    if lost:  # (the workers leave out a score that is not finite: say so, not a bare n/a)
        table += (f"\n\nFederated {', '.join(METRICS.get(m, m) for m in lost)}: n/a on every "
                  f"worker, where the local-only models have one: not finite on the federated "
                  f"model (it diverged, or privacy noise overwhelmed it; see each round's "
                  f"scores in metrics.jsonl).")
    if family.transductive:
        table += (f"\n\n{family.name} is transductive: each worker trained on all its documents "
                  f"(train and test, no label read) and is scored on all of them.")
    unlabelled = sorted(w for w, r in reports.items() if r and r.get("labelled") is False)
    if unlabelled:
        table += (f"\n\nNo labels on {', '.join(unlabelled)}: the scores that need them "
                  f"(classification macro-F1 and accuracy, clustering ACC and NMI) were skipped.")
    start_nmi = {w: r["federated"]["start_nmi"] for w, r in sorted(reports.items())
                 if "start_nmi" in ((r or {}).get("federated") or {})}
    far = [w for w, v in start_nmi.items() if v < FAR_FROM_START_NMI]
    if far:
        table += (f"\n\nFSTC moved far from its k-FED start on {', '.join(far)} (NMI between "
                  f"the final clusters and the start under {FAR_FROM_START_NMI:g}): with "
                  f"unequal clusters that has meant worse clusters; see docs/FSTC.md.")
    privacy = run.get("privacy")
    if privacy:
        spent = privacy_spent(privacy)
        table += (f"\n\nPrivacy: the federated model at {', '.join(spent)}, δ {privacy['delta']:g}"
                  f"{'; ' + privacy['stopped'] if privacy.get('stopped') else ''}. The local "
                  f"and centralized baselines are trained without differential privacy.")
    if run.get("laplace_epsilon"):
        table += (f"\n\nPrivacy: each party's document–topic counts carried Laplace noise of "
                  f"ε {run['laplace_epsilon']:g} (iFTM) before anything left it; the local "
                  f"baseline runs the same noisy sampler, the centralized one none.")
    atomic_write_bytes(out / "comparison.md", (table + "\n").encode())
    _write_json(out / "comparison.json", {"per_worker": rows, "pooled": sim.get("pooled")})
    summary = {**run, "comparison": rows, "pooled": sim.get("pooled"),
               "errors_served": errors_served,
               **({"fstc_start_nmi": start_nmi} if start_nmi else {})}
    _write_json(out / "summary.json", summary)
    return summary, table

