"""The quantized Triton ragged dot's kernel variants at issue 48's goal shapes, timed.

    python -m benchmarks.probes.quantized_ragged_dot_variants [--smoke]

For each workload of `quantized_ragged_dot` (float8 activations and weights; bf16
activations and int8 weights) it times `pallas_triton_quantized.ragged_dot` directly over
tile configs and the weights' two layouts (`(G, K, N)`, and `(G, N, K)` contraction-major,
as Hopper's float8 `wgmma` reads both operands), beside our bf16 `mosaic` kernel on the
same values. Each variant is checked against a float32 HIGHEST product of the dequantized
operands. One JSON line per variant goes to `$OUT/quantized_ragged_dot_variants.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tokamax_pass
from benchmarks.probes.quantized_ragged_dot import SMOKE_WORKLOADS, WORKLOADS, operands
from benchmarks.probes.ragged_dot_small_rows import relative_error, router_sizes
from tokamax_kernels._triton import MatmulConfig
from tokamax_kernels.ragged_dot import pallas_triton_quantized as kernel
from tokamax_pass import benchmarking

TILES = {
    "fp8_compute_bound": ((128, 256, 128, 8, 3), (128, 256, 128, 8, 2), (128, 128, 128, 8, 3),
                          (128, 128, 128, 4, 3), (256, 128, 128, 8, 3), (128, 256, 64, 8, 4),
                          (64, 256, 128, 4, 4), (128, 128, 256, 8, 2)),
    "int8_memory_bound": ((64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (64, 128, 256, 4, 3),
                          (64, 64, 128, 4, 4), (64, 128, 64, 4, 6)),
}
SMOKE_TILES = (16, 16, 32, 4, 1)


def timed(row: dict[str, Any], fn: Any, args: tuple, reference: np.ndarray, flops: int,
          iterations: int) -> dict[str, Any]:
    """`row` with `fn(*args)`'s relative error against `reference` and its median time
    (or the error it raised)."""
    row = dict(row)
    try:
        out = np.asarray(jax.jit(fn)(*args), np.float32)
        row["rel_err"] = relative_error(out, reference)
        data = benchmarking.benchmark(fn, *args, mode="forward", iterations=iterations)
        row.update(ms=data.median_evaluation_time_ms, method=data.method)
        row["tflops"] = flops / row["ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - a variant that fails is a result
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.quantized_ragged_dot_variants",
        description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "quantized_ragged_dot_variants.jsonl"
    with path.open("w") as log:
        def emit(row: dict[str, Any]) -> None:
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)

        for index, w in enumerate(SMOKE_WORKLOADS if args.smoke else WORKLOADS):
            ops = operands(w, index)
            sizes = router_sizes(w.m, w.groups, index)
            reference = np.asarray(jax.jit(lambda a, b, s: jax.lax.ragged_dot(
                a, b, s, precision=jax.lax.Precision.HIGHEST))(
                    ops["lhs_f32"], ops["rhs_f32"], sizes))
            lhs, rhs = ops["lhs"], ops["rhs"]
            lhs_values = getattr(lhs, "qvalue", lhs)
            lhs_scale = getattr(lhs, "scale", None)
            rhs_nk = jnp.swapaxes(rhs.qvalue, 1, 2)
            flops = 2 * w.m * w.k * w.n
            base = dict(workload=w.name, m=w.m, k=w.k, n=w.n, groups=w.groups)

            if on_gpu:
                bf16 = (ops["lhs_f32"].astype(jnp.bfloat16), ops["rhs_f32"].astype(jnp.bfloat16))
                emit(timed(dict(base, variant="bf16 mosaic"),
                           lambda a, b, s: tokamax_pass.ragged_dot(
                               a, b, s, implementation="mosaic"),
                           (*bf16, sizes), reference, flops, args.iterations))
            tiles_list = TILES[w.name] if on_gpu else (SMOKE_TILES,)
            for tiles in tiles_list:
                config = MatmulConfig(*tiles)
                for k_major in (False, True):

                    def fn(x: Any, ws: Any, rs: Any, s: Any, xs: Any = None,
                           config: MatmulConfig = config, k_major: bool = k_major) -> jax.Array:
                        return kernel.ragged_dot(
                            x, ws, s, lhs_scale=xs, rhs_scale=rs, transpose_rhs=k_major,
                            out_dtype=jnp.bfloat16, config=config, interpret=not on_gpu)

                    weights = rhs_nk if k_major else rhs.qvalue
                    row = dict(base, variant=f"triton {' '.join(map(str, tiles))}",
                               k_major=k_major)
                    emit(timed(row, fn, (lhs_values, weights, rhs.scale, sizes, lhs_scale),
                               reference, flops, args.iterations))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
