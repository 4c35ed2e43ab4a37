"""A member that cheats in a secure round, for tests only: honest in every stage but one.

``--forge`` names what it forges:

* ``share:W``: the share it encrypts for worker W has one byte flipped, so that W cannot
  decrypt it (W sat every round out, and was counted silent until excluded);
* ``commitment``: it commits to a hash of random bytes, not of its seed, so its seed's shares
  never open what it committed to (every attempt of every round failed);
* ``ring``: the first coordinates of its quantized input are past the largest level a value
  within the clipping range gives, so that the ring sum wraps (a coordinate moved beyond
  the clip, in a direction of its choosing);
* ``step-wrap:S`` / ``step-clip:S`` (synchronous ProdLDA): once, in the gradients' phase of
  step S, every value is past the top level (the sum wraps), or at the clip (in range): one
  step's gradient held Adam's moments, and every weight then moved the way it pushed;
  ``step-clip:S+``: so in every step from S on, each time it is redone.

Run it as its own process, like ``fedctl worker``::

    python -m tests.secagg_hostile --config cluster.yaml --id w1 --forge commitment
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import types
from typing import Any

import numpy as np

#: Coordinates the ``ring`` forgery moves.
RING_COORDINATES = 5


def hostile_worker(cfg: Any, worker_id: str, forge: str) -> Any:
    """A :class:`worker.client.Worker` that forges what ``forge`` names (module docstring)."""
    import worker.secagg as secagg
    from worker.client import Worker

    if forge.startswith("share:"):
        victim = forge.split(":", 1)[1].encode()
        honest_encrypt = secagg.crypto.encrypt

        def encrypt(key: bytes, message: bytes, associated: bytes) -> bytes:
            out = honest_encrypt(key, message, associated)
            if associated.endswith(b"|to:%d:%s" % (len(victim), victim)):
                out = out[:-1] + bytes([out[-1] ^ 1])
            return out

        secagg.crypto = types.SimpleNamespace(**{**vars(secagg.crypto), "encrypt": encrypt})
    elif forge == "commitment":
        secagg.hashlib = types.SimpleNamespace(
            sha256=lambda data=b"": hashlib.sha256(os.urandom(32)))
    elif forge.startswith(("step-wrap:", "step-clip:")):
        worker = Worker(cfg, worker_id)
        family, at = worker.family, int(forge.split(":")[1].rstrip("+"))
        every = forge.endswith("+")  # every step from S on, every time it is redone
        honest_vector, honest_quantize = family.secure_vector, secagg.quantize
        now: dict[str, Any] = {}

        def secure_vector(*args: Any, **kwargs: Any) -> Any:
            now["phase"], step = family.phase_, family.step_
            now["step"] = None if step is None else step.step
            return honest_vector(*args, **kwargs)

        def quantize_step(values: np.ndarray, clip: float, n_levels: int, bits: int = 32
                          ) -> np.ndarray:
            q = honest_quantize(values, clip, n_levels, bits).copy()
            step = now.get("step")
            if now.get("phase") == 4 and step is not None and (
                    step >= at if every else step == at and not now.get("forged")):
                now["forged"] = True  # (once without "+": the step is redone, honestly)
                q[:] = 2**63 if forge.startswith("step-wrap") else n_levels
                logging.getLogger("secagg_hostile").info("forged step %d's gradient", at)
            return q

        family.secure_vector = secure_vector
        secagg.quantize = quantize_step
        return worker
    elif forge == "ring":
        honest_quantize = secagg.quantize

        def quantize(values: np.ndarray, clip: float, n_levels: int, bits: int = 32
                     ) -> np.ndarray:
            q = honest_quantize(values, clip, n_levels, bits).copy()
            q[:RING_COORDINATES] = (len(cfg.workers) + 1) * n_levels // 2
            return q

        secagg.quantize = quantize
    else:
        raise ValueError(f"unknown forgery {forge!r}")
    return Worker(cfg, worker_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--id", dest="worker_id", required=True)
    parser.add_argument("--forge", required=True, help="share:W, commitment, ring, "
                        "step-wrap:S, step-clip:S or step-clip:S+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: "
                        "%(message)s")
    from common.config import load_config

    hostile_worker(load_config(args.config), args.worker_id, args.forge).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
