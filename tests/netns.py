"""A private network of Linux network namespaces for tests and benchmarks (issue #28).

Each node is a namespace with one interface, ``eth0``, whose address is in a documentation
range (198.51.100.0/24 by default, RFC 5737: never routed on the Internet). The nodes are joined
by a bridge that lives in a namespace of its own, the *switch*: the machine's own network stack
is not attached to it, and no node has a route beyond the subnet, so nothing a test sends can
leave the machine, or even reach its loopback. Everything is made by :class:`Network` and
removed when it closes, also after a failed test; namespaces left by a killed run (same name
prefix, a process that no longer exists) are removed on the next start.

Faults, on the switch side of a node's link (so the node itself sees nothing but silence):

* :meth:`Network.link_down` / :meth:`Network.link_up`: the link is cut, then restored;
* :meth:`Network.rate_limit`: ``tc``'s token bucket (``tbf``) on both directions;
* :meth:`Network.readdress`: the node takes another address on the same subnet.

Needs root and ``ip`` / ``tc`` (iproute2); :func:`unavailable` says why not where it cannot.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedctl.launch import child_env, fedctl_command
from tests.conftest import ROOT, kill_tree

PREFIX = "fcn"  # every namespace and link this harness makes starts with it
SUBNET = "198.51.100.0/24"
_NS_DIR = Path("/run/netns")


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, not permitted), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:  # the kinds of link the harness makes, and tbf, must exist in this kernel too
        for what, argv in (("a bridge", ["ip", "-n", probe, "link", "add", "br0", "type",
                                         "bridge"]),
                           ("a veth pair", ["ip", "-n", probe, "link", "add", "pa", "type",
                                            "veth", "peer", "name", "pb"]),
                           ("tc tbf", ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root",
                                       "tbf", "rate", "10mbit", "burst", "32kb", "latency",
                                       "100ms"])):
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                return f"cannot make {what} in a namespace: {done.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def sweep() -> list[str]:
    """Remove namespaces this harness left behind in runs whose process is gone; their
    names. (The name carries the process id that made them.)"""
    gone = []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)[a-z]\w*", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


class Network:
    """Namespaces ``names`` on one private bridge; a context manager that removes them.

    Parameters
    ----------
    names : sequence of str
        The nodes (letters, digits; e.g. ``["master", "w1", "w2"]``).
    subnet : str, default "198.51.100.0/24"
        Node i gets the subnet's (i + 1)-th address.

    Attributes
    ----------
    address : dict of str to str
        Each node's current address.
    """

    def __init__(self, names: Sequence[str], subnet: str = SUBNET) -> None:
        self.net = ipaddress.ip_network(subnet)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = list(names)
        self.address = {n: str(self.net[i + 1]) for i, n in enumerate(self.names)}
        self._index = {n: i for i, n in enumerate(self.names)}
        self.switch = f"{self.tag}sw"
        self._made: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def ns(self, name: str) -> str:
        """The namespace of node ``name``."""
        return f"{self.tag}n{self._index[name]}"

    def _port(self, name: str) -> str:
        """The switch side of node ``name``'s link."""
        return f"sw{self._index[name]}"

    def __enter__(self) -> Network:
        sweep()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for name in self.names:
            ns, port = self.ns(name), self._port(name)
            _ip("netns", "add", ns)
            self._made.append(ns)
            # Made in the switch, then one end moved into the node: nothing in the machine's
            # own namespace, not even for a moment.
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", ns=self.switch)
            _ip("link", "set", "eth0", "netns", ns, ns=self.switch)
            _ip("link", "set", port, "master", "br0", ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{self.address[name]}/{self.net.prefixlen}", "dev", "eth0",
                ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)

    def close(self) -> None:
        """Remove every namespace (their links go with them). Safe to call twice."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    # ------------------------------------------------------------------ use
    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``name``."""
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def run(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, argv), capture_output=True, text=True, **kw)

    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(name, argv), **kw)

    # ------------------------------------------------------------------ faults
    def link_down(self, name: str) -> None:
        """Cut node ``name``'s link (its interface stays up: it sees only silence)."""
        _ip("link", "set", self._port(name), "down", ns=self.switch)

    def link_up(self, name: str) -> None:
        _ip("link", "set", self._port(name), "up", ns=self.switch)

    def rate_limit(self, name: str, mbit: float, burst_kb: int = 32,
                   latency_ms: int = 100) -> None:
        """Limit node ``name``'s link to ``mbit`` Mbit/s each way (``tc`` ``tbf``)."""
        args = ["root", "tbf", "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency",
                f"{latency_ms}ms"]
        subprocess.run(["tc", "-n", self.switch, "qdisc", "replace", "dev", self._port(name),
                        *args], check=True, capture_output=True, timeout=30)
        subprocess.run(["tc", "-n", self.ns(name), "qdisc", "replace", "dev", "eth0", *args],
                       check=True, capture_output=True, timeout=30)

    def unlimit(self, name: str) -> None:
        for ns, dev in ((self.switch, self._port(name)), (self.ns(name), "eth0")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)

    def readdress(self, name: str, address: str) -> None:
        """Give node ``name`` another address on the subnet (the old one goes)."""
        ns, old = self.ns(name), self.address[name]
        # Removed first: deleting a primary address takes the secondaries of its subnet along.
        _ip("addr", "del", f"{old}/{self.net.prefixlen}", "dev", "eth0", ns=ns)
        _ip("addr", "add", f"{address}/{self.net.prefixlen}", "dev", "eth0", ns=ns)
        self.address[name] = address


