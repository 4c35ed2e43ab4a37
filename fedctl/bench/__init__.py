"""`fedctl bench`: timing benchmarks of the cluster on one machine over TCP loopback.

Four sections, each run on real clusters (a ``fedctl master`` process; workers as ``fedctl
worker`` processes, or for N >= 30 as threads of this process, as ``tests/test_load.py`` does),
with every timing read from the master's ``metrics.jsonl``:

``centralized``
    The seed's table for the default job (``cluster.yaml``): each worker's local-only training
    time, the pooled centralized training time (``MLPClassifier.fit`` in this process for
    rounds x local_epochs epochs, same hyperparameters) and the federated run's training time
    (first broadcast to the last aggregation), with ``eval_every: 0`` and with evaluation on,
    process start-up reported apart.
``anatomy``
    Where a round's time goes for MLPs of about 0.1 M, 1.6 M and 25 M parameters: broadcast
    (serialize + wire + queue), evaluation, the critical worker's training, upload, aggregation
    and the rest; plus the bare exchange of the same bytes with plain pyzmq (PUB -> 3 SUB, then
    3 REQ/REP uploads, zero-copy), in the same run.
``scaling``
    Round time, master CPU and memory (sampled from ``/proc``) and bytes per round for N workers.
``compression``
    Bytes per round and final federated macro-F1 for none / float16 / int8 / top-k.

The package, one module per part:

``plan``
    :class:`Plan` (what an invocation measures) and :data:`SECTIONS`.
``harness``
    One job on a loopback cluster, started by :class:`fedctl.launch.LocalCluster` (the
    launcher of ``fedctl run``), measured from its metrics and ``/proc``; shared helpers.
``centralized``, ``anatomy``, ``scaling``, ``compression``
    The four sections.
``report``
    The goals, the plots and ``cluster_report.md``.
``main``
    :func:`run_benchmarks` and the command line.

Results go to ``<out>/cluster_report.{md,json}`` and ``<out>/cluster_*.png``.

    fedctl bench [--quick] [--out benchmarks/results] [--only anatomy,scaling]
    python benchmarks/cluster_bench.py [same options]
"""

from fedctl.bench.main import main, run_benchmarks
from fedctl.bench.plan import SECTIONS, Plan

__all__ = ["main", "run_benchmarks", "Plan", "SECTIONS"]
