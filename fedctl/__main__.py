"""``python -m fedctl``: the command line."""

from fedctl.cli import main

main()
