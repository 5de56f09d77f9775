"""The calibration sweep: every implementation (and cheap peer) over a grid of op calls,
forward op and VJP op timed apart, on the device; then the fit into a calibration file.

    python -m benchmarks.sweep run --families ragged_dot,layer_norm --max-seconds 480 \\
        --seed 0 --out sweep.jsonl
    python -m benchmarks.sweep fit sweep.jsonl [more.jsonl ...] [--out FILE.json]

`run` visits the grid (`benchmarks.shapes`) in a random order drawn from `--seed`, so
invocations with other seeds reach other calls first; it skips what `--out` already
holds and appends a line a measurement, so a killed run keeps what it measured. Times are
device times (CUPTI on a GPU: `tokamax_pass.benchmarking`), the median of many runs
after a warm-up, as many as the per-call budget (`--call-seconds`) allows. Each file
also gets the device's ceilings once (`CEILINGS`: dense matmuls, a copy). `fit` turns
the measurements of our implementations into the calibration `None` predicts from
(`tokamax_pass.core.prediction`) and prints how well it predicts held-out calls.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import importlib
import importlib.util
import json
import os
import pathlib
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import shapes
from tokamax_pass import benchmarking
from tokamax_pass.core import registry
from tokamax_pass.core.device import device_kind_key

DIRECTIONS = {"forward": "forward", "vjp": "vjp"}
MIN_ITERATIONS = 3


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def ours(family: str) -> dict[str, Callable[..., Any]]:
    """Our implementations of `family`, by name, as functions of the call's arguments."""
    package = "attention" if family == "dot_product_attention" else family
    importlib.import_module(f"tokamax_kernels.{package}")  # registers the family
    fam = registry.families()[family]

    def call(name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: fam(name, *args, **kwargs)

    return {name: call(name) for name in fam.implementations}


def peers(family: str) -> dict[str, Callable[..., Any]]:
    """What a user calls in place of `family`: the plain-JAX functions where they are
    cheap, and upstream Tokamax's op (`implementation=None`) where its package is
    importable (`benchmarks/peers/README.md` says how to install it beside ours)."""
    found: dict[str, Callable[..., Any]] = {}
    if family == "ragged_dot":
        found["jax.lax.ragged_dot"] = jax.lax.ragged_dot
    if family == "dot_product_attention":
        def nn(implementation: str) -> Callable[..., Any]:
            return lambda q, k, v, is_causal=False: jax.nn.dot_product_attention(
                q, k, v, is_causal=is_causal, implementation=implementation)
        found.update({"jax.nn xla": nn("xla"), "jax.nn cudnn": nn("cudnn")})
    upstream = _upstream_tokamax()
    if upstream is not None and hasattr(upstream, family):
        found["upstream tokamax None"] = getattr(upstream, family)
    return found


@functools.cache
def _upstream_tokamax() -> Any:
    """The upstream Tokamax package, or `None` where it is not installed."""
    if importlib.util.find_spec("tokamax") is None:
        return None
    try:
        return importlib.import_module("tokamax")
    except Exception as e:  # noqa: BLE001 - a broken install is reported, not fatal
        print(f"upstream tokamax not usable: {_short_error(e)}", file=sys.stderr)
        return None


@contextlib.contextmanager
def device_turn(lock: pathlib.Path | None) -> Iterator[None]:
    """Holds `lock` (an exclusive file lock shared by the workers of one sweep) while the
    caller times on the device, so workers compile side by side but time one at a time."""
    if lock is None:
        yield
        return
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def time_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              mode: benchmarking.Mode, *, seed: int, iterations: int, budget_s: float,
              method: str | None = None, lock: pathlib.Path | None = None) -> dict[str, Any]:
    """`{"ms", "method", "iterations"}` for `fn(*args, **kwargs)` in `mode`, or
    `{"error"}`: the median device time of up to `iterations` runs after a warm-up, fewer
    where `budget_s` (compile included) would not hold them."""
    start = time.perf_counter()
    try:
        f_std, arrays = benchmarking.standardize_function(fn, *args, kwargs=kwargs, mode=mode,
                                                          seed=seed)
        # Lowering (tracing, Pallas kernels' compilation) runs beside the other workers;
        # XLA's compile runs on the device's turn, as its autotuner times kernels there.
        jax.jit(f_std).lower(arrays)
        with device_turn(lock):
            run = benchmarking.compile_benchmark(f_std, arrays)
            data = run(arrays, iterations=MIN_ITERATIONS, method=method)
            left = budget_s - (time.perf_counter() - start)
            more = min(iterations,
                       int(left / max(data.median_evaluation_time_ms * 2e-3, 1e-6)))
            if more > MIN_ITERATIONS:
                data = run(arrays, iterations=more, method=method)
    except Exception as e:  # noqa: BLE001 - a call an implementation cannot run is a result
        return {"error": _short_error(e)}
    return {"ms": data.median_evaluation_time_ms, "method": data.method,
            "iterations": len(data.evaluation_times_ms)}


