"""Plug-ins and layers: families and strategies from another package reach every process.

The plug-in is a real package kept under ``tests/plugin_pkg`` (``fedctl-toy``: a letter-frequency
family and a coordinate-wise median strategy, declared as entry points), installed with pip into
a folder of its own and run through ``fedctl run`` as a user would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedctl.launch import child_env, fedctl_command
from master.families import SERVER_FAMILIES
from tests.conftest import DATA, ROOT, free_ports
from worker.families import CLIENT_FAMILIES

PLUGIN = ROOT / "tests" / "plugin_pkg"


def test_master_and_worker_registries_name_the_same_families() -> None:
    assert set(SERVER_FAMILIES) == set(CLIENT_FAMILIES)
    for name in SERVER_FAMILIES:
        assert SERVER_FAMILIES[name].name == CLIENT_FAMILIES[name].name == name


@pytest.mark.parametrize("layer, forbidden", [
    ("common", r"(master|worker|fedctl)"), ("master", r"fedctl"), ("worker", r"fedctl")])
def test_lower_layers_never_import_upward(layer: str, forbidden: str) -> None:
    pattern = re.compile(rf"^\s*(from|import) {forbidden}\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / layer).rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []


def test_import_fedctl_gives_the_version_and_the_bases() -> None:
    out = subprocess.run([sys.executable, "-c", "import fedctl; print(fedctl.__version__); "
                          "print(fedctl.ServerFamily.__name__, fedctl.ClientFamily.__name__, "
                          "fedctl.Strategy.__name__, callable(fedctl.load_run))"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", out[0])
    assert out[1:] == ["ServerFamily", "ClientFamily", "Strategy", "True"]


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fedctl-toy`` installed by pip into a folder of its own (put on PYTHONPATH)."""
    work = tmp_path_factory.mktemp("plugin")
    shutil.copytree(PLUGIN, work / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(work / "src")],
                   check=True, capture_output=True)
    assert (target / "fedctl_toy").is_dir()
    return target


def _toy_config(tmp_path: Path, family: str = "toy", strategy: str = "median",
                rounds: int = 4) -> Path:
    pub, rep = free_ports(2)
    cfg = {"master": {"host": "127.0.0.1", "pub_port": pub, "rep_port": rep},
           "workers": [{"name": f"w{i}"} for i in (1, 2, 3)],
           "model": {"family": family}, "strategy": strategy, "rounds": rounds,
           "data": {"path": str(DATA), "limit": 600}, "security": {"mode": "none"},
           "output_dir": str(tmp_path / "out")}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(pythonpath: Path) -> dict[str, str]:
    return child_env(extra={"PYTHONPATH": os.pathsep.join(
        [str(pythonpath), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})


@pytest.mark.slow
def test_installed_plugin_runs_a_three_worker_cluster(installed_plugin: Path, tmp_path: Path
                                                      ) -> None:
    config = _toy_config(tmp_path)
    proc = subprocess.run(fedctl_command("run", "--config", str(config), "--no-progress"),
                          cwd=ROOT, env=_env(installed_plugin), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3, 4]
    assert {e["worker"] for e in events if e["event"] == "worker_round"} == {"w1", "w2", "w3"}
    assert json.loads((out / "model.json").read_text())["family"] == "toy"
    with np.load(out / "model.npz") as z:
        freq = z["freq"]
    # The median of three halfway moves from uniform: a distribution, no longer uniform, with
    # 'e' the most frequent letter of English text.
    assert freq.shape == (26,) and abs(float(freq.sum()) - 1) < 0.01  # a median keeps no sum
    assert int(np.argmax(freq)) == ord("e") - ord("a")
    for name in ("master", "w1", "w2", "w3"):
        assert "Traceback" not in (out / "logs" / f"{name}.log").read_text()
    # The closing table shows the plug-in's own score, which fedctl has no label for.
    assert "federated l1_to_own" in (out / "comparison.md").read_text()


def test_plugin_by_reference_without_installing(tmp_path: Path) -> None:
    config = _toy_config(tmp_path, family="fedctl_toy:TOY", strategy="fedctl_toy:Median")
    proc = subprocess.run(fedctl_command("check", "--config", str(config)), cwd=ROOT,
                          env=_env(PLUGIN), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "valid. Family fedctl_toy:TOY (strategy fedctl_toy:Median)" in proc.stdout


def test_family_registered_in_process_reaches_child_processes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    import common.plugins
    import fedctl

    # Whatever this test registers is forgotten after it, here and in the environment.
    monkeypatch.setenv("FEDCTL_PLUGINS", "{}")
    monkeypatch.setattr(common.plugins, "_registered",
                        {common.plugins.FAMILIES: {}, common.plugins.STRATEGIES: {}})
    monkeypatch.syspath_prepend(str(PLUGIN))
    fedctl.register_family(fedctl.Family("letters", "fedctl_toy:ToyServer",
                                         "fedctl_toy:ToyClient"))
    import fedctl_toy

    fedctl.register_strategy("median_of_three", fedctl_toy.Median)
    config = _toy_config(tmp_path, family="letters", strategy="median_of_three")
    proc = subprocess.run(fedctl_command("check", "--config", str(config)), cwd=ROOT,
                          env=_env(PLUGIN), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Family letters (strategy median_of_three)" in proc.stdout


def test_class_defined_in_main_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedctl

    monkeypatch.setenv("FEDCTL_PLUGINS", "{}")
    from common.plugins import PluginError

    Local = type("Local", (), {"__module__": "__main__"})
    with pytest.raises(PluginError, match="not defined at the top of an importable module"):
        fedctl.register_strategy("local", Local)


@pytest.mark.parametrize("family, message", [
    ("nosuch", "model.family: unknown family 'nosuch' (known: combinedtm, fstc, lda, mlp"),
    ("nosuch_pkg:X", "model.family: cannot import 'nosuch_pkg'"),
    ("fedctl_toy:Nothing", "model.family: module 'fedctl_toy' has no 'Nothing'"),
])
def test_unknown_plugin_is_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          family: str, message: str) -> None:
    from common.config import ConfigError, load_config
    from master.families import server_family_class
    from worker.families import client_family_class

    monkeypatch.syspath_prepend(str(PLUGIN))
    cfg = load_config(_toy_config(tmp_path, family=family))
    for lookup in (server_family_class, client_family_class):
        with pytest.raises(ConfigError) as info:
            lookup(cfg)
        assert message in str(info.value) and "\n" not in str(info.value)
