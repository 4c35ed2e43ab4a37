#!/usr/bin/env python3
"""Cut each worker's data shard out of a shared dataset, on the Ansible controller.

    python cut_shards.py --data DATA.jsonl --out DIR --options '{"task": ...}' --seed 0 w1 w2 w3

Uses fedctl's own partitioning (``common.shards.local_data``, the code a simulated cluster and
the master's baselines use), so worker ``wN`` gets exactly the documents (its training rows and
its held-out test rows) it would take from ``data.path`` in ``fedctl run``. Each shard is written
to ``DIR/<worker>.jsonl`` as ``{"text", "label"}`` lines, and only when its content changed, so a
second deploy reports nothing changed. Prints one JSON object: ``{"written": [...], "unchanged":
[...], "sizes": {worker: rows}}``. Errors are one line on stderr with exit status 1; a shard
its worker could not use (a one-vs-rest shard without the positive class) is one.

fedctl itself must be importable: run with the project's interpreter and the checkout on
``PYTHONPATH`` (the playbook does both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the shared JSONL dataset")
    ap.add_argument("--out", required=True, help="folder of the <worker>.jsonl shards")
    ap.add_argument("--options", default="{}",
                    help="the cluster.yaml data section as JSON (path and cache_dir ignored)")
    ap.add_argument("--seed", type=int, default=0, help="the cluster.yaml seed")
    ap.add_argument("workers", nargs="+", help="worker names, in cluster.yaml order")
    args = ap.parse_args(argv)

    from common.config import ConfigError, parse_config
    from common.data import DataError, make_task
    from common.shards import local_data

    options = json.loads(args.options)
    if not isinstance(options, dict):
        print("--options: expected a JSON object", file=sys.stderr)
        return 1
    data = {k: v for k, v in options.items()
            if k not in ("path", "cache_dir", "embedding_model")}
    data["path"] = str(Path(args.data).resolve())
    raw = {"workers": list(args.workers), "data": data, "seed": args.seed}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"written": [], "unchanged": [], "sizes": {}}
    try:
        cfg = parse_config(raw, source="<fedctl_config data section>")
        for name in args.workers:
            shard = local_data(cfg, name)
            rows = sorted(int(i) for i in [*shard.train_index, *shard.test_index])
            labels = [shard.dataset.labels[i] for i in rows]
            try:  # what the worker will do with its file: fail here, not on its node
                make_task(labels, task=cfg.data.task, positive=cfg.data.positive)
            except DataError as exc:
                raise DataError(
                    f"data: the shard of worker {name} ({len(rows)} documents, partition "
                    f"{cfg.data.partition}) cannot be used: {exc} (more data with data.limit, "
                    f"partition iid or a larger data.alpha would help)") from None
            text = "".join(
                json.dumps({"text": shard.dataset.texts[i], "label": shard.dataset.labels[i]},
                           ensure_ascii=False) + "\n"
                for i in rows)
            target = out / f"{name}.jsonl"
            report["sizes"][name] = len(rows)
            if target.exists() and target.read_text(encoding="utf-8") == text:
                report["unchanged"].append(name)
                continue
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, target)
            report["written"].append(name)
    except (ConfigError, DataError, ValueError, OSError) as exc:
        print(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
