"""Per-call overhead of `tokamax_pass.optimize` against `jax.jit`, on a small function.

    python -m benchmarks.optimize_overhead [--calls N] [--rounds R]

Both wrap the same function (a layer norm and a scale, (8, 128) float32); after the
first call each dispatches a cached executable, so the difference is the wrapper's
own cost. Rounds alternate between the two and the medians are compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

import tokamax_pass as tokamax


def small_function(x: jax.Array, scale: jax.Array) -> jax.Array:
    return tokamax.layer_norm(x, scale=scale, offset=None) * 2.0


def per_call_us(f: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimize_overhead",
                                     description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    inputs = (jax.random.normal(jax.random.key(0), (8, 128)),
              jax.random.normal(jax.random.key(1), (128,)))
    wrappers = {"jax.jit": jax.jit(small_function),
                "tokamax.optimize": tokamax.optimize(small_function)}
    for f in wrappers.values():
        jax.block_until_ready(f(*inputs))
    times: dict[str, list[float]] = {name: [] for name in wrappers}
    for _ in range(args.rounds):
        for name, f in wrappers.items():
            times[name].append(per_call_us(f, inputs, args.calls))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:<18} {median:7.2f} us per call (median of {args.rounds} rounds)")
    ratio = medians["tokamax.optimize"] / medians["jax.jit"]
    print(f"optimize / jit: {ratio:.3f} on {jax.devices()[0].device_kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
