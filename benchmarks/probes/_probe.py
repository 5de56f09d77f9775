"""What the device probes share: each phase in a subprocess with a timeout (a deadlocked
kernel costs its phase, not the run, nor the machine), one timing per variant, a JSON-lines
log, and the numerics checks."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any


class JsonLines:
    """`log(**row)`: prints the row and appends it to `path` as one JSON line, stamped with
    the seconds since the log was made (`t`), so a run cut short keeps what it measured."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.start = time.time()

    def __call__(self, **row: Any) -> None:
        row["t"] = round(time.time() - self.start, 1)
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def relative_error(got: Any, want: Any) -> float:
    """`|got - want| / |want|` (Frobenius norms), both taken in float32."""
    import jax.numpy as jnp

    got, want = (jnp.asarray(a, jnp.float32) for a in (got, want))
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def with_vjp(f: Callable[..., Any]) -> Callable[..., Any]:
    """`(*primals, cotangent) -> (f(*primals), f's VJP at cotangent)`: a forward and
    backward to check or time as one function."""
    import jax

    def run(*args: Any) -> Any:
        *primals, cotangent = args
        out, pullback = jax.vjp(f, *primals)
        return out, pullback(cotangent)
    return run


def device_ms(fn: Callable[..., Any], *args: Any) -> float:
    """Median device time of `fn(*args)` in ms, timed by `tokamax_pass.benchmarking` (CUPTI
    on a GPU, after warm-up)."""
    from tokamax_pass.benchmarking import compile_benchmark, standardize_function

    f_std, std_args = standardize_function(fn, *args)
    return compile_benchmark(f_std, std_args)(std_args).median_evaluation_time_ms


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