# ---------------------------------------------------------------------------- fedctl on it
class NsCluster:
    """A master and workers, each ``fedctl`` process in its own namespace, logs in files."""

    def __init__(self, net: Network, folder: Path, cache: Path | None) -> None:
        self.net, self.folder, self.cache = net, folder, cache
        self.procs: dict[str, subprocess.Popen] = {}
        self._files: list[Any] = []

    def start(self, node: str, *args: str) -> None:
        fh = open(self.folder / f"{node}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._files.append(fh)
        self.procs[node] = self.net.popen(node, fedctl_command(*args), cwd=ROOT,
                                          env=child_env(self.cache), stdout=fh,
                                          stderr=subprocess.STDOUT)

    def log(self, node: str) -> str:
        return (self.folder / f"{node}.log").read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- {n} (rc {p.poll()}) ---\n" + "\n".join(
            self.log(n).splitlines()[-12:]) for n, p in self.procs.items())

    def check(self) -> None:
        bad = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}
        if bad:
            raise RuntimeError(f"failed: {bad}\n{self.tails()}")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for n, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{n} still running after {timeout:g}s\n"
                                   f"{self.tails()}") from None
        if {p.returncode for p in self.procs.values()} != {0}:
            raise RuntimeError(f"a process failed\n{self.tails()}")

    def stop(self) -> None:
        for p in self.procs.values():
            kill_tree(p)
        for fh in self._files:
            fh.close()




def rounds(out: Path) -> list[int]:
    """The rounds metrics.jsonl has logged so far, in order."""
    from common.runlog import read_metrics

    path = out / "metrics.jsonl"
    return [e["round"] for e in read_metrics(path) if e["event"] == "round"] \
        if path.exists() else []


def _worker_rounds(out: Path, worker: str) -> list[int]:
    from common.runlog import read_metrics

    path = out / "metrics.jsonl"
    return [e["round"] for e in read_metrics(path)
            if e["event"] == "worker_round" and e["worker"] == worker] if path.exists() else []


def _until(what: str, cond: Any, cluster: NsCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        cluster.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}\n"
                               f"{cluster.tails()}")
        time.sleep(0.1)


def run_with_faults(net: Network, cfg: Path, folder: Path, cache: Path | None,
                    timeout: float = 900, w1_down_s: float = 20,
                    master_down_s: float = 10) -> dict[str, float]:
    """A master (node ``master``) and workers w1-w3 through issue 28's faults, in order: w3's
    link limited to 10 Mbit/s throughout; w1's link down ``w1_down_s`` (20 s) after round 3;
    the master's down ``master_down_s`` (10 s) once w1 is back in a round; w2 moved to
    198.51.100.77 two rounds later. Returns when every process has ended cleanly; the seconds
    (after ``launched``, the wall-clock time the processes were started) at which each fault
    began."""
    out = folder / "out"
    cluster = NsCluster(net, folder, cache)
    net.rate_limit("w3", 10)
    t0 = time.monotonic()
    at: dict[str, float] = {"launched": time.time()}
    try:
        cluster.start("master", "master", "--config", str(cfg))
        for w in ("w1", "w2", "w3"):
            cluster.start(w, "worker", "--config", str(cfg), "--id", w, "--threads", "1")
        _until("round 3", lambda: len(rounds(out)) >= 3, cluster, 300)
        at["w1 down"] = time.monotonic() - t0
        net.link_down("w1")
        time.sleep(w1_down_s)
        net.link_up("w1")
        cut = len(rounds(out))
        _until("w1 back in a round", lambda: any(r > cut for r in _worker_rounds(out, "w1")),
               cluster, 120)
        at["master down"] = time.monotonic() - t0
        net.link_down("master")
        time.sleep(master_down_s)
        net.link_up("master")
        cut = len(rounds(out))
        _until("rounds after the master's link came back", lambda: len(rounds(out)) >= cut + 2,
               cluster, 120)
        at["w2 readdressed"] = time.monotonic() - t0
        net.readdress("w2", "198.51.100.77")
        cut = len(rounds(out))
        _until("w2 in a round from its new address",
               lambda: any(r > cut + 1 for r in _worker_rounds(out, "w2")), cluster, 120)
        cluster.wait(timeout=timeout)
        at["end"] = time.monotonic() - t0
    finally:
        cluster.stop()
        net.unlimit("w3")
    return at


