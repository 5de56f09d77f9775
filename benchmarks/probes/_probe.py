"""What the device probes share: each phase in a subprocess with a timeout (a deadlocked
kernel costs its phase, not the run, nor the machine), and one timing per variant."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any


def run_phases(argv: list[str], script: str, phases: Mapping[str, tuple[Callable[[], None], int]],
               log: Callable[[dict], None]) -> int:
    """`script --phase NAME` runs phase NAME here; otherwise each phase named in `argv` (all
    by default) runs as `script --phase NAME` in a subprocess limited to its seconds, and a
    failed or timed-out phase is logged."""
    if argv and argv[0] == "--phase":
        phases[argv[1]][0]()
        return 0
    for phase in argv or list(phases):
        timeout = phases[phase][1]
        try:
            result = subprocess.run([sys.executable, script, "--phase", phase], timeout=timeout)
            if result.returncode:
                log(dict(phase=phase, exit=result.returncode))
        except subprocess.TimeoutExpired:
            log(dict(phase=phase, timeout=timeout))
    return 0


def timed(record: dict, fn: Callable, args: tuple, flops: float) -> Any:
    """`fn(*args)` once (its result is returned, for numerics checks), then timed by
    `tokamax_pass.benchmarking` (CUPTI on a GPU, median after warm-up): `ms`, `tflops` and
    `timer` go into `record`. An exception goes into `record["error"]` (returns None)."""
    from tokamax_pass.benchmarking import compile_benchmark, standardize_function

    try:
        result = fn(*args)
        f_std, std_args = standardize_function(fn, *args)
        data = compile_benchmark(f_std, std_args)(std_args)
    except Exception as e:  # noqa: BLE001
        record.update(error=f"{type(e).__name__}: {str(e)[:800]}")
        return None
    ms = data.median_evaluation_time_ms
    record.update(ms=ms, tflops=flops / ms / 1e9, timer=data.method)
    return result


def random_normal(seed: int, shape: tuple[int, ...], dtype: Any = None) -> Any:
    """Fresh random normal inputs (never zeros), drawn in float32 and cast to `dtype`."""
    import jax
    import jax.numpy as jnp

    values = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return values if dtype is None else values.astype(dtype)


def seed_f_grad_loss(x: Any, scale: Any) -> Any:
    """The seed-usage program whose `jax.grad` the autotuning probes tune: layer norms and
    attentions with pinned and open implementations."""
    import jax.numpy as jnp

    import tokamax_pass as tokamax

    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation="triton")
    x = tokamax.dot_product_attention(x, x, x, implementation="xla_chunked")
    x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=None)
    x = tokamax.dot_product_attention(x, x, x, implementation="mosaic")
    return jnp.sum(x)


def device_time_ms(f: Callable, x: Any, scale: Any) -> float:
    """Median device time of `f(x=x, scale=scale)` over 20 calls after warm-up."""
    from tokamax_pass import benchmarking

    f_std, args = benchmarking.standardize_function(f, kwargs={"x": x, "scale": scale})
    run = benchmarking.compile_benchmark(f_std, args)
    return run(args, iterations=20).median_evaluation_time_ms
