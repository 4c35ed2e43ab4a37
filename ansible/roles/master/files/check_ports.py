"""Check that the master's ports can be bound, before the master is started.

    python check_ports.py CONFIG BIND master.pub_port=5555 master.rep_port=5556

Binds each port the way ZeroMQ does (SO_REUSEADDR, so a port left in TIME_WAIT by the previous
job counts as free) and releases it. A port that is taken exits with status 1 and one line naming
the field: ``/opt/fedctl/etc/cluster.yaml: master.pub_port: port 5555 is in use on this host``.
"""

from __future__ import annotations

import errno
import socket
import sys


def main() -> int:
    config, bind, *fields = sys.argv[1:]
    host = "" if bind in ("*", "0.0.0.0") else bind
    for item in fields:
        field, _, port = item.partition("=")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, int(port)))
                sock.listen(1)
            except OSError as exc:
                why = ("is in use on this host" if exc.errno == errno.EADDRINUSE
                       else f"cannot be bound on {bind!r} ({exc.strerror})")
                print(f"{config}: {field}: port {port} {why}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
