"""A worker that SIGKILLs itself in the middle of a secure round, for tests only.

It takes part like any worker until round ``--round``; there it dies, by SIGKILL to its own
process, right after the stage named by ``--die-after`` is complete:

* ``keys``: its keys are in (it is paired), its shares never leave;
* ``shares``: its shares are handed out, its masked input never leaves;
* ``input``: its masked input is in, it reveals nothing.

Run it as its own process, like ``fedctl worker``::

    python -m tests.secagg_dropout --config cluster.yaml --id w4 --die-after shares
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

STAGES = ("keys", "shares", "input")


def dying_worker(cfg: Any, worker_id: str, die_after: str, round_: int) -> Any:
    """A :class:`worker.client.Worker` that dies as described above."""
    import worker.secagg as secagg
    from common.net import messages as M
    from common.secagg import protocol as P
    from worker.client import Worker

    def next_step(kind: str, body: dict[str, Any]) -> str | None:
        if kind == M.SECAGG and body.get("stage") == P.SHARES:
            return "keys"
        if kind == M.UPDATE:
            return "shares"
        if kind == M.SECAGG and body.get("stage") == P.UNMASK:
            return "input"
        return None

    honest_init = secagg.SecureUpload.__init__

    def init(self: Any, wid: str, settings: Any, request: Any, *rest: Any) -> None:
        def request_or_die(kind: str, body: dict[str, Any], arrays: Any) -> Any:
            if body.get("round") == round_ and next_step(kind, body) == die_after:
                logging.getLogger("secagg_dropout").info("round %d: dying after %s", round_,
                                                         die_after)
                os.kill(os.getpid(), signal.SIGKILL)
            return request(kind, body, arrays)

        honest_init(self, wid, settings, request_or_die, *rest)

    secagg.SecureUpload.__init__ = init  # type: ignore[method-assign]
    return Worker(cfg, worker_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--id", dest="worker_id", required=True)
    parser.add_argument("--die-after", choices=STAGES, required=True)
    parser.add_argument("--round", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: "
                        "%(message)s")
    from common.config import load_config

    dying_worker(load_config(args.config), args.worker_id, args.die_after, args.round).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
