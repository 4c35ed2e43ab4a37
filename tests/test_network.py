"""A real network (issue #28): a cluster across network namespaces, through link failures.

The master and each worker run in namespaces of their own on a private bridge
(tests/netns.py: 198.51.100.0/24, no uplink), CURVE on, ``master.host`` the master's address.
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedctl.launch import child_env, fedctl_command
from tests import netns
from tests.conftest import ROOT, config_dict, events, kill_tree, wait_for

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

NODES = ["master", "w1", "w2", "w3"]


# ---------------------------------------------------------------------------- the harness
def _serve_once(net: netns.Network, node: str, port: int) -> subprocess.Popen:
    code = ("import socket; s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('0.0.0.0', {port})); s.listen(); c, _ = s.accept(); c.send(b'hi')")
    return net.popen(node, [sys.executable, "-c", code])


def _connect(net: netns.Network, node: str, host: str, port: int) -> str:
    code = ("import socket, sys\ntry:\n"
            f"    print(socket.create_connection(('{host}', {port}), timeout=2).recv(2))\n"
            "except OSError as e:\n    print(type(e).__name__)")
    return net.run(node, [sys.executable, "-c", code], timeout=30).stdout.strip()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_the_network_joins_its_nodes_and_nothing_else() -> None:
    outside = socket.socket()  # a server on this machine's own loopback
    outside.bind(("127.0.0.1", 0))
    outside.listen()
    port = outside.getsockname()[1]
    try:
        with netns.Network(["a", "b"]) as net:
            server = _serve_once(net, "a", port)
            try:
                assert wait_for(lambda: _connect(net, "b", net.address["a"], port) == "b'hi'",
                                30, "b to reach a")
            finally:
                kill_tree(server)
            # Not the machine's loopback (b's own is empty), not anywhere beyond the subnet.
            assert _connect(net, "b", "127.0.0.1", port) == "ConnectionRefusedError"
            assert _connect(net, "b", "192.0.2.1", 80) == "OSError"  # network unreachable
            route = net.run("b", ["ip", "route"]).stdout
            assert "default" not in route and "198.51.100.0/24" in route
            names = [net.switch] + [net.ns(n) for n in net.names]
            assert all(n in _namespaces() for n in names)
    finally:
        outside.close()
    assert not any(n in _namespaces() for n in names)


def test_the_network_is_removed_after_a_failure_and_leftovers_are_swept() -> None:
    with pytest.raises(RuntimeError), netns.Network(["a"]) as net:
        made = net.ns("a")
        raise RuntimeError("a test fails")
    assert made not in _namespaces()
    # A namespace left by a run whose process is gone (pid 0 never is one of ours).
    stale = f"{netns.PREFIX}999999999zz"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in netns.sweep()
    assert stale not in _namespaces()


def test_link_faults_cut_and_restore_a_node() -> None:
    with netns.Network(["a", "b"]) as net:
        net.link_down("b")
        assert _connect(net, "b", net.address["a"], 9) in ("TimeoutError", "OSError")
        net.link_up("b")
        server = _serve_once(net, "a", 7001)
        try:
            assert wait_for(lambda: _connect(net, "b", net.address["a"], 7001) == "b'hi'",
                            30, "b back")
        finally:
            kill_tree(server)
        net.readdress("b", "198.51.100.77")
        assert "198.51.100.77/24" in net.run("b", ["ip", "-4", "-o", "addr"]).stdout
        net.rate_limit("b", 10)
        shown = subprocess.run(["tc", "-n", net.switch, "qdisc", "show"], capture_output=True,
                               text=True).stdout
        assert "tbf" in shown and "10Mbit" in shown


# ---------------------------------------------------------------------------- clusters
def _config(folder: Path, cache: Path, hosts: dict[str, str] | None = None, **extra: Any
            ) -> Path:
    """The job's cluster.yaml, CURVE keys made; ``hosts``: each node's address (loopback
    when None)."""
    raw = config_dict(folder / "out", cache, NODES[1:], extra.pop("rounds", 4), **extra)
    if hosts is not None:
        raw["master"] = {**raw["master"], "host": hosts["master"], "bind": hosts["master"]}
        raw["workers"] = [{"name": w, "host": hosts[w]} for w in NODES[1:]]
    raw["security"] = {"mode": "curve", "keys_dir": str(folder / "keys")}
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    keys = subprocess.run(fedctl_command("keygen", "--config", str(path)), cwd=ROOT,
                          capture_output=True, text=True, env=child_env(cache))
    assert keys.returncode == 0, keys.stderr
    return path


def _model(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "model.npz") as z:
        return {k: z[k] for k in z.files}


def _run_loopback(folder: Path, cache: Path, **extra: Any) -> Path:
    folder.mkdir()
    cfg = _config(folder, cache, **extra)
    proc = subprocess.run(fedctl_command("run", "--config", str(cfg), "--no-progress"),
                          cwd=ROOT, env=child_env(cache), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return folder / "out"


@pytest.mark.slow
def test_a_cluster_across_namespaces_trains_the_loopback_model(tmp_path: Path,
                                                               embed_cache: Path) -> None:
    """The default job (3 workers, CURVE) with every process in its own namespace ends with
    the same model.npz, bit for bit, as on loopback: the network carries the same bytes."""
    loop = _run_loopback(tmp_path / "loopback", embed_cache)
    folder = tmp_path / "netns"
    folder.mkdir()
    with netns.Network(NODES) as net:
        cfg = _config(folder, embed_cache, net.address)
        cluster = netns.NsCluster(net, folder, embed_cache)
        try:
            cluster.start("master", "master", "--config", str(cfg))
            for w in NODES[1:]:
                cluster.start(w, "worker", "--config", str(cfg), "--id", w, "--threads", "1")
            cluster.wait(timeout=300)
        finally:
            cluster.stop()
    assert "curve" in cluster.log("master").lower()
    a, b = _model(loop), _model(folder / "out")
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    registered = {e["worker"] for e in events(folder / "out", "register")}
    assert registered == set(NODES[1:])


def _rounds(out: Path) -> list[int]:
    return netns.rounds(out)


def _score(out: Path) -> float:
    """The final model's macro-F1, averaged over the workers' own test splits."""
    rows = json.loads((out / "summary.json").read_text())["comparison"]
    return float(np.mean([r["federated_macro_f1"] for r in rows]))


#: The default job's task (one-vs-rest) for 45 rounds; w3's 10 Mbit/s link paces them (its
#: 400 kB model each way takes about 0.3 s), so that every fault lands mid-run: the faults are
#: over by round 25 or so (measured: 22), and the last 20 rounds let the model settle where
#: the undisturbed run's does (from round 30 to 49 that run scores 0.909, measured).
FAULT_JOB = {"rounds": 45, "min_workers": 2, "heartbeat_timeout": 3, "round_deadline": 60,
             "join_timeout": 120}
#: How long w1's link, then the master's, is cut: 10 s each (the benchmark's 20 s and 10 s
#: only sleep through more rounds): still over three heartbeat timeouts (3 s), so that the
#: master drops w1 (or every worker) well before the link comes back, and as long as a
#: worker's request timeout (REQUEST_TIMEOUT, 10 s), so that a request sent into the cut is
#: retried.
W1_DOWN_S = MASTER_DOWN_S = 10


@pytest.mark.slow
def test_a_cluster_finishes_through_link_failures(tmp_path: Path,
                                                                  embed_cache: Path) -> None:
    """w3 on a 10 Mbit/s link throughout; w1's link down 10 s, then the master's 10 s, then w2
    moved to another address. Every round is logged once, every process ends cleanly, and the
    final model scores as the undisturbed run does (to this small job's resolution)."""
    calm = _run_loopback(tmp_path / "calm", embed_cache, **dict(FAULT_JOB))
    folder = tmp_path / "faults"
    folder.mkdir()
    out = folder / "out"
    with netns.Network(NODES) as net:
        cfg = _config(folder, embed_cache, net.address, **dict(FAULT_JOB))
        netns.run_with_faults(net, cfg, folder, embed_cache, w1_down_s=W1_DOWN_S,
                              master_down_s=MASTER_DOWN_S)
    rounds = _rounds(out)
    assert rounds == list(range(1, FAULT_JOB["rounds"] + 1)), rounds  # all, each once
    missing = {w for e in events(out, "round") for w in e["missing"]}
    assert "w1" in missing  # the cut was felt, not slept through
    # Within 1 point is the goal on the default job (benchmarks/network_faults.py); on these
    # 600 documents a worker's test split holds a handful of positives, so one document moves
    # its macro-F1 by about 3 points (measured: 0.873, 0.909, 0.939 from round to round).
    assert abs(_score(out) - _score(calm)) <= 0.05, (_score(out), _score(calm))
