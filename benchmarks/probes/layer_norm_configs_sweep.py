"""The Triton layer norm's configs across row widths, against XLA and upstream Tokamax.

    PYTHONPATH=src:kernels:. python benchmarks/probes/layer_norm_configs_sweep.py OUT_DIR \
        [--heuristics | --wide]

At shapes off the benchmark list (rows x width, dtype, mean subtracted or not, offset or
not), times the forward and forward+backward of: XLA's norm, upstream Tokamax's where
`import tokamax` works, our Triton kernel at its heuristic config and at a grid of
configs around it. Every Triton result is checked against a float32 reference first.
One JSON line per measurement goes to OUT_DIR/layer_norm_configs.jsonl as it is taken.
This is the data the Triton norm's heuristics are fitted to; `--heuristics` times the
heuristic configs alone (to OUT_DIR/layer_norm_heuristics.jsonl), at one more shape.
`--wide` times rows of 8K-16K elements (to OUT_DIR/layer_norm_wide_rows.jsonl), the
backward also at row chunks narrower than the whole row: a whole 16K-element float32
row a step is what the backward's heuristics give there.
"""

from __future__ import annotations

import math
import pathlib
import sys

import jax
import jax.numpy as jnp

from benchmarks.probes._probe import JsonLines, device_ms, random_normal, relative_error, with_vjp
from benchmarks.sweep import source_commit
from tokamax_kernels import _gpu
from tokamax_kernels.layer_norm import pallas_triton as ln_triton
from tokamax_kernels.layer_norm import pallas_triton_vjp as ln_vjp
from tokamax_kernels.layer_norm._triton_common import block_rows_choices, row_chunk
from tokamax_kernels.layer_norm.base import LayerNorm

OUT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
HEURISTICS_ONLY = "--heuristics" in sys.argv[2:]
WIDE = "--wide" in sys.argv[2:]
RESULTS = OUT / ("layer_norm_heuristics.jsonl" if HEURISTICS_ONLY else
                 "layer_norm_wide_rows.jsonl" if WIDE else "layer_norm_configs.jsonl")
log = JsonLines(RESULTS)
# (rows, width, dtype, subtract_mean, offset)
SHAPES = (
    (51623, 256, "float32", True, False),
    (20000, 768, "float32", True, True),
    (5829, 512, "float32", True, True),
    (9819, 2688, "bfloat16", True, False),
    (1362, 6400, "float32", True, True),
    (50000, 5120, "bfloat16", True, True),
    (16384, 2048, "bfloat16", False, False),
)
# Checked with `--heuristics` too: the shape the norm kernels were first tuned at.
HELD_OUT = ((65536, 4096, "bfloat16", True, True),)
WIDE_SHAPES = (
    (1997, 11392, "float32", True, False),
    (4096, 16384, "float32", False, False),
    (2048, 12288, "bfloat16", True, True),
)


def forward_configs(n: int) -> set[ln_triton.Config]:
    block_n = row_chunk(n)
    return {ln_triton.Config(block_rows=r, block_n=block_n, rows_per_program=r, num_warps=w,
                             num_stages=1 if block_n >= n else 2)
            for r in (*block_rows_choices(block_n), 32)
            if r * block_n <= 16384 for w in (1, 2, 4, 8)}


