"""`tokamax-pass bound-args`: list the op calls of a profile or a function as JSON."""

from __future__ import annotations

import argparse

from tokamax_pass.commands import _argtypes, _target


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bound-args", help="write the op calls of a profile or a function as JSON",
        description="From --xplane_file (a jax.profiler trace) or MODULE:FUNCTION --args, "
                    "writes the bound arguments JSON that `tokamax-pass autotune "
                    "--bound-args` and `tokamax_pass.autotuning.bound_args_from_json` read.")
    _target.add_function_arguments(parser, required=False)
    parser.add_argument("--xplane_file", "--xplane-file", type=_argtypes.non_empty,
                        help="an .xplane.pb profile")
    parser.add_argument("--output_file", "--output-file", "-o", required=True,
                        type=_argtypes.non_empty)


def run(args: argparse.Namespace) -> int:
    from tokamax_pass import autotuning
    from tokamax_pass.core import checks
    from tokamax_pass.tools import xplane_to_bound_args

    if (args.function is None) == (args.xplane_file is None):
        raise SystemExit("give either --xplane_file FILE or MODULE:FUNCTION (with --args)")
    checks.file_to_write("bound-args", "--output_file", args.output_file)  # before the work
    if args.xplane_file:
        # A directory failed with a bare `[Errno 21] Is a directory` naming no option.
        checks.file_to_read("bound-args", "--xplane_file", args.xplane_file)
        return xplane_to_bound_args.convert(args.xplane_file, args.output_file)
    f = _target.load_function(args.function, args.grad)
    bound = autotuning.get_bound_args(f, *_target.parse_args(args.args))
    autotuning.bound_args_to_json(bound, args.output_file)
    print(f"wrote {len(bound)} op calls to {args.output_file}")
    return 0
