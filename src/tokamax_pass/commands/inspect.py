"""`tokamax-pass inspect FILE`: the ops, kernels and configs in an artifact or StableHLO."""

from __future__ import annotations

import argparse
import json

from tokamax_pass.commands import _argtypes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="list the ops, kernels and configs in an artifact or StableHLO",
        description="FILE is an artifact directory (from `tokamax-pass export`), a serialized "
                    ".stablehlo file, or a .mlir / lowered-text / HLO-text file.")
    parser.add_argument("file", type=_argtypes.non_empty,
                        help="artifact directory or StableHLO file")
    parser.add_argument("--json", action="store_true", help="print the ops as JSON")


def run(args: argparse.Namespace) -> int:
    from tokamax_pass.core.spec import SpecError
    from tokamax_pass.export import inspect

    try:
        found = inspect(args.file)
    except (OSError, SpecError, ValueError) as e:
        message = str(e)  # most already start "inspect: ", which was printed twice
        raise SystemExit(message if message.startswith("inspect:")
                         else f"inspect: {message}") from None
    if args.json:
        print(json.dumps({
            "ops": [{"op": o.op, "implementation": o.implementation, "config": o.config,
                     "arguments": o.arguments, "instructions": o.instructions, "spec": o.spec}
                    for o in found.ops],
            "custom_calls": list(found.custom_calls),
            "manifest": found.manifest,
        }, indent=2))
    else:
        print(found)
    return 0
