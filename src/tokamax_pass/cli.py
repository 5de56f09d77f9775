"""`tokamax-pass`: the command line. Each subcommand lives in `tokamax_pass.commands.<name>`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence

# Subcommand modules; each defines `add_parser(subparsers)` and `run(args) -> int`.
COMMANDS = ("demo", "autotune", "cache", "bound-args", "export", "inspect")
# Set to see the traceback of an error the command line reports in one line.
TRACEBACK_ENV = "TOKAMAX_PASS_TRACEBACK"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokamax-pass",
        description="Run the demo, autotune a function, export a tuned StableHLO artifact, "
                    "inspect one, and manage the autotuning cache (docs/cli.md).")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in COMMANDS:
        module = importlib.import_module(f"tokamax_pass.commands.{name.replace('-', '_')}")
        module.add_parser(subparsers)
        modules[name] = module
    args = parser.parse_args(argv)
    formatwarning = warnings.formatwarning
    if not os.environ.get(TRACEBACK_ENV):
        # The format only: code that records warnings (`catch_warnings(record=True)`)
        # still gets them.
        warnings.formatwarning = _warning_line(args.command)
    try:
        status = modules[args.command].run(args)
        sys.stdout.flush()  # a reader that left is found here, not at interpreter exit
        return status
    except BrokenPipeError:
        return _reader_left()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # A command's own one-line message, prefixed as every error line is.
        message = e.code.removeprefix(f"{args.command}: ")
        raise SystemExit(f"tokamax-pass {args.command}: {message}") from None
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        # Bad input (a missing file, a corrupt JSON, a bad option) ends in one line naming
        # it, as argparse's errors do, not a traceback through our modules.
        if os.environ.get(TRACEBACK_ENV):
            raise
        message = " ".join(str(e).split()).removeprefix(f"{args.command}: ")
        message = message or type(e).__name__
        raise SystemExit(f"tokamax-pass {args.command}: {type(e).__name__}: {message} "
                         f"(set {TRACEBACK_ENV}=1 for the traceback)") from None
    finally:
        warnings.formatwarning = formatwarning


def _reader_left() -> int:
    """The reader of standard output closed it (`tokamax-pass inspect DIR | head`): stop
    without an error line, as Unix tools do, with a failing status, as Python's own
    `BrokenPipeError` exit has. Standard output is pointed at the null device, so the
    flush at interpreter exit writes nowhere instead of raising again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    return 1


def _warning_line(command: str) -> Callable[..., str]:
    """`warnings.formatwarning` for `command`: one line, `tokamax-pass CMD: Category:
    message`, as its errors are, in place of Python's `file:line: Category: message` and
    the source line, which name the library's code (or `<frozen runpy>`), not the user's
    input."""

    def format_line(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, line: str | None = None) -> str:
        del filename, lineno, line  # the library's code, not what the user can change
        text = " ".join(str(message).split()).removeprefix(f"{command}: ")
        return f"tokamax-pass {command}: {category.__name__}: {text}\n"

    return format_line


if __name__ == "__main__":
    sys.exit(main())
