"""Validate a node's cluster.yaml exactly as `fedctl` will load it.

    python check_config.py /opt/fedctl/etc/cluster.yaml.new [--family] [--as NAME]

Runs the installed project's own loader (``common.config.load_config``) and, with ``--family``
(on the master: it imports torch), the model-family and strategy check `fedctl run` does before
it starts processes. ``--as NAME``: name the file NAME in messages (the playbook checks the new
file before it replaces the current one). A bad file exits with status 1
and the loader's one-line message (file, field, what was expected) on stderr; a good one prints a
one-line JSON summary. (A `fedctl check` subcommand would make this script unnecessary.)
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    args = sys.argv[1:]
    family = "--family" in args
    args = [a for a in args if a != "--family"]
    name = None
    if "--as" in args and args.index("--as") + 1 < len(args):
        i = args.index("--as")
        name = args[i + 1]
        del args[i:i + 2]
    if len(args) != 1:
        print("usage: check_config.py CLUSTER_YAML [--family] [--as NAME]", file=sys.stderr)
        return 2
    from common.config import ConfigError, load_config

    try:
        cfg = load_config(args[0])
        if family:
            from master.families import make_server_family

            make_server_family(cfg)
    except (ConfigError, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if name:
            message = message.replace(args[0], name)
        print(message, file=sys.stderr)
        return 1
    print(json.dumps({"config": name or args[0], "family": cfg.family, "rounds": cfg.rounds,
                      "workers": [w.name for w in cfg.workers],
                      "master": cfg.master.rep_endpoint}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
