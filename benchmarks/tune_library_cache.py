"""Tunes the benchmark workloads and writes the library cache shipped for this device kind.

    python -m benchmarks.tune_library_cache [--only SUBSTRING ...] [--output DIR]

Every op call of each workload's gradient program (forward and VJP ops) is timed with
every implementation of its family and their configs (`all_implementations=True`),
so `implementation=None` picks by measurement and every implementation gets its
best config. Results merge into `DIR/<device_kind>/<implementation>.json` (default:
the package's `src/tokamax_pass/data/autotuning`), which `tokamax_pass` reads as the
library cache.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import workloads as wl
from tokamax_pass.autotuning import cache

PACKAGE_CACHE = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning"


def gradient_program(workload: wl.Workload) -> tuple[Any, tuple[Any, ...]]:
    """`jax.grad` of the workload's `implementation=None` call, and its inputs."""
    args = workload.make()
    fn = workload.ours["tokamax None"]
    argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums), args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="workloads whose name has these")
    parser.add_argument("--output", default=str(PACKAGE_CACHE), help="the data/autotuning dir")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script")
    args = parser.parse_args(argv)
    candidates = wl.smoke_workloads() if args.smoke else wl.all_workloads()
    for workload in candidates:
        if args.only and not any(s in workload.name for s in args.only):
            continue
        program, inputs = gradient_program(workload)
        start = time.perf_counter()
        result = tokamax.autotune(program, *inputs, all_implementations=True, progress=False)
        seconds = time.perf_counter() - start
        written = cache.write_library_cache(result, args.output)
        print(f"{workload.name}: {len(list(result))} op calls tuned in {seconds:.1f} s -> "
              f"{', '.join(pathlib.Path(w).name for w in written)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
