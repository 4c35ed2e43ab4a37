"""``python -m fedctl``: the command line."""

from fedctl.cli import entry

entry()
