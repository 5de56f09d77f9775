"""Quantized ragged dots against bf16 ones (and upstream Tokamax) at issue 48's goal shapes.

    python -m benchmarks.probes.quantized_ragged_dot [--smoke] [--budget-s S]

Two workloads, 8 groups each, router-like uneven group sizes filling every row:

- `fp8_compute_bound` (m 16384, k 4096, n 4096): float8 e4m3 activations (a scale per
  row) times float8 e4m3 weights (a scale per group and column);
- `int8_memory_bound` (64 rows a group: m 512, k 4096, n 14336): bf16 activations
  times int8 weights (a scale per group and column).

Each runs our quantized `triton` (its heuristics, and on the GPU the tiles of
`TRITON_TILES`; and on the GPU with the weights stored (G, N, K), through
`ragged_dot_general`'s transposed form) and `xla`, our bf16 `triton`, `mosaic` and `xla` on the same
(dequantized) values, and upstream Tokamax's `ragged_dot` on qwix `QArray`s where
`tokamax` and `qwix` import. Every candidate is checked against a float32 HIGHEST
product of the dequantized operands (relative error norm, and upstream's test
tolerances: atol 0.01 / rtol 0.005, or atol 1 / rtol 0.5 for float8 activations), then
timed (`tokamax_pass.benchmarking`, median): forward, and forward with the activations'
gradient (the weights constant in every candidate, bf16 ones too). One JSON line per
measurement goes to `$OUT/quantized_ragged_dot.jsonl` (or the working directory), after
one provenance line (commit, date, jax version, device), then
one summary line per workload: each quantized candidate's speedup over our fastest bf16
kernel and whether it meets the goal (1.5x). `--smoke` runs tiny shapes on CPU (Triton
in Pallas interpret mode) to show the script works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tokamax_pass
from benchmarks.probes.ragged_dot_small_rows import relative_error, router_sizes
from benchmarks.sweep import source_commit
from tokamax_kernels.ragged_dot import PallasTritonRaggedDot, QuantizedArray
from tokamax_kernels.ragged_dot.general import TRANSPOSED_RHS_DIMENSION_NUMBERS
from tokamax_kernels.ragged_dot.pallas_triton import Config as TritonConfig
from tokamax_pass import benchmarking

GOAL_SPEEDUP = 1.5
# The candidate whose weights are stored (G, N, K): its arguments hold them so.
NK_WEIGHTS = "triton (g, n, k) weights"

# Triton tiles tried beside the heuristics' (block_m, block_n, block_k, warps, stages), by
# workload: float8 products want deep steps; few rows a group want narrow row tiles and
# many weight tiles in flight.
TRITON_TILES = {
    "fp8_compute_bound": ((128, 256, 128, 8, 4), (128, 128, 128, 4, 3)),
    "int8_memory_bound": ((64, 128, 64, 4, 6), (64, 64, 64, 4, 8), (64, 128, 128, 4, 4)),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    m: int
    k: int
    n: int
    groups: int
    lhs_qtype: Any  # None: bf16 activations
    rhs_qtype: Any


WORKLOADS = (
    Workload("fp8_compute_bound", 16384, 4096, 4096, 8, jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    Workload("int8_memory_bound", 512, 4096, 14336, 8, None, jnp.int8),
)
SMOKE_WORKLOADS = (
    Workload("fp8_compute_bound", 256, 128, 128, 8, jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    Workload("int8_memory_bound", 64, 128, 256, 8, None, jnp.int8),
)


def operands(w: Workload, seed: int) -> dict[str, Any]:
    """Activations and weights (std 0.1, as upstream's ragged-dot tests draw them), the
    quantized forms, and their float32 dequantized values."""
    keys = jax.random.split(jax.random.key(seed), 2)
    x = (0.1 * jax.random.normal(keys[0], (w.m, w.k))).astype(jnp.bfloat16)
    weights = (0.1 * jax.random.normal(keys[1], (w.groups, w.k, w.n))).astype(jnp.bfloat16)
    rhs = QuantizedArray.quantize(weights, w.rhs_qtype, channelwise_axes=(0, 2))
    lhs = (x if w.lhs_qtype is None
           else QuantizedArray.quantize(x, w.lhs_qtype, channelwise_axes=(0,)))

    def dequantized(a: Any) -> jax.Array:
        if not isinstance(a, QuantizedArray):
            return a.astype(jnp.float32)
        return a.qvalue.astype(jnp.float32) * a.scale.astype(jnp.float32)

    return dict(lhs=lhs, rhs=rhs, lhs_f32=dequantized(lhs), rhs_f32=dequantized(rhs))


def _parts(a: Any) -> tuple[jax.Array, ...]:
    return (a.qvalue, a.scale) if isinstance(a, QuantizedArray) else (a,)


def candidates(w: Workload, on_gpu: bool) -> list[tuple[str, str, Callable[..., Any]]]:
    """`(name, kind, fn)`: kind "quantized" and "upstream" take `fn(lhs parts..., rhs
    qvalue, rhs scale, sizes)`; "bf16" takes `fn(lhs, rhs, sizes)`, the same values
    dequantized to bf16 before timing."""
    lhs_quantized = w.lhs_qtype is not None
    interpret = not on_gpu

    def unpack(args: tuple[jax.Array, ...]) -> tuple[Any, Any, jax.Array]:
        if lhs_quantized:
            lq, ls, rq, rs, sizes = args
            return QuantizedArray(lq, ls), QuantizedArray(rq, rs), sizes
        x, rq, rs, sizes = args
        return x, QuantizedArray(rq, rs), sizes

    def quantized(implementation: Any) -> Callable[..., Any]:
        def fn(*args: jax.Array) -> jax.Array:
            lhs, rhs, sizes = unpack(args)
            return tokamax_pass.ragged_dot(lhs, rhs, sizes, implementation=implementation)
        return fn

    def quantized_nk(implementation: Any) -> Callable[..., Any]:
        """The weights stored (G, N, K), contraction-major (`args` holds them so), through
        `ragged_dot_general`'s transposed form."""
        def fn(*args: jax.Array) -> jax.Array:
            lhs, rhs, sizes = unpack(args)
            return tokamax_pass.ragged_dot_general(
                lhs, rhs, sizes, TRANSPOSED_RHS_DIMENSION_NUMBERS,
                implementation=implementation)
        return fn

    def bf16(implementation: Any) -> Callable[..., Any]:
        def fn(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
            # Constant weights, as quantized ones are: both time the activations' gradient.
            rhs = jax.lax.stop_gradient(rhs)
            return tokamax_pass.ragged_dot(lhs, rhs, sizes, implementation=implementation)
        return fn

    found = [("triton", "quantized", quantized(PallasTritonRaggedDot(interpret=interpret))),
             ("xla", "quantized", quantized("xla")),
             ("triton", "bf16", bf16(PallasTritonRaggedDot(interpret=interpret))),
             ("xla", "bf16", bf16("xla"))]
    if on_gpu:
        found.insert(1, (NK_WEIGHTS, "quantized", quantized_nk(PallasTritonRaggedDot())))
        found += [(f"triton {' '.join(map(str, tiles))}", "quantized",
                   quantized(PallasTritonRaggedDot(config=TritonConfig(*tiles))))
                  for tiles in TRITON_TILES[w.name]]
        found.append(("mosaic", "bf16", bf16("mosaic")))
        found += upstream(unpack)
    return found


def upstream(unpack: Callable[..., Any]) -> list[tuple[str, str, Callable[..., Any]]]:
    """Upstream Tokamax's `ragged_dot` on qwix `QArray`s of the same values, where both
    import (the upstream wheel, `benchmarks/peers`)."""
    try:
        import qwix
        import tokamax
    except ImportError as e:
        print(f"upstream tokamax / qwix not importable: {e}", file=sys.stderr)
        return []

    def run(implementation: Any) -> Callable[..., Any]:
        def fn(*args: jax.Array) -> jax.Array:
            lhs, rhs, sizes = unpack(args)
            lhs, rhs = (qwix.QArray(a.qvalue, a.scale) if isinstance(a, QuantizedArray) else a
                        for a in (lhs, rhs))
            return tokamax.ragged_dot(lhs, rhs, sizes, implementation=implementation)
        return fn

    return [(f"upstream_{name or 'default'}", "upstream", run(name))
            for name in (None, "triton", "mosaic")]


def tolerances(w: Workload) -> tuple[float, float]:
    """Upstream's ragged-dot test tolerances (atol, rtol)."""
    return (1.0, 0.5) if w.lhs_qtype is not None else (0.01, 0.005)


def measure(w: Workload, name: str, kind: str, fn: Callable[..., Any], args: tuple,
            reference: jax.Array, iterations: int) -> list[dict[str, Any]]:
    base = dict(workload=w.name, m=w.m, k=w.k, n=w.n, groups=w.groups,
                implementation=name, kind=kind)
    try:
        out = np.asarray(jax.jit(fn)(*args), np.float32)
    except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
        return [dict(base, error=f"{type(e).__name__}: {str(e)[:300]}")]
    atol, rtol = tolerances(w)
    ref = np.asarray(reference)
    checks = dict(rel_err=relative_error(out, ref),
                  within_upstream_tolerance=bool(np.allclose(out, ref, atol=atol, rtol=rtol)))
    rows = []
    modes = ["forward"] + ([] if w.lhs_qtype is not None else ["forward_and_vjp"])
    for mode in modes:
        try:
            data = benchmarking.benchmark(fn, *args, mode=mode, iterations=iterations)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(base, mode=mode, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        ms = data.median_evaluation_time_ms
        flops = 2 * w.m * w.k * w.n * (1 if mode == "forward" else 2)
        rows.append(dict(base, **checks, mode=mode, ms=ms, method=data.method,
                         tflops=flops / ms / 1e9))
    return rows


def summary(w: Workload, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: each quantized candidate's speedup over our fastest bf16 kernel
    (`triton` or `mosaic`; `xla` where neither ran)."""
    out = []
    for mode in ("forward", "forward_and_vjp"):
        timed = [r for r in rows if r.get("mode") == mode and "ms" in r]
        bf16 = [r for r in timed if r["kind"] == "bf16" and r["implementation"] != "xla"]
        bf16 = bf16 or [r for r in timed if r["kind"] == "bf16"]
        if not bf16:
            continue
        best = min(bf16, key=lambda r: r["ms"])
        for r in timed:
            if r["kind"] == "bf16":
                continue
            speedup = best["ms"] / r["ms"]
            out.append(dict(summary=w.name, mode=mode, implementation=r["implementation"],
                            kind=r["kind"], ms=r["ms"], bf16_baseline=best["implementation"],
                            bf16_ms=best["ms"], speedup=speedup,
                            meets_goal=speedup >= GOAL_SPEEDUP,
                            within_upstream_tolerance=r["within_upstream_tolerance"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.quantized_ragged_dot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    iterations = min(args.iterations, 2) if args.smoke else args.iterations
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "quantized_ragged_dot.jsonl"
    start = time.perf_counter()
    with path.open("w") as log:
        provenance = dict(commit=source_commit(), date=time.strftime("%Y-%m-%d"),
                          jax=jax.__version__, device=jax.devices()[0].device_kind)
        log.write(json.dumps(dict(provenance=provenance)) + "\n")
        for index, w in enumerate(workloads):
            ops = operands(w, index)
            sizes = router_sizes(w.m, w.groups, index)
            quantized_args = (*_parts(ops["lhs"]), *_parts(ops["rhs"]), sizes)
            nk_args = (*_parts(ops["lhs"]), *_parts(ops["rhs"].swapaxes(1, 2)), sizes)
            bf16_args = (ops["lhs_f32"].astype(jnp.bfloat16),
                         ops["rhs_f32"].astype(jnp.bfloat16), sizes)
            reference = jax.jit(lambda a, b, s: jax.lax.ragged_dot(
                a, b, s, precision=jax.lax.Precision.HIGHEST))(
                    ops["lhs_f32"], ops["rhs_f32"], sizes)
            rows = []
            for name, kind, fn in candidates(w, on_gpu):
                if time.perf_counter() - start > args.budget_s:
                    found = [dict(workload=w.name, implementation=name, kind=kind,
                                  skipped="time budget")]
                else:
                    call_args = (bf16_args if kind == "bf16" else
                                 nk_args if name == NK_WEIGHTS else quantized_args)
                    found = measure(w, name, kind, fn, call_args, reference, iterations)
                for row in found:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    print(json.dumps(row))
                rows += found
            for row in summary(w, rows):
                row.update(device=jax.devices()[0].device_kind, smoke=args.smoke)
                log.write(json.dumps(row) + "\n")
                print(json.dumps(row))
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
