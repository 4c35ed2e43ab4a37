"""Section ``centralized``: local-only and pooled training in this process against the
federated run of the default job."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ClusterConfig
from fedctl.bench.harness import bench_config, run_cluster
from fedctl.bench.plan import Plan


def centralized_times(cfg: ClusterConfig, threads: int) -> dict[str, Any]:
    """Local-only training time of each worker and the pooled one, in this process.

    ``MLPClassifier.fit`` for rounds x local_epochs epochs with the job's hyperparameters and
    ``torch.set_num_threads(threads)``, on the very train splits the workers use.
    """
    import torch

    from common.config import build_params
    from common.data.shards import local_data, sentence_features, worker_seed
    from common.models.mlp_params import MLPParams
    from common.models.numerics import flush_denormals

    flush_denormals()  # as the workers train, so that the times compare
    params = build_params(MLPParams, cfg.family_params, "model")
    shards = {w.name: local_data(cfg, w.name) for w in cfg.workers}
    first = next(iter(shards.values()))
    X, y = sentence_features(cfg, first.dataset), first.y
    n_classes = len(first.classes)
    epochs = cfg.rounds * params.local_epochs
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        warm = params.classifier(X.shape[1], n_classes)
        warm.fit(X[:64], y[:64], epochs=1)  # torch's one-off start-up cost, as workers pay it
        local = {}
        for name, s in shards.items():
            model = params.classifier(X.shape[1], n_classes, random_state=worker_seed(cfg, name))
            t0 = time.perf_counter()
            model.fit(X[s.train_index], y[s.train_index], epochs=epochs)
            local[name] = {"seconds": time.perf_counter() - t0, "n_train": len(s.train_index)}
        train = np.concatenate([s.train_index for s in shards.values()])
        model = params.classifier(X.shape[1], n_classes, random_state=cfg.seed)
        t0 = time.perf_counter()
        model.fit(X[train], y[train], epochs=epochs)
        pooled = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "epochs": epochs, "local": local,
            "pooled": {"seconds": pooled, "n_train": int(len(train))}}


def section_centralized(base: ClusterConfig, plan: Plan, work: Path, log: Callable[[str], None]
                        ) -> dict[str, Any]:
    """Centralized (local-only, pooled) against federated training time, default job."""
    cfg = bench_config(base, work / "fed_noeval", rounds=plan.rounds, eval_every=0)
    log(f"centralized: federated run, {plan.rounds} rounds, eval_every 0")
    fed = run_cluster(cfg)
    res: dict[str, Any] = {"federated_noeval": fed}
    if plan.eval_on:
        log("centralized: federated run with evaluation every round")
        res["federated_eval"] = run_cluster(bench_config(base, work / "fed_eval",
                                                         rounds=plan.rounds, eval_every=1))
    log("centralized: local-only and pooled training in this process")
    res["central_1thread"] = centralized_times(cfg, 1)
    res["central_all_threads"] = centralized_times(cfg, os.cpu_count() or 1)
    res["ratio_federated_to_pooled"] = fed["train_s"] / res["central_1thread"]["pooled"]["seconds"]
    res["security"] = cfg.security.mode
    return res

