"""The Ansible deployment (ansible/): syntax, lint, provision without a cloud, and a real
deploy + run + collect on this machine.

The localhost deployment is not mocked: ``deploy.yml`` runs its real tasks against three
inventory hosts (a master and two workers, ``ansible_connection: local``), each with its own
install prefix under a temp dir, as if they were three machines. It packs the checkout, unpacks it
on every "node", creates a virtual environment there and pip-installs the project into it (torch
and the other requirements are reused from this test's environment through
``fedctl_venv_inherit``, so nothing is downloaded), cuts each worker's data shard on the
controller and copies it to that worker only, writes and checks cluster.yaml, the CURVE keys, the
launcher and the systemd units. ``run.yml`` starts the nodes as background processes (process
mode: no systemd here or in CI containers) and waits for the master's summary; ``collect.yml``
fetches metrics, comparison and model into a results folder. The nodes use 300 documents of the
bundled dataset and their own embedding caches in the temp dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests import netns
from tests.conftest import DATA, free_ports

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE = ROOT / "ansible"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ansible"
PLAYBOOKS = ["provision.yml", "deploy.yml", "run.yml", "collect.yml", "undeploy.yml",
             "teardown.yml"]
BIN = Path(sys.executable).parent
WORKERS = ["w1", "w2", "w3"]
#: The workers of the localhost deployment: two are enough for everything checked on it (each
#: holds its own shard and key and nobody else's; one broken worker leaves fewer than
#: min_workers), and each node costs a venv, a pip install and a torch import on two cores.
DEPLOYED = ["w1", "w2"]
ROUNDS = 3
#: Documents of the deployed job: each worker embeds its own shard (~17 ms a text on a CPU) in its
#: own cache, so fewer than conftest's LIMIT keeps the run short (iid, so that every worker's
#: shard holds some of the positive class).
DEPLOY_LIMIT = 300


def _tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]' installs it)")
    return path


def _env(tmp: Path) -> dict[str, str]:
    """Ansible's environment: this venv first on PATH, its own config, scratch in ``tmp``."""
    home = tmp / "ansible-home"
    home.mkdir(parents=True, exist_ok=True)
    return dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(ANSIBLE / "roles"),
        ANSIBLE_HOME=str(home),
        ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
        ANSIBLE_REMOTE_TEMP=str(home / "remote-tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_DEPRECATION_WARNINGS="False",
        ANSIBLE_LOCALHOST_WARNING="False",
        ANSIBLE_INVENTORY_UNPARSED_WARNING="False",
        PYTHONUNBUFFERED="1",
    )


def playbook(tmp: Path, *args: str, cwd: Path = ANSIBLE, timeout: float = 300
             ) -> subprocess.CompletedProcess:
    """Run ``ansible-playbook ARGS`` and capture its output."""
    return subprocess.run([_tool("ansible-playbook"), *args], cwd=cwd, env=_env(tmp),
                          capture_output=True, text=True, timeout=timeout)


def _explain(proc: subprocess.CompletedProcess, n: int = 80) -> str:
    lines = (proc.stdout + proc.stderr).splitlines()
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------------------------------
# Syntax, lint, documentation
# --------------------------------------------------------------------------------------------


def test_every_playbook_passes_syntax_check(tmp_path: Path) -> None:
    proc = playbook(tmp_path, "--syntax-check", "-i", "inventory/example", *PLAYBOOKS)
    assert proc.returncode == 0, _explain(proc)
    for name in PLAYBOOKS:
        assert f"playbook: {name}" in proc.stdout


