"""Benchmark: the cluster's timings over loopback (issue 10) — a thin entry point.

The logic lives in :mod:`fedctl.bench` so that ``fedctl bench`` works from an installed
package; this script runs the same thing from a checkout:

    python benchmarks/cluster_bench.py [--quick] [--out benchmarks/results]
                                       [--only centralized,anatomy,scaling,compression]

Writes ``cluster_report.md``, ``cluster_report.json`` and ``cluster_*.png`` to the results
folder (``benchmarks/results/quick`` with ``--quick``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedctl.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
