"""`fedctl bench`: timing benchmarks of the cluster on one machine over TCP loopback.

The driver (:func:`run_benchmarks`: the chosen sections, then the report files) and the
command line of ``fedctl bench`` and ``benchmarks/cluster_bench.py`` (:func:`main`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.config import ConfigError, load_config
from fedctl.bench.anatomy import section_anatomy
from fedctl.bench.centralized import section_centralized
from fedctl.bench.compression import section_compression
from fedctl.bench.plan import SECTIONS, Plan
from fedctl.bench.report import _plots, goals, report_markdown
from fedctl.bench.scaling import section_scaling


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_benchmarks(config: str | Path = "cluster.yaml", out: str | Path = "benchmarks/results",
                   quick: bool = False, only: Sequence[str] = SECTIONS,
                   log: Callable[[str], None] | None = None, keep_runs: bool = False,
                   profile: bool = False, anatomy_hidden: Sequence[int] | None = None
                   ) -> dict[str, Any]:
    """Run the chosen sections and write ``cluster_report.{md,json}`` and the plots to ``out``.

    Parameters
    ----------
    config : path
        The default job (its data, model and security sections are the baseline).
    out : path
        Results folder.
    quick : bool
        Smoke settings (:meth:`Plan.quick`).
    only : sequence of str
        Sections among :data:`SECTIONS`.
    log : callable, optional
        Progress lines (default: print to stderr).
    keep_runs : bool
        Keep each cluster's output folder under ``<out>/runs`` (default: a temporary folder).
    profile : bool
        Profile the master of each anatomy run; the report lists its hottest functions.
    anatomy_hidden : sequence of int, optional
        Hidden sizes of the anatomy section instead of the plan's.

    Returns
    -------
    dict
        What ``cluster_report.json`` holds.
    """
    log = log or (lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    plan = Plan.quick() if quick else Plan()
    plan.profile = profile
    if anatomy_hidden:
        plan.anatomy_hidden = list(anatomy_hidden)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config)
    res: dict[str, Any] = {
        "quick": quick, "sections": list(only), "plan": plan.__dict__,
        "environment": {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "loadavg_start": _loadavg()}}
    work = out / "runs" if keep_runs else Path(tempfile.mkdtemp(prefix="fedctl-bench-"))
    try:
        if "centralized" in only:
            res["centralized"] = section_centralized(base, plan, work, log)
        if "anatomy" in only:
            res["anatomy"] = section_anatomy(base, plan, work, log)
        if "compression" in only:
            none_run = (res.get("centralized") or {}).get("federated_noeval")
            res["compression"] = section_compression(base, plan, work, log, none_run)
        if "scaling" in only:
            res["scaling"] = section_scaling(base, plan, work, log)
    finally:
        if not keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    res["environment"]["loadavg_end"] = _loadavg()
    res["goals"] = goals(res)
    plots = _plots(res, out)
    (out / "cluster_report.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "cluster_report.md").write_text(report_markdown(res, plots))
    log(f"report: {out / 'cluster_report.md'}")
    return res


def _sizes(text: str) -> list[int]:
    """``--hidden``'s comma-separated positive sizes."""
    try:
        sizes = [int(h) for h in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected sizes like 256,4096, got {text!r}")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of ``fedctl bench`` and ``benchmarks/cluster_bench.py``."""
    p = argparse.ArgumentParser(prog="fedctl bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", default="cluster.yaml", help="the default job")
    p.add_argument("--out", "-o", default=None,
                   help="results folder (default benchmarks/results, "
                        "benchmarks/results/quick with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: few rounds, small models")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections among {','.join(SECTIONS)}")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep every cluster's output folder under OUT/runs")
    p.add_argument("--profile", action="store_true",
                   help="run each anatomy master under cProfile; hottest functions in the report")
    p.add_argument("--hidden", default=None, type=_sizes,
                   help="comma-separated MLP hidden sizes for the anatomy (default 256,4096,65000)")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}")
    out = args.out or ("benchmarks/results/quick" if args.quick else "benchmarks/results")
    try:  # before minutes of benchmarks: a config that cannot be read fails in one line
        load_config(args.config)
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    res = run_benchmarks(args.config, out, quick=args.quick, only=only,
                         keep_runs=args.keep_runs, profile=args.profile,
                         anatomy_hidden=args.hidden)
    print(Path(out, "cluster_report.md").read_text())
    missed = [g["goal"] for g in res["goals"] if not g["met"]]
    if missed:
        print(f"{len(missed)} goal(s) missed (see the report)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
