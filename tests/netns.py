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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


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
