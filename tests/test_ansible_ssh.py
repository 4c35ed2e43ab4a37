"""The playbooks over SSH, as against cloud VMs (issue #28, item 3).

A controller, a master and two workers, each a network namespace on a private bridge
(tests/netns.py), each node running an SSH server that admits root with one key, as a cloud
image does. ``ansible-playbook`` runs in the controller's namespace with an ordinary SSH
inventory (addresses, user, key; no local connection), and ``deploy.yml`` → ``run.yml`` →
``collect.yml`` → ``undeploy.yml`` do what they do on Chameleon: install fedctl on each node,
start the master (bound to its own address) and the workers there, wait for the job, fetch the
results, remove the install.
The nodes share this machine's file system, so each has its own install prefix, as in
tests/test_ansible.py's local deployment (whose settings this reuses: nothing downloaded).
Where nftables is installed, the master and the workers are behind the security group
``provision.yml`` would create, rendered by the role itself for this subnet and this
controller (SSH from the operator and from the cluster, PUB and REP from the cluster only) and
enforced by each namespace's own firewall; a port the group does not open is shown closed.
Skipped, with the reason, without root, iproute2, openssh-server or Ansible.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import netns
from tests.test_ansible import (
    ANSIBLE,
    DEPLOYED,
    ROUNDS,
    _env,
    _explain,
    _inventory,
    _render,
    _tool,
    check_collected,
)

WHY_NOT = netns.unavailable() or netns.sshd_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]

NODES = ["ctl", "master", *DEPLOYED]


def _ssh_inventory(base: Path, net: netns.Network, key: Path, ssh_args: str) -> dict[str, Any]:
    inv = _inventory(base, 5555, 5556)
    v = inv["all"]["vars"]
    del v["ansible_connection"]  # ssh, Ansible's default
    v.update(ansible_user="root", ansible_ssh_private_key_file=str(key),
             ansible_ssh_common_args=ssh_args)
    v["fedctl_config"]["master"] = {"bind": net.address["master"], "pub_port": 5555,
                                    "rep_port": 5556}
    inv["all"]["children"] = {
        "fedctl_master": {"hosts": {"master": {"ansible_host": net.address["master"],
                                               "fedctl_host": net.address["master"]}}},
        "fedctl_workers": {"hosts": {w: {"ansible_host": net.address[w],
                                         "fedctl_host": net.address[w]} for w in DEPLOYED}},
    }
    return inv


def _security_group(folder: Path, net: netns.Network) -> None:
    """The rules provision.yml would give the cloud, for this subnet and this controller, in
    force on the master and the workers; a listener on a port they do not open is then out
    of the controller's reach, and still within the node's own."""
    folder.mkdir()
    proc, rendered = _render(folder, fedctl_openstack_subnet_cidr=netns.SUBNET,
                             fedctl_openstack_operator_cidr=f"{net.address['ctl']}/32")
    assert rendered is not None, _explain(proc)
    rules = rendered["security_rules"]
    assert {r["port_range_min"] for r in rules} == {22, 5555, 5556}
    for node in NODES[1:]:
        netns.apply_security_group(net, node, rules)
    listener = net.popen("master", ["python3", "-m", "http.server", "8000", "--bind",
                                    net.address["master"]], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        url = f"http://{net.address['master']}:8000/"
        fetch = ["python3", "-c", "import sys, urllib.request; "
                 "urllib.request.urlopen(sys.argv[1], timeout=2)", url]
        for _ in range(50):  # the listener is up once the master itself can reach it
            if net.run("master", fetch).returncode == 0:
                break
        else:
            raise AssertionError("the test listener did not start")
        blocked = net.run("ctl", fetch)
        assert blocked.returncode != 0, "port 8000 is open to the controller: no firewall"
        assert "timed out" in blocked.stderr, blocked.stderr[-500:]  # dropped, not refused
    finally:
        listener.kill()
        listener.wait()


def test_deploy_run_collect_over_ssh(tmp_path: Path) -> None:
    import yaml

    tool = _tool("ansible-playbook")
    with netns.Network(NODES) as net, \
            netns.SshNodes(net, NODES[1:], tmp_path / "ssh") as ssh:
        inventory = tmp_path / "hosts.yml"
        inventory.write_text(yaml.safe_dump(
            _ssh_inventory(tmp_path, net, ssh.key, ssh.ssh_args()), sort_keys=False))
        firewall = netns.nft_unavailable() is None
        if firewall:
            _security_group(tmp_path / "render", net)

        def play(name: str) -> subprocess.CompletedProcess:
            return subprocess.run(net.command("ctl", [tool, "-i", str(inventory), name]),
                                  cwd=ANSIBLE, env=_env(tmp_path), capture_output=True,
                                  text=True, timeout=600)

        try:
            for name in ("deploy.yml", "run.yml", "collect.yml", "undeploy.yml"):
                proc = play(name)
                assert proc.returncode == 0, f"{name}:\n{_explain(proc)}"
                assert "ansible_connection" not in inventory.read_text()
                if name == "run.yml":
                    assert f"job finished after {ROUNDS} round(s)" in proc.stdout
                if name == "collect.yml":  # before undeploy.yml takes the services away
                    check_collected(tmp_path / "results", tmp_path / "nodes")
            # undeploy.yml took away what deploy.yml installed, on every node.
            assert not list((tmp_path / "nodes").glob("*/venv")), list(
                (tmp_path / "nodes").iterdir())
        finally:
            for pid_file in tmp_path.glob("nodes/*/run/*.pid"):  # what a failure left running
                subprocess.run(["pkill", "-9", "-g", pid_file.read_text().strip()],
                               capture_output=True)
        # The nodes were reached over SSH from the controller, each at its own address.
        for node in NODES[1:]:
            log = (tmp_path / "ssh" / f"sshd-{node}.log").read_text()
            assert f"Accepted publickey for root from {net.address['ctl']}" in log, log[-2000:]

    if not firewall:
        print(f"no firewall: {netns.nft_unavailable()}")
    # The master was bound to its own address (check_collected checked the rest).
    master_log = (tmp_path / "results" / "logs" / "master" / "master.log").read_text()
    assert f"REP tcp://{net.address['master']}:5556" in master_log
