"""Benchmark: Wikipedia articles fetched per second against the loopback server, by concurrency.

Every request to the loopback MediaWiki/Lift Wing stand-in (tests/wiki_server.py) waits
``--latency`` seconds (default 100 ms) before it is answered, like a distant API. With one
title per extracts request (``--batch-size 1``) each article costs two requests (its lead
section and its topic scores), so a serial client manages at most 1 / (2 * latency) = 5
articles/s; a pool of N threads should approach N times that, until the client or the server
(one Python process each, sharing this machine's cores) runs out of CPU.

The whole pipeline runs as ``fedctl data wikipedia`` runs it (:func:`build_dataset` with a
fresh response cache per run, so nothing is served from the cache). The server runs in its own
process (``python -m tests.wiki_server``), as a remote API would, so client and server do not
compete for one interpreter lock.

    python benchmarks/wikipedia_fetch.py [--titles 320] [--latency 0.1] [--batch-size 1]
                                         [--concurrency 1,4,16,64]

Prints a markdown table and writes benchmarks/results/wikipedia_fetch.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.atomic import atomic_write_bytes  # noqa: E402
from fedctl.datasets.wikipedia import (  # noqa: E402
    ResponseCache,
    RetryPolicy,
    WikiClient,
    build_dataset,
    default_cache_dir,
)
from tests.wiki_server import RESET_PATH, STATS_PATH, synthetic_pages  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@contextmanager
def server_process(latency: float, n_pages: int) -> Iterator[dict[str, str]]:
    """The loopback server in a child process; yields its ``url`` and ``topic_url``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.wiki_server", "--latency", str(latency),
         "--synthetic", str(n_pages)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise SystemExit("the loopback server did not start")
        yield json.loads(line)
    finally:
        if proc.stdin:
            proc.stdin.close()  # the server exits when its stdin closes
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _control(urls: dict[str, str], path: str) -> dict[str, Any]:
    base = urls["url"].rsplit("/w/", 1)[0]
    method = "POST" if path == RESET_PATH else "GET"
    return requests.request(method, base + path, timeout=10).json()


def run_one(urls: dict[str, str], titles: list[str], concurrency: int, batch_size: int
            ) -> dict[str, Any]:
    """One build of ``titles`` at ``concurrency``; its timings and request counts."""
    _control(urls, RESET_PATH)
    # A fresh cache next to the real one (same file system as in real use), removed after.
    parent = default_cache_dir().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wiki-bench-cache-", dir=parent) as cache:
        client = WikiClient(urls["url"], urls["topic_url"], concurrency=concurrency,
                            retry=RetryPolicy(retries=3, backoff=0.1, timeout=30),
                            cache=ResponseCache(cache))
        with client:
            t0 = time.perf_counter()
            result = build_dataset(titles, client, batch_size=batch_size,
                                   concurrency=concurrency)
            seconds = time.perf_counter() - t0
    if len(result.rows) != len(titles) or result.failed:
        raise SystemExit(f"concurrency {concurrency}: {len(result.rows)} of {len(titles)} "
                         f"articles, failed: {list(result.failed.items())[:3]}")
    stats = _control(urls, STATS_PATH)
    return {
        "concurrency": concurrency,
        "articles": len(result.rows),
        "requests": stats["requests"],
        "seconds": round(seconds, 3),
        "articles_per_s": round(len(result.rows) / seconds, 2),
        "max_in_flight": stats["max_inflight"],
        "retries": result.stats["retries"],
    }


def markdown(rows: list[dict[str, Any]], latency: float) -> str:
    lines = [
        "| concurrency | articles | requests | seconds | articles/s | speed-up "
        "| ideal articles/s | max in flight |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0]["articles_per_s"]
    for r in rows:
        ideal = r["concurrency"] / (r["requests"] / r["articles"] * latency)
        lines.append(
            f"| {r['concurrency']} | {r['articles']} | {r['requests']} | {r['seconds']:.2f} | "
            f"{r['articles_per_s']:.1f} | {r['articles_per_s'] / base:.1f}x | "
            f"{ideal:.0f} | {r['max_in_flight']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--titles", type=int, default=320, help="articles per run (320)")
    parser.add_argument("--latency", type=float, default=0.1,
                        help="seconds added to every request (0.1)")
    parser.add_argument("--batch-size", type=int, default=1, help="titles per request (1)")
    parser.add_argument("--concurrency", default="1,4,16,64",
                        help="comma-separated pool sizes (1,4,16,64)")
    parser.add_argument("--no-save", action="store_true", help="do not write results/")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    titles = list(synthetic_pages(args.titles))
    with server_process(args.latency, args.titles) as urls:
        rows = []
        for c in levels:
            rows.append(run_one(urls, titles, c, args.batch_size))
            print(f"concurrency {c:>3}: {rows[-1]['articles_per_s']:7.1f} articles/s "
                  f"({rows[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)

    table = markdown(rows, args.latency)
    setup = (f"{args.titles} articles, {args.batch_size} title(s) per extracts request + one "
             f"topic request per article, {args.latency * 1000:.0f} ms latency per request; "
             f"loopback ThreadingHTTPServer in its own process; {os.cpu_count()} CPU cores, Python "
             f"{platform.python_version()}")
    print(table)
    print(f"\n{setup}")
    if not args.no_save:
        meta = {"benchmark": "wikipedia_fetch", "titles": args.titles, "latency_s": args.latency,
                "batch_size": args.batch_size, "cpu_count": os.cpu_count(),
                "python": platform.python_version(), "platform": platform.platform(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": rows}
        atomic_write_bytes(RESULTS / "wikipedia_fetch.json",
                           (json.dumps(meta, indent=1) + "\n").encode())
        atomic_write_bytes(RESULTS / "wikipedia_fetch.md",
                           f"# Wikipedia fetch benchmark\n\n{setup}.\n\n{table}\n".encode())


if __name__ == "__main__":
    main()
