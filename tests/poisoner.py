"""A poisoning worker, for tests and benchmarks only (never part of the shipped CLI).

An admitted member whose key and protocol are in order but whose updates are not: it trains
like any worker, then replaces its update ``u = new − global`` before sending it:

* ``signflip``: ``global − 10·u`` (the direction reversed, ten times as far);
* ``noise``: ``global + g``, Gaussian noise ``g`` of the update's own norm;
* ``shift``: ``new + 1`` on every parameter (a constant shift).

Run it as its own process, like ``fedctl worker``::

    python -m tests.poisoner --config cluster.yaml --id w5 --attack signflip
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

ATTACKS = ("signflip", "noise", "shift")


def poison(attack: str, new: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
           rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``new`` (the honest upload, trained from ``base``) as ``attack`` turns it."""
    if attack == "signflip":
        return {k: (base[k] - 10 * (new[k] - base[k])).astype(new[k].dtype) for k in new}
    if attack == "noise":
        norm = np.sqrt(sum(float(((new[k] - base[k]).astype(np.float64) ** 2).sum())
                           for k in new))
        g = {k: rng.standard_normal(new[k].shape) for k in new}
        scale = norm / max(np.sqrt(sum(float((v ** 2).sum()) for v in g.values())), 1e-12)
        return {k: (base[k] + scale * g[k]).astype(new[k].dtype) for k in new}
    if attack == "shift":
        return {k: (new[k] + 1).astype(new[k].dtype) for k in new}
    raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")


def poisoning_worker(cfg: Any, worker_id: str, attack: str, seed: int = 0) -> Any:
    """A :class:`worker.client.Worker` whose every update ``attack`` turns (see above)."""
    from worker.client import Worker

    if attack not in ATTACKS:
        raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
    worker = Worker(cfg, worker_id)
    honest_fit = worker.family.fit
    rng = np.random.default_rng(seed)

    def fit(round_: int, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Any:
        base = {k: np.array(v, copy=True) for k, v in arrays.items()}
        result = honest_fit(round_, meta, arrays)
        result.arrays = poison(attack, result.arrays, base, rng)
        logging.getLogger("poisoner").info("round %d: sent a %s update", round_, attack)
        return result

    worker.family.fit = fit  # type: ignore[method-assign]
    return worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--id", dest="worker_id", required=True)
    parser.add_argument("--attack", choices=ATTACKS, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: "
                        "%(message)s")
    from common.config import load_config

    poisoning_worker(load_config(args.config), args.worker_id, args.attack, args.seed).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
