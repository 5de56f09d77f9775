"""`tokamax-pass autotune MODULE:FUNCTION --args SPEC... -o result.json` (or a bound-args JSON)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokamax_pass.commands import _argtypes, _target

if TYPE_CHECKING:
    from tokamax_pass.core.bound_arguments import BoundArguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "autotune", help="measure the configs of every op in a function",
        description="Autotunes the ops of MODULE:FUNCTION called with --args shapes, or of a "
                    "bound-arguments JSON file (from `tokamax-pass bound-args`).")
    _target.add_function_arguments(parser, required=False)
    parser.add_argument("--bound-args", type=_argtypes.non_empty,
                        help="a bound-arguments JSON file instead of a function")
    parser.add_argument("-o", "--output", type=_argtypes.non_empty,
                        help="write the AutotuningResult JSON here")
    parser.add_argument("--all-implementations", action="store_true",
                        help="time every implementation of each op family")
    parser.add_argument("--search-losers", action="store_true",
                        help="with --all-implementations, time and search every "
                             "implementation, also those the caches show 2x slower than "
                             "another and those that cannot be chosen after stage one, and "
                             "time again the configs the caches measured losing at the "
                             "call's shape")
    parser.add_argument("--ignore-cache", action="store_true",
                        help="also tune ops the caches already answer")
    parser.add_argument("--cache", action="store_true", help="save the result to the user cache")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per op")
    parser.add_argument("--max-workers", type=int, default=None, help="compile threads")
    parser.add_argument("--max-configs", type=int, default=None,
                        help="configs timed per op, nearest the heuristics (default: "
                             "autotune's; 0: the whole search space)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--write-library-cache", metavar="DIR", type=_argtypes.non_empty,
                        help="also write the result as library-cache files under DIR (the "
                             "package's src/tokamax_pass/data/autotuning to ship it)")


def run(args: argparse.Namespace) -> int:
    from tokamax_pass import autotuning
    from tokamax_pass.autotuning.api import DEFAULT_MAX_CONFIGS
    from tokamax_pass.core import checks

    if (args.function is None) == (args.bound_args is None):
        raise SystemExit("give either MODULE:FUNCTION (with --args) or --bound-args FILE")
    if args.output:  # before tuning, not after it
        checks.file_to_write("autotune", "--output", args.output)
    if args.write_library_cache:
        checks.directory_to_write("autotune", "--write-library-cache", args.write_library_cache)
    target: list[BoundArguments] | Callable[..., Any]
    if args.bound_args:
        target, call_args = autotuning.bound_args_from_json(args.bound_args), []
    else:
        target = _target.load_function(args.function, args.grad)
        call_args = _target.parse_args(args.args)
    # --max-configs 0: no limit; not given: autotune's default.
    max_configs = (DEFAULT_MAX_CONFIGS if args.max_configs is None
                   else args.max_configs or None)
    start = time.perf_counter()
    try:
        result = autotuning.autotune(
            target, *call_args, ignore_cache=args.ignore_cache,
            all_implementations=args.all_implementations, search_losers=args.search_losers,
            timeout=args.timeout,
            max_workers=args.max_workers, cache=args.cache, progress=not args.no_progress,
            max_configs=max_configs)
    except autotuning.UnsavedResultError as e:
        if args.output:  # the result the cache refused still reaches --output
            e.result.dump(args.output)
            print(f"wrote {args.output}")
        raise
    print(result)
    if not len(result) and (note := _nothing_timed_note(args)):
        print(note)
    print(f"autotuning took {time.perf_counter() - start:.1f} s")
    if args.output:
        result.dump(args.output)
        print(f"wrote {args.output}")
    if args.write_library_cache:
        from tokamax_pass.autotuning import cache

        for path in cache.write_library_cache(result, args.write_library_cache):
            print(f"wrote {path}")
    return 0


def _nothing_timed_note(args: argparse.Namespace) -> str | None:
    """Why an empty result can be right, and the option that times more; `None` where
    both options were given (then no op call was found, which autotune warns about)."""
    reasons = []
    if not args.all_implementations:
        reasons.append("runs an implementation that has no configs (on a CPU, usually "
                       "xla; --all-implementations times every implementation of each op)")
    if not args.ignore_cache:
        reasons.append("is answered by the caches (--ignore-cache times it again)")
    if not reasons:
        return None
    return f"note: nothing was timed: each op call found {' or '.join(reasons)}"
