"""`tokamax-pass`: the command line. Each subcommand lives in `tokamax_pass.commands.<name>`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules; each defines `add_parser(subparsers)` and `run(args) -> int`.
COMMANDS = ("demo", "autotune", "cache", "bound-args", "export", "inspect")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokamax-pass", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in COMMANDS:
        module = importlib.import_module(f"tokamax_pass.commands.{name.replace('-', '_')}")
        module.add_parser(subparsers)
        modules[name] = module
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