def test_ansible_lint_reports_nothing(tmp_path: Path) -> None:
    lint = _tool("ansible-lint")
    proc = subprocess.run([lint, "--nocolor"], cwd=ANSIBLE, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "0 failure(s), 0 warning(s)" in out, out[-6000:]  # profile production: .ansible-lint


def _default_keys() -> set[str]:
    keys: set[str] = set()
    for path in (ANSIBLE / "roles").glob("*/defaults/main.yml"):
        keys |= set(yaml.safe_load(path.read_text()) or {})
    return keys


def test_example_group_vars_document_every_variable() -> None:
    documented = yaml.safe_load((ANSIBLE / "inventory/example/group_vars/all.yml").read_text())
    missing = sorted(_default_keys() - set(documented))
    assert not missing, f"not in inventory/example/group_vars/all.yml: {missing}"
    unknown = sorted(set(documented) - _default_keys())
    assert not unknown, f"documented but no role has a default: {unknown}"
    hosts = (ANSIBLE / "inventory/example/hosts.yml").read_text()
    for per_host in ("fedctl_host", "fedctl_worker_name", "fedctl_worker_device",
                     "fedctl_worker_data_src"):
        assert per_host in hosts


def test_every_playbook_and_role_is_described_in_the_readme() -> None:
    readme = (ANSIBLE / "README.md").read_text()
    for name in PLAYBOOKS:
        assert name in readme
    for step in ("clouds.yaml", "provision.yml", "deploy.yml", "run.yml", "collect.yml",
                 "teardown.yml", "fedctl_openstack_reservation_id"):
        assert step in readme


# --------------------------------------------------------------------------------------------
# provision.yml without a cloud
# --------------------------------------------------------------------------------------------

def _answer(fixed: str, floating: str = "") -> dict:
    """What openstack.cloud.server answers for a server (the part provision.yml reads)."""
    addresses = [{"addr": fixed, "version": 4, "OS-EXT-IPS:type": "fixed"},
                 {"addr": "fd00::" + fixed.rsplit(".", 1)[1], "version": 6,
                  "OS-EXT-IPS:type": "fixed"}]
    if floating:
        addresses.append({"addr": floating, "version": 4, "OS-EXT-IPS:type": "floating"})
    return {"server": {"id": f"id-{fixed}", "addresses": {"fl-net": addresses}},
            "finished": 1}


OPENSTACK_ANSWERS = [_answer("192.168.77.10", "203.0.113.5"),
                     *[_answer(f"192.168.77.{11 + i}") for i in range(len(WORKERS))]]


def _render(tmp: Path, **extra: Any) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run the render fixture with ``extra`` vars; its definitions.json (None on failure)."""
    variables = {"fedctl_source_dir": str(ROOT), "fedctl_cluster_name": "fl",
                 "fedctl_openstack_operator_cidr": "198.51.100.7/32",
                 "fedctl_openstack_output_dir": str(tmp / "inventory"),
                 "render_out": str(tmp), **extra}
    vars_file = tmp / "vars.json"
    vars_file.write_text(json.dumps(variables))
    proc = playbook(tmp, "-e", f"@{vars_file}", "render_provision.yml", cwd=FIXTURES)
    out = tmp / "definitions.json"
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


def _rules_by_port(rules: list[dict]) -> dict[int, list[dict]]:
    by_port: dict[int, list[dict]] = {}
    for r in rules:
        assert r["protocol"] == "tcp"
        assert r["port_range_min"] == r["port_range_max"]
        by_port.setdefault(r["port_range_min"], []).append(r)
    return by_port


def test_provision_definitions_render_without_a_cloud(tmp_path: Path) -> None:
    reservation = "11111111-2222-3333-4444-555555555555"
    proc, d = _render(tmp_path, fedctl_openstack_reservation_id=reservation,
                      render_answers=OPENSTACK_ANSWERS, render_floating_ip="203.0.113.5")
    assert proc.returncode == 0, _explain(proc)
    assert d is not None

    # Security group: PUB/REP only to the cluster subnet, SSH from the operator (+ the jump host
    # inside the subnet), nothing open to the world.
    by_port = _rules_by_port(d["security_rules"])
    assert set(by_port) == {22, 5555, 5556}
    for port in (5555, 5556):
        assert [r["remote_ip_prefix"] for r in by_port[port]] == ["192.168.77.0/24"]
    assert sorted(r["remote_ip_prefix"] for r in by_port[22]) == ["192.168.77.0/24",
                                                                  "198.51.100.7/32"]
    assert all(r["remote_ip_prefix"] not in ("0.0.0.0/0", "::/0") for r in d["security_rules"])

    # Servers: a master and the three workers, m1.medium, on the cluster network and group,
    # each scheduled into the Chameleon reservation.
    servers = d["servers"]
    assert [s["name"] for s in servers] == ["fl-master", "fl-w1", "fl-w2", "fl-w3"]
    assert [s["fedctl_role"] for s in servers] == ["master", "worker", "worker", "worker"]
    for s in servers:
        assert s["flavor"] == "m1.medium"
        assert s["image"] == "CC-Ubuntu22.04"
        assert s["network"] == "fl-net"
        assert s["security_groups"] == ["fl-sg"]
        assert s["key_name"] == "fl-key"
        assert s["scheduler_hints"] == {"reservation": reservation}
        assert s["metadata"]["fedctl_cluster"] == "fl"

    # The inventory and cluster.yaml written from what OpenStack "answered".
    inv_dir = tmp_path / "inventory"
    inv = yaml.safe_load((inv_dir / "hosts.yml").read_text())["all"]
    master = inv["children"]["fedctl_master"]["hosts"]
    assert master == {"fl-master": {"ansible_host": "203.0.113.5",
                                    "fedctl_host": "192.168.77.10"}}
    workers = inv["children"]["fedctl_workers"]["hosts"]
    assert list(workers) == ["fl-w1", "fl-w2", "fl-w3"]
    assert workers["fl-w2"] == {"ansible_host": "192.168.77.12", "fedctl_host": "192.168.77.12",
                                "fedctl_worker_name": "w2",
                                "ansible_ssh_common_args": "-o ProxyJump=cc@203.0.113.5"}
    assert inv["vars"]["ansible_user"] == "cc"

    from common.config import load_config

    cfg = load_config(inv_dir / "cluster.yaml")
    assert cfg.master.host == "192.168.77.10"
    assert (cfg.master.pub_port, cfg.master.rep_port) == (5555, 5556)
    assert [(w.name, w.host) for w in cfg.workers] == [
        ("w1", "192.168.77.11"), ("w2", "192.168.77.12"), ("w3", "192.168.77.13")]
    state = json.loads((inv_dir / "provisioned.json").read_text())
    assert [s["name"] for s in state["servers"]] == ["fl-master", "fl-w1", "fl-w2", "fl-w3"]
    assert state["network_created"] is True and state["security_group"] == "fl-sg"


def test_provision_definitions_follow_the_settings(tmp_path: Path) -> None:
    """Ports from cluster.yaml's master section, no reservation, no jump host, other flavor."""
    proc, d = _render(tmp_path, fedctl_config={"master": {"pub_port": 7001, "rep_port": 7002}},
                      fedctl_openstack_ssh_via_master=False,
                      fedctl_openstack_worker_flavor="m1.large",
                      fedctl_openstack_subnet_cidr="10.20.0.0/16")
    assert proc.returncode == 0, _explain(proc)
    assert d is not None
    by_port = _rules_by_port(d["security_rules"])
    assert set(by_port) == {22, 7001, 7002}
    assert [r["remote_ip_prefix"] for r in by_port[22]] == ["198.51.100.7/32"]
    assert [r["remote_ip_prefix"] for r in by_port[7001]] == ["10.20.0.0/16"]
    assert [r["remote_ip_prefix"] for r in by_port[7002]] == ["10.20.0.0/16"]
    flavors = [s["flavor"] for s in d["servers"]]
    assert flavors == ["m1.medium", "m1.large", "m1.large", "m1.large"]
    assert all(s["scheduler_hints"] == {} for s in d["servers"])


@pytest.mark.parametrize("cidr", ["", "0.0.0.0/0", "not-an-address"])
def test_provision_refuses_ssh_from_anywhere(tmp_path: Path, cidr: str) -> None:
    proc, _ = _render(tmp_path, fedctl_openstack_operator_cidr=cidr)
    assert proc.returncode != 0
    assert "fedctl_openstack_operator_cidr" in proc.stdout + proc.stderr


def _tasks(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text())


def test_provision_creates_what_the_definitions_say() -> None:
    """provision's cloud tasks take the rendered definitions as they are, and teardown undoes
    each kind of resource provision creates."""
    tasks = _tasks(ANSIBLE / "roles/fedctl_openstack/tasks/main.yml")
    by_module = {k: t for t in tasks for k in t if k.startswith("openstack.cloud.")}
    server = by_module["openstack.cloud.server"]
    assert server["loop"] == "{{ fedctl_openstack_servers }}"
    args = server["openstack.cloud.server"]
    for key in ("name", "image", "flavor", "key_name", "network", "security_groups", "metadata",
                "scheduler_hints"):
        assert f"item.{key}" in args[key]
    assert args["auto_ip"] is False
    rule = by_module["openstack.cloud.security_group_rule"]
    assert rule["loop"] == "{{ fedctl_openstack_security_rules }}"
    for key in ("protocol", "port_range_min", "port_range_max", "remote_ip_prefix"):
        assert f"item.{key}" in rule["openstack.cloud.security_group_rule"][key]
    assert "openstack.cloud.floating_ip" in by_module
    for t in tasks:
        for module, params in t.items():
            if module.startswith("openstack.cloud."):
                assert params["cloud"] == "{{ fedctl_openstack_cloud }}", t["name"]

    teardown = yaml.safe_dump(_tasks(ANSIBLE / "roles/fedctl_openstack/tasks/teardown.yml"))
    network = yaml.safe_dump(_tasks(ANSIBLE / "roles/fedctl_openstack/tasks/network.yml"))
    # Rules go with their group, the master's floating IP with its server (delete_ips).
    goes_with_another = {"openstack.cloud.security_group_rule", "openstack.cloud.floating_ip"}
    for module in set(re.findall(r"openstack\.cloud\.\w+", yaml.safe_dump(tasks) + network)):
        if not module.endswith("_info") and module not in goes_with_another:
            assert module in teardown, module
    assert "delete_ips" in teardown


# --------------------------------------------------------------------------------------------
# deploy.yml + run.yml + collect.yml on this machine, for real
# --------------------------------------------------------------------------------------------


def _inventory(base: Path, pub: int, rep: int) -> dict[str, Any]:
    site = sysconfig.get_paths()["purelib"]
    return {"all": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "fedctl_cluster_name": "fedctl-test",
            "fedctl_prefix": str(base / "nodes") + "/{{ inventory_hostname }}",
            "fedctl_become": False,
            "fedctl_install_system_packages": False,
            "fedctl_service_mode": "process",
            "fedctl_systemd_unit_dir": "{{ fedctl_prefix }}/systemd",
            "fedctl_base_python": sys.executable,
            "fedctl_venv_options": ["--without-pip"],
            "fedctl_venv_inherit": [site],
            "fedctl_torch": "",
            "fedctl_pip_args": ["--no-build-isolation", "--no-index", "--no-deps"],
            "fedctl_source_dir": str(ROOT),
            "fedctl_stage_dir": str(base / "stage"),
            "fedctl_results_dir": str(base / "results"),
            "fedctl_controller_python": sys.executable,
            "fedctl_data_src": str(DATA),
            "fedctl_security": "curve",
            "fedctl_worker_threads": 1,
            "fedctl_env": {"OMP_NUM_THREADS": 1},
            "fedctl_run_poll": 2,
            "fedctl_run_timeout": 240,
            "fedctl_join_grace": 30,
            "fedctl_start_timeout": 90,
            "fedctl_config": {
                "rounds": ROUNDS,
                "min_workers": len(DEPLOYED),
                "round_deadline": 60,
                "join_timeout": 60,
                "baselines": True,
                "seed": 0,
                "master": {"bind": "127.0.0.1", "pub_port": pub, "rep_port": rep},
                "model": {"family": "mlp", "local_epochs": 5, "lr": 0.003},
                "data": {"limit": DEPLOY_LIMIT, "partition": "iid"},
            },
        },
        "children": {
            "fedctl_master": {"hosts": {"master": {"fedctl_host": "127.0.0.1"}}},
            "fedctl_workers": {"hosts": {w: {"fedctl_host": "127.0.0.1"} for w in DEPLOYED}},
        },
    }}


