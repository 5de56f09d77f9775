"""Small rows a group: ragged-dot kernel configs, tiled XLA and lax at MoE decode shapes.

    python -m benchmarks.probes.ragged_dot_small_rows [--smoke] [--budget-s S]

On the GPU: every candidate is checked against a float32 HIGHEST reference (relative
error norm), then timed (CUPTI where available, median after warm-up), forward and
forward+backward (the gradients run each kernel's heuristics); a short table goes to
stdout and one JSON line per measurement to `$OUT/ragged_dot_small_rows.jsonl` (or the
working directory). `--smoke` runs tiny shapes
on CPU (the Triton candidates in Pallas interpret mode) to show the script works.
Candidates past `--budget-s` of wall time are recorded as skipped.
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

from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot, PallasTritonRaggedDot
from tokamax_kernels.ragged_dot.base import xla_ragged_dot
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import Config as MosaicConfig
from tokamax_kernels.ragged_dot.pallas_triton import Config as TritonConfig
from tokamax_kernels.ragged_dot.xla_tiled import TilingRule
from tokamax_pass import benchmarking


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int
    groups: int


SHAPES = (
    Shape("decode", 1536, 2048, 1408, 64),
    Shape("fine_grained_up", 24576, 2048, 1408, 64),
    Shape("fine_grained_down", 24576, 1408, 2048, 64),
    Shape("few_groups_wide", 512, 4096, 14336, 8),
)
SMOKE_SHAPES = (Shape("decode", 96, 128, 256, 8), Shape("fine_grained", 384, 128, 256, 8))

TRITON_CONFIGS = tuple(TritonConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                    num_stages=s) for bm, bn, bk, w, s in (
    (128, 256, 64, 8, 3), (64, 128, 128, 4, 4), (64, 256, 64, 8, 4), (32, 128, 128, 4, 4),
    (32, 256, 64, 4, 5), (16, 128, 128, 4, 5), (64, 128, 64, 4, 5), (128, 128, 64, 8, 4),
))
MOSAIC_CONFIGS = tuple(MosaicConfig(tile_m=tm, tile_n=tn, tile_k=tk, num_stages=s)
                       for tm, tn, tk, s in (
    (128, 64, 64, 4), (64, 64, 64, 6), (64, 64, 128, 4), (64, 128, 64, 5), (64, 64, 64, 4),
    (128, 128, 64, 4),
))
TILING_RULES = (TilingRule(), TilingRule(tile_m=32), TilingRule(tile_m=128),
                TilingRule(tile_m=512), TilingRule(rows_per_step=8192))


def label(config: Any) -> str:
    """A config's fields, `name=value`, for the table and the JSON lines."""
    if config is None:
        return "heuristics"
    if isinstance(config, TilingRule):
        return f"tiled tile_m={config.tile_m or 'auto'} rows_per_step={config.rows_per_step}"
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(config).items())


def router_sizes(m: int, groups: int, seed: int) -> jax.Array:
    """Uneven group sizes filling all `m` rows, as a router gives (0.5x to 1.5x the mean)."""
    weights = np.random.default_rng(seed).uniform(0.5, 1.5, groups)
    sizes = np.floor(weights / weights.sum() * m).astype(np.int32)
    sizes[0] += m - sizes.sum()
    return jnp.asarray(sizes)


def candidates(on_gpu: bool) -> list[tuple[str, str, Callable[..., Any]]]:
    """`(implementation, config, fn(lhs, rhs, sizes))`: heuristics first, then the grid."""
    found: list[tuple[str, str, Callable[..., Any]]] = [
        ("lax", "-", jax.lax.ragged_dot),
        ("xla", "lax", xla_ragged_dot("forward", None, None, "lax")),
    ]
    found += [("xla", label(rule), xla_ragged_dot("forward", None, None, "tiled", rule))
              for rule in TILING_RULES]
    interpret = not on_gpu
    triton = [None, *TRITON_CONFIGS[:2 if interpret else None]]
    found += [("triton", label(c),
               PallasTritonRaggedDot(config=c, interpret=interpret)) for c in triton]
    if on_gpu:
        found += [("mosaic", label(c), PallasMosaicGpuRaggedDot(config=c))
                  for c in (None, *MOSAIC_CONFIGS)]
        try:
            import tokamax  # the upstream wheel, where installed (benchmarks/peers)

            found.append(("upstream", "None", tokamax.ragged_dot))
        except ImportError as e:
            print(f"upstream tokamax not importable: {e}", file=sys.stderr)
    return found


def relative_error(out: jax.Array, ref: jax.Array) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def measure(shape: Shape, impl: str, config: str, fn: Callable[..., Any], args: tuple,
            reference: jax.Array, iterations: int) -> list[dict[str, Any]]:
    m, k, n, g = shape.m, shape.k, shape.n, shape.groups
    base = dict(shape=shape.name, m=m, k=k, n=n, groups=g, implementation=impl, config=config)
    try:
        err = relative_error(jax.jit(fn)(*args), reference)
    except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
        return [dict(base, error=f"{type(e).__name__}: {str(e)[:200]}")]
    rows = []
    weight_bytes = g * k * n * args[1].dtype.itemsize
    for mode, flops in (("forward", 2 * m * k * n), ("forward_and_vjp", 6 * m * k * n)):
        try:
            data = benchmarking.benchmark(fn, *args, mode=mode, iterations=iterations)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(base, mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        ms = data.median_evaluation_time_ms
        rows.append(dict(base, mode=mode, ms=ms, method=data.method, rel_err=err,
                         tflops=flops / ms / 1e9, weight_tbps=weight_bytes / ms / 1e9))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.ragged_dot_small_rows",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    iterations = 2 if args.smoke else args.iterations
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ragged_dot_small_rows.jsonl"
    start = time.perf_counter()
    found = candidates(on_gpu)
    print(f"{'shape':18} {'impl':8} {'mode':16} {'ms':>9} {'TB/s w':>7} {'TFLOP/s':>8} "
          f"{'rel err':>8}  config")
    with path.open("w") as log:
        for index, shape in enumerate(shapes):
            keys = jax.random.split(jax.random.key(index), 2)
            lhs = jax.random.normal(keys[0], (shape.m, shape.k), jnp.bfloat16)
            rhs = jax.random.normal(keys[1], (shape.groups, shape.k, shape.n), jnp.bfloat16)
            sizes = router_sizes(shape.m, shape.groups, index)
            reference = jax.jit(lambda a, b, s: jax.lax.ragged_dot(
                a.astype(jnp.float32), b.astype(jnp.float32), s,
                precision=jax.lax.Precision.HIGHEST))(lhs, rhs, sizes)
            for impl, config, fn in found:
                if time.perf_counter() - start > args.budget_s:
                    rows = [dict(shape=shape.name, implementation=impl, config=config,
                                 skipped="time budget")]
                else:
                    rows = measure(shape, impl, config, fn, (lhs, rhs, sizes), reference,
                                   iterations)
                for row in rows:
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    if "ms" in row:
                        print(f"{shape.name:18} {impl:8} {row['mode']:16} {row['ms']:9.4f} "
                              f"{row['weight_tbps']:7.2f} {row['tflops']:8.1f} "
                              f"{row['rel_err']:8.1e}  {config}")
                    else:
                        why = row.get("error") or row.get("skipped")
                        print(f"{shape.name:18} {impl:8} {config}: {why}")
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
