"""`fedctl bench --quick` end to end: real clusters, the report files and the JSON keys.

No timing assertions: the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_fedctl

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_bench_quick_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = run_fedctl("bench", "--quick", "--config", str(ROOT / "cluster.yaml"), "--out",
                      str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("cluster_report.md", "cluster_report.json", "cluster_anatomy.png",
                 "cluster_scaling.png", "cluster_compression.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "cluster_report.json").read_text())
    assert res["quick"] is True
    assert {"centralized", "anatomy", "scaling", "compression", "goals", "environment",
            "plan"} <= set(res)
    c = res["centralized"]
    assert {"federated_noeval", "central_1thread", "central_all_threads",
            "ratio_federated_to_pooled"} <= set(c)
    assert c["federated_noeval"]["startup_s"] > 0 and c["federated_noeval"]["train_s"] > 0
    assert set(c["central_1thread"]["local"]) == {"w1", "w2", "w3"}
    for v in res["anatomy"].values():
        assert {"broadcast", "train", "upload", "aggregate", "other", "cpu",
                "train_cpu"} <= set(v["anatomy"])
        # What a round cost the machine holds the workers' training (CPU work) and more.
        assert v["anatomy"]["cpu"] > 0.5 * v["anatomy"]["train_cpu"] > 0
        assert v["cores"] >= 1
        assert v["bare"]["bytes"] == 4 * v["params"]
        assert {"round_s", "broadcast_s", "upload_s"} <= set(v["bare"])
    modes = {v["mode"] for v in res["scaling"].values()}
    assert modes == {"processes", "threads"}
    for v in res["scaling"].values():
        assert v["all_updates"] and v["completed_rounds"] == res["plan"]["scaling_rounds"]
        assert v["master_hwm_mib"] and v["master_hwm_mib"] > 0
    # One PUB serialization per round whatever N: the message grows only by the participant
    # list in its header (a few bytes a worker), the report's "flat in N" goal.
    sizes = [v["broadcast_bytes"] for v in res["scaling"].values()]
    assert max(sizes) <= 1.01 * min(sizes)
    table = res["compression"]["table"]
    assert {"none", "int8"} <= set(table)
    assert table["int8"]["bytes_in"] < table["none"]["bytes_in"]
    assert all(0 <= v["federated_macro_f1"] <= 1 for v in table.values())
    md = (out / "cluster_report.md").read_text()
    for heading in ("## Goals", "## Centralized against federated", "## Round anatomy",
                    "## Scaling with workers", "## Update compression"):
        assert heading in md
    assert "cores) |" in md  # the anatomy's floor column
    # Each anatomy size is held to the "overhead <= 2 x the bare exchange".
    assert len([g for g in res["goals"] if "2 x the bare exchange" in g["goal"]]) == len(
        res["anatomy"])