# ---------------------------------------------------------------------------- SSH into it
SSHD = "/usr/sbin/sshd"


def sshd_unavailable() -> str | None:
    """Why an SSH server cannot run in the namespaces here, or None."""
    if shutil.which("ssh") is None or not Path(SSHD).exists():
        return "openssh-server is not installed (apt-get install openssh-server)"
    return None


class SshNodes:
    """An SSH server in each of ``nodes`` of ``net``, root logging in with one key, as on a
    cloud image; ``key`` is the client's private key. The servers go when it closes."""

    def __init__(self, net: Network, nodes: Sequence[str], folder: Path) -> None:
        self.net, self.nodes, self.folder = net, list(nodes), folder
        self.key = folder / "id_ed25519"
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> SshNodes:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in ("id_ed25519", "host_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            str(self.folder / name)], check=True, capture_output=True)
        (self.folder / "authorized_keys").write_text(
            (self.folder / "id_ed25519.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # the server's privilege-separation directory
        try:
            for node in self.nodes:
                conf = self.folder / f"sshd-{node}.conf"
                conf.write_text("\n".join([
                    f"ListenAddress {self.net.address[node]}", "Port 22",
                    f"HostKey {self.folder / 'host_ed25519'}",
                    f"AuthorizedKeysFile {self.folder / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                    f"PidFile {self.folder / f'sshd-{node}.pid'}", ""]))
                log = open(self.folder / f"sshd-{node}.log", "wb")  # noqa: SIM115
                self.procs.append(self.net.popen(node, [SSHD, "-D", "-e", "-f", str(conf)],
                                                 stdout=log, stderr=subprocess.STDOUT))
                log.close()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for p in self.procs:
            kill_tree(p)
        self.procs.clear()

    def ssh_args(self) -> str:
        """What Ansible (or ssh) needs to reach the nodes."""
        return "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes"


def nft_unavailable() -> str | None:
    """Why a namespace cannot have an nftables firewall here, or None."""
    if shutil.which("nft") is None:
        return "nftables is not installed (apt-get install nftables)"
    why = unavailable()
    if why:
        return why
    probe = f"{PREFIX}{os.getpid()}nftprobe"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    try:
        done = subprocess.run(["ip", "netns", "exec", probe, "nft", "add", "table", "inet",
                               "probe"], capture_output=True, text=True)
        return (None if done.returncode == 0 else
                f"nft cannot make a table in a namespace: {done.stderr.strip()}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def security_group_ruleset(rules: Sequence[dict[str, Any]]) -> str:
    """An nftables ruleset that admits to a node what an OpenStack security group with these
    ingress ``rules`` does (each ``protocol``, ``port_range_min`` / ``max`` and
    ``remote_ip_prefix``, as ansible/roles/fedctl_openstack/tasks/definitions.yml defines
    them) and drops the rest; replies to what the node itself opened pass, as through a
    stateful security group."""
    lines = ["table inet fedctl_security_group {", "  chain input {",
             "    type filter hook input priority filter; policy drop;",
             "    ct state established,related accept", '    iifname "lo" accept']
    for r in rules:
        family = "ip6" if ":" in r["remote_ip_prefix"] else "ip"
        lo, hi = int(r["port_range_min"]), int(r["port_range_max"])
        ports = str(lo) if lo == hi else f"{lo}-{hi}"
        lines.append(f"    {family} saddr {r['remote_ip_prefix']} {r['protocol']} dport "
                     f"{ports} accept")
    return "\n".join([*lines, "  }", "}", ""])


def apply_security_group(net: Network, node: str, rules: Sequence[dict[str, Any]]) -> None:
    """Put :func:`security_group_ruleset` of ``rules`` in force in ``node``'s namespace (it
    goes with the namespace)."""
    subprocess.run(net.command(node, ["nft", "-f", "-"]), input=security_group_ruleset(rules),
                   text=True, check=True, capture_output=True, timeout=30)