def _matmul(size: int, dtype: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    x = jax.ShapeDtypeStruct((size, size), jnp.dtype(dtype))
    return jnp.matmul, (x, x), {"flops": 2.0 * size**3, "bytes": 3.0 * x.size * x.dtype.itemsize}


def _copy(elements: int) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    x = jax.ShapeDtypeStruct((elements,), jnp.float32)
    return (lambda a: a * 2.0), (x,), {"flops": float(elements), "bytes": 8.0 * elements}


def ceilings(tiny: bool) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict]]:
    """The device's rates, each by the simplest program that reaches it: a dense matmul in
    bf16 and in f32 (XLA's default precision), and an elementwise pass over memory."""
    return {"matmul bfloat16": _matmul(256 if tiny else 8192, "bfloat16"),
            "matmul float32": _matmul(256 if tiny else 8192, "float32"),
            "copy": _copy(2**16 if tiny else 2**28)}


def _measure_ceilings(f: Any, done: set[str], device_kind: str, *, seed: int, tiny: bool,
                      iterations: int, budget_s: float, method: str | None,
                      lock: pathlib.Path | None = None) -> int:
    written = 0
    for name, (fn, args, work) in ceilings(tiny).items():
        row = {"family": "ceiling", "params": work, "implementation": name, "kind": "ceiling",
               "direction": "forward", "device_kind": device_kind}
        if _row_key(row) in done:
            continue
        row.update(time_call(fn, args, {}, "forward", seed=seed, iterations=iterations,
                             budget_s=budget_s, method=method, lock=lock))
        f.write(json.dumps(row) + "\n")
        f.flush()
        written += 1
        print(f"ceiling {name}: {row.get('ms', row.get('error'))}", flush=True)
    return written


