"""argparse `type=` checks shared by the subcommands: bad values end in argparse's own
error naming the option, before any work is done."""

from __future__ import annotations

import argparse


def non_empty(text: str) -> str:
    """A path or name that is not `''`. An empty value (often an unset shell variable,
    `-o "$OUT"`) was read as the working directory: `export -o ''` wrote the artifact
    there, `autotune -o ''` wrote no result at all, `cache --cache-dir '' clear` deleted
    the working directory's `*.json` and `cache clear --device-kind ''` every cache file."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"must not be empty, got {text!r} (an unset shell variable?)")
    return text


def positive_int(text: str) -> int:
    """An int >= 1 (a size or a count); a negative size crashed deep in XLA."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value