class Deployment:
    """A cluster deployed by deploy.yml under ``base``; ``play(...)`` runs another playbook."""

    def __init__(self, base: Path, pub: int, rep: int) -> None:
        self.base = base
        self.pub, self.rep = pub, rep
        self.inventory = base / "hosts.yml"
        self.inventory.write_text(yaml.safe_dump(_inventory(base, pub, rep), sort_keys=False))
        self.deploy: subprocess.CompletedProcess | None = None

    def node(self, name: str) -> Path:
        return self.base / "nodes" / name

    def play(self, name: str, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess:
        return playbook(self.base, "-i", str(self.inventory), name, *extra, timeout=timeout)

    def stop_everything(self) -> None:
        """Kill whatever a failed test left running (by the pid files run.yml wrote)."""
        for pid_file in self.base.glob("nodes/*/run/*.pid"):
            try:
                pid = int(pid_file.read_text())
                os.killpg(pid, 9)
            except (ValueError, OSError):
                pass


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    _tool("ansible-playbook")
    pub, rep = free_ports(2)
    dep = Deployment(tmp_path_factory.mktemp("ansible-local"), pub, rep)
    dep.deploy = dep.play("deploy.yml")
    try:
        yield dep
    finally:
        dep.stop_everything()


@pytest.mark.slow
def test_deploy_installs_every_node(deployment: Deployment) -> None:
    dep = deployment
    assert dep.deploy is not None and dep.deploy.returncode == 0, _explain(dep.deploy)
    from common.config import load_config

    sizes = {}
    for name in ["master", *DEPLOYED]:
        node = dep.node(name)
        # The project was installed into the node's own venv from the unpacked archive.
        assert (node / "src" / "fedctl" / "cli.py").is_file()
        assert (node / "venv" / "bin" / "fedctl").is_file()
        assert os.access(node / "bin" / "fedctl", os.X_OK)
        assert os.access(node / "bin" / "fedctl-service", os.X_OK)
        # Its cluster.yaml loads, with the master's address and the node's own paths.
        cfg = load_config(node / "etc" / "cluster.yaml")
        assert cfg.master.host == "127.0.0.1"
        assert (cfg.master.pub_port, cfg.master.rep_port) == (dep.pub, dep.rep)
        assert [w.name for w in cfg.workers] == DEPLOYED
        assert cfg.output_dir == str(node / "runs" / "latest")
        assert cfg.data.cache_dir == str(node / "cache")
        assert cfg.security.mode == "curve" and cfg.security.keys_dir == str(node / "keys")
        # Both unit files are rendered on every node.
        assert (node / "systemd").is_dir()
        env = (node / "etc" / "fedctl.env").read_text()
        assert f"FEDCTL_CACHE_DIR={node / 'cache'}" in env
    master_unit = (dep.node("master") / "systemd" / "fedctl-master.service").read_text()
    assert (f"ExecStart={dep.node('master')}/bin/fedctl master --config "
            f"{dep.node('master')}/etc/cluster.yaml") in master_unit
    worker_unit = (dep.node("w1") / "systemd" / "fedctl-worker@.service").read_text()
    assert "worker --config" in worker_unit and "--id %i" in worker_unit
    for w in DEPLOYED:
        node = dep.node(w)
        # Each worker holds its own shard and nobody else's; the shards add up to the data.
        assert sorted(p.name for p in (node / "data").iterdir()) == [f"{w}.jsonl"]
        rows = (node / "data" / f"{w}.jsonl").read_text().splitlines()
        assert rows and all({"text", "label"} <= set(json.loads(r)) for r in rows)
        sizes[w] = len(rows)
        # Only its own secret key, and the master's public key.
        keys = sorted(str(p.relative_to(node / "keys")) for p in (node / "keys").rglob("*.key*"))
        assert keys == ["master.key", f"workers/{w}.key", f"workers/{w}.key_secret"]
        assert (node / "keys" / "workers" / f"{w}.key_secret").stat().st_mode & 0o077 == 0
    assert sum(sizes.values()) == DEPLOY_LIMIT
    admitted = sorted(p.name for p in (dep.node("master") / "keys" / "admitted").iterdir())
    assert admitted == [f"{w}.key" for w in DEPLOYED]
    assert not (dep.node("master") / "keys" / "workers").exists()


def check_collected(results: Path, nodes: Path) -> None:
    """What collect.yml fetched from a finished job of ``ROUNDS`` rounds on the master and
    ``DEPLOYED``, and that every process of it has ended (``nodes``: the nodes' prefixes)."""
    events = [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("register") == len(DEPLOYED)
    assert kinds.count("round") == ROUNDS
    assert kinds[-1] == "done"
    assert {e["worker"] for e in events if e["event"] == "worker_round"} == set(DEPLOYED)
    summary = json.loads((results / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    table = (results / "comparison.md").read_text()
    for w in DEPLOYED:
        assert f"| {w} |" in table
    assert json.loads((results / "comparison.json").read_text())
    with np.load(results / "model.npz") as model:
        assert model.files
    assert json.loads((results / "model.json").read_text())["family"] == "mlp"
    assert yaml.safe_load((results / "cluster.yaml").read_text())["rounds"] == ROUNDS
    for name in ["master", *DEPLOYED]:
        log = (results / "logs" / name / f"{name}.log").read_text()
        assert log.strip()
    assert "CURVE" in (results / "logs" / "master" / "master.log").read_text()
    # Every process has ended: the master by itself, the workers after the job.
    for name in ["master", *DEPLOYED]:
        status = subprocess.run([str(nodes / name / "bin" / "fedctl-service"), "status", name],
                                capture_output=True, text=True)
        assert status.returncode != 0 and status.stdout.strip() in ("exited 0", "stopped"), (
            name, status.stdout)


@pytest.mark.slow
# The same playbooks run and collect the same job over SSH in test_ansible_ssh.py, checked by
# check_collected too: this local run is the fallback where that test cannot run.
@pytest.mark.skipif(netns.unavailable() is None and netns.sshd_unavailable() is None,
                    reason="test_ansible_ssh.py runs and collects this job over SSH")
def test_run_and_collect_a_training_job(deployment: Deployment) -> None:
    dep = deployment
    if dep.deploy is None or dep.deploy.returncode != 0:
        pytest.skip("deploy.yml failed (see test_deploy_installs_every_node)")
    run = dep.play("run.yml")
    assert run.returncode == 0, _explain(run)
    assert f"job finished after {ROUNDS} round(s)" in run.stdout
    collect = dep.play("collect.yml")
    assert collect.returncode == 0, _explain(collect)
    check_collected(dep.base / "results", dep.base / "nodes")


@pytest.mark.slow
def test_run_refuses_a_port_in_use(deployment: Deployment) -> None:
    dep = deployment
    if dep.deploy is None or dep.deploy.returncode != 0:
        pytest.skip("deploy.yml failed (see test_deploy_installs_every_node)")
    summary = dep.node("master") / "runs" / "latest" / "summary.json"
    had_results = summary.exists()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", dep.pub))
        squatter.listen(1)
        run = dep.play("run.yml", "--limit", "master")
    out = run.stdout + run.stderr
    assert run.returncode != 0
    config = dep.node("master") / "etc" / "cluster.yaml"
    assert f"{config}: master.pub_port: port {dep.pub} is in use on this host" in out, _explain(run)
    assert "PLAY [Wait for the job]" not in out  # the run stops at the first failure
    assert summary.exists() == had_results  # and the last job's results are still there


@pytest.mark.slow
def test_run_reports_a_worker_that_cannot_start(deployment: Deployment) -> None:
    """A worker that dies before it registers: run.yml gives up once join_timeout +
    fedctl_join_grace has passed with fewer than min_workers registered, names the worker and
    its error, and stops the job's other processes."""
    dep = deployment
    if dep.deploy is None or dep.deploy.returncode != 0:
        pytest.skip("deploy.yml failed (see test_deploy_installs_every_node)")
    shard = dep.node("w1") / "data" / "w1.jsonl"
    good = shard.read_bytes()
    shard.write_text("not json\n")
    try:
        # join_timeout is 60 s in the deployed cluster.yaml; a negative grace shortens the wait
        # to 50 s, time enough for w1 to import torch and fail even on a busy machine (w1 failed
        # 12 s after its start on a 2-core machine at load 5; the wait starts after w1's start).
        run = dep.play("run.yml", "-e", "fedctl_join_grace=-10")
    finally:
        shard.write_bytes(good)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"fewer than min_workers ({len(DEPLOYED)}) workers registered" in out, \
        _explain(run)
    assert re.search(rf"w1: exited 1; log: [^|]*Error: {re.escape(str(shard))}:1: not valid JSON",
                     out), _explain(run)
    for name in ["master", *DEPLOYED[1:]]:
        status = subprocess.run([str(dep.node(name) / "bin" / "fedctl-service"), "status", name],
                                capture_output=True, text=True)
        assert status.returncode != 0, (name, status.stdout)


@pytest.mark.slow
# One bad field is enough for the mechanism (deploy.yml relays fedctl's one line and keeps the
# good file; test_deploy_refuses_duplicate_worker_names goes through it too); the loader's
# messages field by field are test_config.py's (rounds: ten among them).
@pytest.mark.parametrize("bad, message", [
    ({"model": {"family": "nosuch"}}, "cluster.yaml: model.family: unknown family 'nosuch'"),
])
def test_deploy_refuses_a_bad_cluster_yaml(deployment: Deployment, bad: dict, message: str
                                           ) -> None:
    """The rendered cluster.yaml is checked by fedctl's loader on the node before it replaces
    the current one; the failure is fedctl's one-line message naming the field. (``--tags
    config``: only the cluster.yaml steps of deploy.yml.)"""
    dep = deployment
    if dep.deploy is None or dep.deploy.returncode != 0:
        pytest.skip("deploy.yml failed (see test_deploy_installs_every_node)")
    config = dep.node("master") / "etc" / "cluster.yaml"
    before = config.read_text()
    settings = _inventory(dep.base, dep.pub, dep.rep)["all"]["vars"]["fedctl_config"]
    for key, value in bad.items():
        settings[key] = {**settings[key], **value} if isinstance(value, dict) else value
    proc = dep.play("deploy.yml", "--limit", "master", "--tags", "config", "-e",
                    json.dumps({"fedctl_config": settings}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert message in out, _explain(proc)
    assert config.read_text() == before  # the good cluster.yaml stays in place


@pytest.mark.slow
def test_deploy_refuses_duplicate_worker_names(deployment: Deployment) -> None:
    dep = deployment
    if dep.deploy is None or dep.deploy.returncode != 0:
        pytest.skip("deploy.yml failed (see test_deploy_installs_every_node)")
    config = dep.node("master") / "etc" / "cluster.yaml"
    proc = dep.play("deploy.yml", "--limit", "master", "--tags", "config", "-e",
                    "fedctl_worker_name=w1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"{config}: workers[1].name: duplicate worker name 'w1'" in out, _explain(proc)
