"""Tunes the benchmark workloads and writes the library cache shipped for this device kind.

    python -m benchmarks.tune_library_cache [--only SUBSTRING ...] [--output DIR] [--force]
    python -m benchmarks.tune_library_cache --stale   # retune only the stale shipped entries
    python -m benchmarks.tune_library_cache --merge RESULT.json ...   # ship dumped results
    python -m benchmarks.tune_library_cache --drop-stale   # no device: forget stale entries
    python -m benchmarks.tune_library_cache --restamp   # no device: a refactor kept the programs

Every op call of each workload's gradient program (forward and VJP ops) is timed with
every implementation of its family and their configs (`all_implementations=True`),
so `implementation=None` picks by measurement and every implementation gets its
best config. Results merge into `DIR/<device_kind>/<implementation>.json` (default:
the package's `src/tokamax_pass/data/autotuning`), which `tokamax_pass` reads as the
library cache. A call some cache already answers (the shipped one included) is skipped
unless `--force`. `--stale` retunes just the shipped entries whose kernel source changed
(the same op calls, the same implementation), so a kernel edit costs its own retuning.
`--merge` ships autotuning results dumped elsewhere (the model suite's `--tuned-dir`
on the device), failures dropped, so `None` knows the models' own shapes.
`--drop-stale` (any machine, for the H200 cache unless `--device-kind`) deletes the stale
entries instead: `None` then runs the plain-JAX path on their shapes until they are retuned.
`--restamp` (any machine) gives the stale entries the current provenance, keeping their
measurements: only for a change that leaves every kernel's program as it was (a renamed
helper, a moved function), which the change's reviewer checks in its diff.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import workloads as wl
from tokamax_pass.autotuning import cache, keys
from tokamax_pass.autotuning.autotuner import Autotuner, candidate_configs
from tokamax_pass.core.device import device_kind_key

PACKAGE_CACHE = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning"


def gradient_program(workload: wl.Workload) -> tuple[Any, tuple[Any, ...]]:
    """`jax.grad` of the workload's `implementation=None` call (the sum of all its outputs:
    a norm with a residual returns two), and its inputs."""
    args = workload.make()
    fn = workload.ours["tokamax None"]
    argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def loss(*a: Any) -> jax.Array:
        return sum(jnp.sum(out.astype(jnp.float32)) for out in jax.tree.leaves(fn(*a)))

    return jax.grad(loss, argnums=argnums), args


LIBRARY_MAX_CONFIGS = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_library_cache",
                                     description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="workloads whose name has these")
    parser.add_argument("--output", default=str(PACKAGE_CACHE), help="the data/autotuning dir")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script")
    parser.add_argument("--force", action="store_true",
                        help="retune the calls a cache already answers (the shipped one too)")
    parser.add_argument("--stale", action="store_true",
                        help="retune only the shipped entries whose provenance is stale")
    parser.add_argument("--merge", nargs="+", metavar="RESULT",
                        help="autotuning result files (AutotuningResult.dump) to ship")
    parser.add_argument("--drop-stale", action="store_true",
                        help="delete the stale entries of the shipped cache (no device needed)")
    parser.add_argument("--restamp", action="store_true",
                        help="stamp the stale entries as current, measurements kept (only "
                             "after a change that keeps every kernel's program)")
    parser.add_argument("--device-kind", default="NVIDIA H200",
                        help="the cache --drop-stale and --restamp edit")
    args = parser.parse_args(argv)
    if args.restamp:
        return restamp(pathlib.Path(args.output) / device_kind_key(args.device_kind))
    if args.drop_stale:
        return drop_stale(pathlib.Path(args.output) / device_kind_key(args.device_kind))
    if args.merge:
        return merge(args.merge, pathlib.Path(args.output))
    if args.stale:
        return retune_stale(pathlib.Path(args.output))
    candidates = wl.smoke_workloads() if args.smoke else wl.all_workloads()
    for workload in candidates:
        if args.only and not any(s in workload.name for s in args.only):
            continue
        program, inputs = gradient_program(workload)
        start = time.perf_counter()
        # Shipped once for every user: a wider search than `autotune`'s default, losing
        # implementations' configs included (they stand in for neighbouring shapes).
        result = tokamax.autotune(program, *inputs, ignore_cache=args.force,
                                  all_implementations=True, search_losers=True,
                                  max_configs=LIBRARY_MAX_CONFIGS, progress=False)
        seconds = time.perf_counter() - start
        written = cache.write_library_cache(result, args.output)
        skipped = "" if list(result) else " (a cache answers every call: --force retunes them)"
        print(f"{workload.name}: {len(list(result))} op calls tuned in {seconds:.1f} s -> "
              f"{', '.join(pathlib.Path(w).name for w in written)}{skipped}", flush=True)
    return 0


def merge(paths: list[str], output: pathlib.Path) -> int:
    """Writes the fresh, successful measurements of dumped results into the library cache."""
    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    for path in paths:
        result = tokamax.AutotuningResult.load(path).without_errors()
        fresh = [e for e in result.entries
                 if e.data and keys.stale_reason(e.bound.op, e.provenance) is None]
        written = cache.write_library_cache(
            tokamax.AutotuningResult(result.device_kind, fresh), output)
        print(f"{path}: {len(fresh)} of {len(result)} entries shipped -> "
              f"{', '.join(pathlib.Path(w).name for w in written)}", flush=True)
    return 0


def stale_calls(folder: pathlib.Path) -> list[Any]:
    """The op calls (`BoundArguments`) of the entries in `folder` that are stale here."""
    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    calls = []
    for path in sorted(folder.glob("*.json")):
        for entry in tokamax.AutotuningResult.load(path).entries:
            if keys.stale_reason(entry.bound.op, entry.provenance) is not None:
                calls.append(entry.bound)
    return calls


def drop_stale(folder: pathlib.Path) -> int:
    """Rewrites each file of `folder` without its stale entries."""
    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    for path in sorted(folder.glob("*.json")):
        result = tokamax.AutotuningResult.load(path)
        fresh = [e for e in result.entries
                 if keys.stale_reason(e.bound.op, e.provenance) is None]
        if len(fresh) < len(result):
            tokamax.AutotuningResult(result.device_kind, fresh).dump(path)
            print(f"{path.name}: dropped {len(result) - len(fresh)} stale of {len(result)}")
    return 0


def restamp(folder: pathlib.Path) -> int:
    """Rewrites each file of `folder` with its stale entries stamped as current, and says
    which and why they were stale."""
    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    for path in sorted(folder.glob("*.json")):
        result = tokamax.AutotuningResult.load(path)
        entries, restamped = [], 0
        for entry in result.entries:
            reason = keys.stale_reason(entry.bound.op, entry.provenance)
            if reason is None:
                entries.append(entry)
                continue
            print(f"{path.name}: {entry.bound!r}: {reason}: restamped")
            entries.append(dataclasses.replace(entry, provenance=keys.provenance(entry.bound.op)))
            restamped += 1
        if restamped:
            tokamax.AutotuningResult(result.device_kind, entries).dump(path)
    return 0


def retune_stale(output: pathlib.Path) -> int:
    folder = output / device_kind_key(jax.devices()[0].device_kind)
    calls = stale_calls(folder)
    if not calls:
        print(f"{folder}: every entry is fresh")
        return 0
    start = time.perf_counter()
    # The tuner itself, not `autotune`: calls without configs (XLA, cuDNN) are retimed
    # too, since the library ranks implementations by these times.
    entries = Autotuner().tune_many(
        [(ba, candidate_configs(ba, LIBRARY_MAX_CONFIGS)) for ba in calls])
    timed = [e for e in entries if e.fastest is not None]
    result = tokamax.AutotuningResult(jax.devices()[0].device_kind, timed)
    written = cache.write_library_cache(result, output)
    print(f"{len(timed)} of {len(calls)} stale op calls retuned in "
          f"{time.perf_counter() - start:.1f} s -> "
          f"{', '.join(pathlib.Path(w).name for w in written)}", flush=True)
    return report_untimed(entries)


def report_untimed(entries: list[Any]) -> int:
    """1, with each call and its first error printed, if some call got no timed config.

    Such a call keeps its stale entry rather than an empty one: a retune can lose every
    config of a call (large VJP calls' allocations fail on the device), and an empty entry
    written as fresh would send `None` back to its fallback there unnoticed."""
    untimed = [e for e in entries if e.fastest is None]
    for entry in untimed:
        errors = [m.error for m in entry.data.values() if m.error]
        print(f"NOT RETUNED (no config timed; its stale entry is kept): {entry.bound!r}: "
              f"{errors[0][:300] if errors else 'no candidate config'}", flush=True)
    return 1 if untimed else 0


if __name__ == "__main__":
    sys.exit(main())