def backward_configs(rows: int, n: int) -> set[ln_vjp.Config]:
    """Around the heuristics: rows a step, warps, programs an SM; with `--wide`, one row a
    step in chunks of the row's, a half and a quarter of it, and also one row a program
    (no column sums carried from row to row, as upstream Tokamax's backward)."""
    chunks = [row_chunk(n)]
    if WIDE:
        chunks += [c for c in (chunks[0] // 2, chunks[0] // 4) if c >= 2048]
    configs = set()
    for block_n, r in ((c, r) for c in chunks
                       for r in ((1,) if WIDE else block_rows_choices(c))):
        for w in (4, 8, 16) if WIDE else (4, 8):
            for per_sm in (2, 4, 16) if WIDE else (2, 4):
                per_program = -(-rows // (per_sm * _gpu.sm_count()))
                rpp = max(r, 1 << max(0, math.ceil(math.log2(per_program))))
                configs.add(ln_vjp.Config(block_rows=r, block_n=block_n, rows_per_program=rpp,
                                          num_warps=w, num_stages=2))
    return configs


def sweep_shape(rows: int, n: int, dtype: str, subtract_mean: bool, has_offset: bool,
                upstream) -> None:
    shape = dict(rows=rows, width=n, dtype=dtype, subtract_mean=subtract_mean,
                 offset=has_offset)
    x = random_normal(1, (rows, n), dtype)
    s = 1 + 0.1 * random_normal(2, (n,))
    o = 0.1 * random_normal(3, (n,)) if has_offset else None
    dy = random_normal(4, (rows, n), dtype)
    moved = 2 * rows * n * jnp.dtype(dtype).itemsize

    def norm(op):
        return lambda x, s, o: op(x, s, o, subtract_mean=subtract_mean)

    with jax.default_matmul_precision("highest"):
        f32 = [None if a is None else a.astype(jnp.float32) for a in (x, s, o, dy)]
        want_y, want_g = jax.jit(with_vjp(norm(LayerNorm())))(*f32)
    args = (x, s, o)
    for name, fn in (("xla", norm(LayerNorm())),) + (
            (("upstream", lambda x, s, o: upstream.layer_norm(
                x, s, o, subtract_mean=subtract_mean)),) if upstream else ()):
        try:
            log(**shape, impl=name, fwd_ms=device_ms(fn, *args),
                fwd_bwd_ms=device_ms(with_vjp(fn), *args, dy))
        except Exception as e:  # noqa: BLE001
            log(**shape, impl=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    heuristic = ln_triton.PallasTritonLayerNorm().bind(x, s, o).heuristics_config
    grid = set() if HEURISTICS_ONLY or WIDE else forward_configs(n)
    for config in sorted(grid | {heuristic}, key=str):
        op = ln_triton.PallasTritonLayerNorm(config=config)
        try:
            err = relative_error(jax.jit(norm(op))(*args), want_y)
            ms = device_ms(norm(op), *args)
            log(**shape, impl="triton_fwd", config=str(config), heuristic=config == heuristic,
                fwd_ms=ms, tbps=moved / ms / 1e9, err=err)
        except Exception as e:  # noqa: BLE001
            log(**shape, impl="triton_fwd", config=str(config), error=str(e)[:300])
    vjp_heuristic = ln_vjp.PallasTritonLayerNormVjp()._get_heuristics_config(
        ln_triton.PallasTritonLayerNorm().bind(x, s, o))
    grid = set() if HEURISTICS_ONLY else backward_configs(rows, n)
    for config in sorted(grid | {vjp_heuristic}, key=str):
        op = ln_triton.PallasTritonLayerNorm(vjp=ln_vjp.PallasTritonLayerNormVjp(config=config))
        try:
            _, grads = jax.jit(with_vjp(norm(op)))(*args, dy)
            errs = [relative_error(a, b) for a, b in zip(grads, want_g, strict=True)
                    if b is not None]
            ms = device_ms(with_vjp(norm(op)), *args, dy)
            log(**shape, impl="triton_fwd_bwd", config=str(config),
                heuristic=config == vjp_heuristic, fwd_bwd_ms=ms, errs=errs)
        except Exception as e:  # noqa: BLE001
            log(**shape, impl="triton_fwd_bwd", config=str(config), error=str(e)[:300])


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS.unlink(missing_ok=True)
    try:
        import tokamax as upstream  # the upstream wheel, a peer where installed
    except Exception as e:  # noqa: BLE001
        log(upstream=f"not importable: {type(e).__name__}: {e}")
        upstream = None
    log(device_kind=jax.devices()[0].device_kind, jax=jax.__version__, commit=source_commit())
    shapes = WIDE_SHAPES if WIDE else SHAPES + (HELD_OUT if HEURISTICS_ONLY else ())
    for shape in shapes:
        sweep_shape(*shape, upstream)


if __name__ == "__main__":
    main()
