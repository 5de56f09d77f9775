"""`tokamax-pass export MODULE:FUNCTION --args SPEC... -o DIR`: a tuned StableHLO artifact."""

from __future__ import annotations

import argparse
import warnings

from tokamax_pass.commands import _argtypes, _target


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="export a function as a tuned StableHLO artifact",
        description="Runs the pass on MODULE:FUNCTION for --args shapes (configs from "
                    "--results, the caches, heuristics) and writes <name>.stablehlo and "
                    "manifest.json into -o DIR.")
    _target.add_function_arguments(parser)
    parser.add_argument("--results", action="append", default=[], metavar="JSON",
                        type=_argtypes.non_empty,
                        help="AutotuningResult JSON whose configs win (repeatable; later wins)")
    parser.add_argument("--platforms", help="comma-separated, e.g. cpu,cuda,tpu (default: the "
                        "platforms of --device-kind, else this machine's backend)")
    parser.add_argument("--device-kind", type=_argtypes.non_empty,
                        help="the device(s) to build for, one per platform, comma-separated, "
                             "e.g. 'NVIDIA H200' or 'NVIDIA H200,TPU v6 lite'")
    parser.add_argument("--autotune", choices=("never", "missing", "always"), default="never",
                        help="measure configs on this machine first (default: never)")
    parser.add_argument("--name", help="artifact file name (default: the function's name)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", type=_argtypes.non_empty,
                        help="directory to write the artifact into")


# Custom calls JAX's export adds that run no kernel: the checks of symbolic dimensions.
_NOT_KERNELS = frozenset({"shape_assertion"})


def run(args: argparse.Namespace) -> int:
    from tokamax_pass.artifact import ExportFallbackWarning, describe_fallbacks
    from tokamax_pass.core import checks
    from tokamax_pass.export import export
    from tokamax_pass.optimize import optimize

    checks.directory_to_write("export", "--output", args.output)  # before the work
    fun = _target.load_function(args.function, args.grad)
    arg_specs = _target.parse_args(args.args, symbolic=True)
    results = [_load_result(path) for path in args.results]
    optimized = optimize(fun, autotune=args.autotune, results=results or None)
    try:
        with warnings.catch_warnings():  # the note below says the same, once
            warnings.simplefilter("ignore", ExportFallbackWarning)
            artifact = export(optimized, *arg_specs, platforms=args.platforms,
                              device_kind=args.device_kind, name=args.name)
    except (ValueError, NotImplementedError) as e:
        message = str(e)  # most already start "export: ", which was printed twice
        raise SystemExit(message if message.startswith("export:")
                         else f"export: {message}") from None
    directory = artifact.save(args.output)
    print(f"wrote {directory / artifact.manifest['file']} and {directory / 'manifest.json'}")
    ops = artifact.manifest["ops"]
    kernels = [name for name in artifact.manifest["custom_calls"] if name not in _NOT_KERNELS]
    print(f"{len(ops)} op(s) on {', '.join(artifact.manifest['platforms'])}; kernels: "
          f"{', '.join(kernels) or 'XLA only'}")
    fallbacks = artifact.manifest["fallbacks"]
    if fallbacks:
        print(f"note: {len(fallbacks)} op call(s) run another implementation than the "
              f"target's own plan, which this machine cannot lower ('fallbacks' in "
              f"manifest.json); export on the target machine to include it:")
        for line in describe_fallbacks(fallbacks):
            print(f"  {line}")
    return 0


def _load_result(path: str):
    from tokamax_pass.autotuning import AutotuningResult
    from tokamax_pass.core.spec import SpecError

    try:
        return AutotuningResult.load(path)
    except (OSError, SpecError) as e:
        raise SystemExit(f"--results {path}: {e}") from None