def source_commit() -> str:
    """The git commit of the code that measured, for the provenance of a results file:
    `$TOKAMAX_PASS_SOURCE_COMMIT` where set (a copy of a working tree whose `.git` is not
    its own), else the checkout's, else `"unknown"`."""
    if os.environ.get("TOKAMAX_PASS_SOURCE_COMMIT"):
        return os.environ["TOKAMAX_PASS_SOURCE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=pathlib.Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _row_key(row: dict[str, Any]) -> str:
    return json.dumps([row["family"], row["params"], row["implementation"], row["direction"]],
                      sort_keys=True)


def _done(out: pathlib.Path) -> set[str]:
    if not out.exists():
        return set()
    keys = set()
    for line in out.read_text().splitlines():
        try:
            keys.add(_row_key(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a killed run
    return keys


def _plan(families: list[str], seed: int, tiny: bool,
          shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[str, dict[str, Any]]]:
    """The grid calls in the order `seed` draws; `shard=(i, n)`: every n-th from the i-th."""
    calls = [(family, p) for family in families for p in shapes.grid(family, tiny)]
    random.Random(seed).shuffle(calls)
    yield from calls[shard[0]::shard[1]]


def run_sweep(families: list[str], out: pathlib.Path, *, seed: int, max_seconds: float,
              call_seconds: float, iterations: int, tiny: bool = False,
              method: str | None = None, shard: tuple[int, int] = (0, 1),
              lock: pathlib.Path | None = None) -> int:
    """Measures grid calls until `max_seconds` pass; returns the number of rows written.
    `shard` and `lock`: this process's share of the calls and the device lock of a sweep
    split over workers (`run_workers`)."""
    deadline = time.monotonic() + max_seconds
    done = _done(out)
    device_kind = jax.devices()[0].device_kind
    written = 0
    with out.open("a") as f:
        if time.monotonic() < deadline and shard[0] == 0:
            written += _measure_ceilings(f, done, device_kind, seed=seed, tiny=tiny,
                                         iterations=iterations, budget_s=call_seconds,
                                         method=method, lock=lock)
        for family, params in _plan(families, seed, tiny, shard):
            candidates = [("ours", n, fn) for n, fn in ours(family).items()] + [
                ("peer", n, fn) for n, fn in peers(family).items()]
            args, kwargs = shapes.build(family, params, seed)
            for kind, name, fn in candidates:
                for direction, mode in DIRECTIONS.items():
                    row = {"family": family, "params": params, "implementation": name,
                           "kind": kind, "direction": direction, "device_kind": device_kind}
                    if _row_key(row) in done:
                        continue
                    if time.monotonic() > deadline:
                        return written
                    budget = min(call_seconds, deadline - time.monotonic())
                    row.update(time_call(fn, args, kwargs, mode, seed=seed,
                                         iterations=iterations, budget_s=budget,
                                         method=method, lock=lock))
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    written += 1
                    shown = f"{row['ms']:.4f} ms" if "ms" in row else row["error"][:80]
                    print(f"{family} {params} {name} {direction}: {shown}", flush=True)
    return written


def start_workers(module: str, argv: list[str], lock: pathlib.Path,
                  outputs: list[pathlib.Path], output_flag: str) -> list[subprocess.Popen[bytes]]:
    """Starts `python -m module argv` once per file of `outputs`, each with its shard
    (`--shard I/N`), the device `lock` they take turns on (`device_turn`), and its output
    file after `output_flag`."""
    # Each worker returns device memory between calls (JAX's default allocator keeps what
    # it grew to, and workers that each hold their largest call's memory run out).
    env = {**os.environ, "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    return [subprocess.Popen([sys.executable, "-m", module, *argv,
                              "--shard", f"{i}/{len(outputs)}", "--lock", str(lock),
                              output_flag, str(part)], env=env)
            for i, part in enumerate(outputs)]


def run_workers(workers: int, out: pathlib.Path, argv: list[str]) -> int:
    """Runs the sweep `argv` describes in `workers` processes, each its shard of the calls
    into a file of its own, taking turns on the device (`device_turn`) while the others
    compile; then appends their rows to `out`. Returns the number of rows added."""
    lock = out.with_name(out.name + ".lock")
    parts = [out.with_name(f"{out.name}.worker{i}") for i in range(workers)]
    processes = start_workers("benchmarks.sweep", argv, lock, parts, "--out")
    failed = [p.args for p in processes if p.wait() != 0]
    added = 0
    with out.open("a") as f:
        for part in parts:
            if part.exists():
                lines = [line for line in part.read_text().splitlines() if line.strip()]
                f.writelines(line + "\n" for line in lines)
                added += len(lines)
                part.unlink()
    if failed:
        raise RuntimeError(f"sweep workers failed: {failed}")
    return added


def shard_argument(text: str) -> tuple[int, int]:
    """`--shard I/N`: this worker's index and the number of workers."""
    index, _, count = text.partition("/")
    shard = int(index), int(count)
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"--shard takes I/N with 0 <= I < N, got {text!r}")
    return shard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="measure grid calls on this device")
    run.add_argument("--families", default=",".join(shapes.FAMILIES),
                     help="comma-separated op families (default: all)")
    run.add_argument("--max-seconds", type=float, default=450.0,
                     help="stop starting measurements after this long")
    run.add_argument("--call-seconds", type=float, default=15.0,
                     help="time budget of one measurement, compile included")
    run.add_argument("--iterations", type=int, default=50, help="timed runs a measurement")
    run.add_argument("--seed", type=int, default=0, help="order of the grid; random inputs")
    run.add_argument("--out", type=pathlib.Path, default=None,
                     help="JSON-lines file to append to (default: "
                          "benchmarks/results/<device>/sweep.jsonl)")
    run.add_argument("--tiny", action="store_true", help="a few small calls (CPU check)")
    run.add_argument("--workers", type=int, default=1,
                     help="processes that compile side by side and time in turn")
    run.add_argument("--shard", type=shard_argument, default=(0, 1), help=argparse.SUPPRESS)
    run.add_argument("--lock", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    run.add_argument("--method", choices=benchmarking.METHODS, default=None,
                     help="timer (default: the best available, CUPTI on a GPU)")
    fit = commands.add_parser("fit", help="write a calibration file from sweep results")
    fit.add_argument("results", type=pathlib.Path, nargs="+", help="sweep JSON-lines files")
    fit.add_argument("--out", type=pathlib.Path, default=None,
                     help="calibration file (default: the package's, for the results' device)")
    fit.add_argument("--holdout", type=float, default=0.2,
                     help="fraction of calls held out to report the fit's quality")
    fit.add_argument("--seed", type=int, default=0, help="which calls are held out")
    options = parser.parse_args(argv)
    if options.command == "run":
        families = [f for f in options.families.split(",") if f]
        unknown = set(families) - set(shapes.FAMILIES)
        if unknown:
            parser.error(f"unknown families {sorted(unknown)}; known: {shapes.FAMILIES}")
        out = options.out or (pathlib.Path(__file__).parent / "results" /
                               device_kind_key(jax.devices()[0].device_kind) / "sweep.jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        if options.workers > 1:
            argv = list(sys.argv[1:] if argv is None else argv)
            forwarded = [a for i, a in enumerate(argv) if a != "--workers"
                         and (i == 0 or argv[i - 1] != "--workers")
                         and not a.startswith("--workers=")]
            forwarded = [a for i, a in enumerate(forwarded)
                         if a != "--out" and (i == 0 or forwarded[i - 1] != "--out")]
            print(f"wrote {run_workers(options.workers, out, forwarded)} rows to {out}")
            return 0
        written = run_sweep(families, out, seed=options.seed, max_seconds=options.max_seconds,
                            call_seconds=options.call_seconds, iterations=options.iterations,
                            tiny=options.tiny, method=options.method, shard=options.shard,
                            lock=options.lock)
        print(f"wrote {written} rows to {out}")
        return 0
    from benchmarks import sweep_fit

    return sweep_fit.fit(options.results, options.out, holdout=options.holdout,
                         seed=options.seed)


if __name__ == "__main__":
    sys.exit(main())
