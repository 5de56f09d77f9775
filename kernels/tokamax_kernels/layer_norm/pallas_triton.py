"""Layer norm / RMSNorm forward as a Pallas Triton kernel.

Each program normalizes `block_rows` rows of the `(rows, n)` view of `x`. A row
that fits one `block_n` chunk is read once and kept in registers; a longer row
is looped over in chunks (sum, centered sum of squares, then the write), so any
row length works. Statistics are float32; mean and rstd are written as the
family's residuals.

With a `residual`, each load reads both inputs and forms `s = x + residual` rounded to
x's dtype (as plain JAX does); the pass that writes `y` writes `s` beside it. A row in
one chunk thus reads each input once and writes each output once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _triton
from tokamax_kernels._triton import TritonKernel
from tokamax_kernels.layer_norm._triton_common import (
    block_rows_choices,
    check_multiple,
    check_powers_of_2,
    check_triton_norm_inputs,
    is_exact,
    load_rows,
    load_vector,
    masked,
    row_chunk,
    row_mask_of,
)
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp
from tokamax_pass.core import BoundArguments, Op, Target


@dataclasses.dataclass(frozen=True)
class Config:
    """Rows are normalized `block_rows` at a time, read in `block_n`-column chunks (powers
    of 2); each program walks `rows_per_program` rows, so with `num_stages` > 1 Triton
    prefetches the next rows while the current ones are reduced."""

    block_rows: int
    block_n: int
    rows_per_program: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        check_powers_of_2(self, "block_rows", "block_n", "num_warps")
        check_multiple(self)


def _fwd_kernel(*refs: Any, n: int, rows: int, block_rows: int, block_n: int,
                rows_per_program: int, epsilon: float, subtract_mean: bool, has_scale: bool,
                has_offset: bool, has_residual: bool) -> None:
    it = iter(refs)
    x_ref = next(it)
    residual_ref = next(it) if has_residual else None
    scale_ref = next(it) if has_scale else None
    offset_ref = next(it) if has_offset else None
    y_ref = next(it)
    s_ref = next(it) if has_residual else None
    mean_ref, rstd_ref = it
    first_row = pl.program_id(0) * rows_per_program
    exact = is_exact(rows, n, rows_per_program, block_n)

    def step(i: Any, carry: int) -> int:
        r0 = pl.multiple_of(first_row + i * block_rows, block_rows)
        _normalize_rows(x_ref, residual_ref, scale_ref, offset_ref, y_ref, s_ref, mean_ref,
                        rstd_ref, r0, n=n, rows=rows, block_rows=block_rows, block_n=block_n,
                        epsilon=epsilon, subtract_mean=subtract_mean, exact=exact)
        return carry

    steps = rows_per_program // block_rows
    if steps == 1:
        step(0, 0)
    else:
        jax.lax.fori_loop(0, steps, step, 0)


def _normalize_rows(x_ref: Any, residual_ref: Any, scale_ref: Any, offset_ref: Any, y_ref: Any,
                    s_ref: Any, mean_ref: Any, rstd_ref: Any, r0: Any, *, n: int, rows: int,
                    block_rows: int, block_n: int, epsilon: float, subtract_mean: bool,
                    exact: bool) -> None:
    """Normalizes rows `[r0, r0 + block_rows)` (of `x + residual` with a residual, writing
    that sum too) and writes their mean and rstd."""
    row_mask = row_mask_of(r0, rows=rows, block_rows=block_rows, exact=exact)
    num_chunks = _triton.cdiv(n, block_n)
    load_x = functools.partial(load_rows, x_ref, r0, row_mask=row_mask, n=n, block_n=block_n,
                               block_rows=block_rows)
    load: Callable[[Any], tuple[jax.Array, Any, Any]]
    if residual_ref is None:
        load = load_x
    else:
        load_residual = functools.partial(load_rows, residual_ref, r0, row_mask=row_mask, n=n,
                                          block_n=block_n, block_rows=block_rows)

        def load(c: Any) -> tuple[jax.Array, Any, Any]:
            x, mask, col_mask = load_x(c)
            # Rounded to the inputs' dtype before the statistics, as `norm(x + residual)`.
            s = (x + load_residual(c)[0]).astype(s_ref.dtype).astype(jnp.float32)
            return s, mask, col_mask

    def write(c: Any, x_hat: jax.Array, x: jax.Array, mask: jax.Array,
              col_mask: jax.Array) -> None:
        y = x_hat
        if scale_ref is not None:
            y = y * load_vector(scale_ref, c, col_mask, block_n)[None, :]
        if offset_ref is not None:
            y = y + load_vector(offset_ref, c, col_mask, block_n)[None, :]
        block = (pl.ds(r0, block_rows), pl.ds(c * block_n, block_n))
        plgpu.store(y_ref.at[block], y.astype(y_ref.dtype), mask=mask)
        if s_ref is not None:
            plgpu.store(s_ref.at[block], x.astype(s_ref.dtype), mask=mask)

    zeros = jnp.zeros((block_rows, block_n), jnp.float32)
    if num_chunks == 1:
        x, mask, col_mask = load(0)
        mean = x.sum(axis=1) / n if subtract_mean else jnp.zeros((block_rows,), jnp.float32)
        centered = masked(mask, x - mean[:, None])
        rstd = jax.lax.rsqrt((centered * centered).sum(axis=1) / n + epsilon)
        write(0, centered * rstd[:, None], x, mask, col_mask)
    else:
        if subtract_mean:
            total = jax.lax.fori_loop(0, num_chunks, lambda c, acc: acc + load(c)[0], zeros)
            mean = total.sum(axis=1) / n
        else:
            mean = jnp.zeros((block_rows,), jnp.float32)

        def square_sum(c: Any, acc: jax.Array) -> jax.Array:
            x, mask, _ = load(c)
            centered = masked(mask, x - mean[:, None])
            return acc + centered * centered

        squares = jax.lax.fori_loop(0, num_chunks, square_sum, zeros)
        rstd = jax.lax.rsqrt(squares.sum(axis=1) / n + epsilon)

        def normalize(c: Any, carry: int) -> int:
            x, mask, col_mask = load(c)
            write(c, (x - mean[:, None]) * rstd[:, None], x, mask, col_mask)
            return carry

        jax.lax.fori_loop(0, num_chunks, normalize, 0)
    plgpu.store(mean_ref.at[pl.ds(r0, block_rows)], mean, mask=row_mask)
    plgpu.store(rstd_ref.at[pl.ds(r0, block_rows)], rstd, mask=row_mask)


def layer_norm_forward(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
                       epsilon: float, subtract_mean: bool, config: Config,
                       interpret: bool = False, residual: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """`(y, s, mean, rstd)` of `s = x + residual` (just `x`, and `s` None, without a
    residual) normalized over its last axis (mean, rstd in float32)."""
    *lead, n = x.shape
    rows = math.prod(lead)
    kernel = functools.partial(
        _fwd_kernel, n=n, rows=rows, block_rows=config.block_rows, block_n=config.block_n,
        rows_per_program=config.rows_per_program, epsilon=epsilon, subtract_mean=subtract_mean,
        has_scale=scale is not None, has_offset=offset is not None,
        has_residual=residual is not None,
    )
    block = jax.ShapeDtypeStruct((rows, n), x.dtype)
    stats = jax.ShapeDtypeStruct((rows,), jnp.float32)
    outs = pl.pallas_call(
        kernel,
        grid=(_triton.cdiv(rows, config.rows_per_program),),
        out_shape=(block, stats, stats) if residual is None else (block, block, stats, stats),
        compiler_params=_triton.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="tokamax_layer_norm_fwd",
    )(*(a.reshape(rows, n) for a in (x, residual) if a is not None),
      *(p for p in (scale, offset) if p is not None))
    y, *s, mean, rstd = outs
    s = s[0].reshape(x.shape) if s else None
    return y.reshape(x.shape), s, mean.reshape(lead), rstd.reshape(lead)


# The heuristic config (`PallasTritonLayerNorm._get_heuristics_config`): bytes a block
# holds (several short rows to a program), and block bytes per warp.
HEURISTIC_BLOCK_BYTES = 4096
HEURISTIC_BYTES_PER_WARP = 16384


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonLayerNorm(TritonKernel, LayerNorm):
    """Layer norm / RMSNorm over the last axis as a Pallas Triton kernel (CUDA).

    `interpret=True` runs the kernel in the Pallas interpreter (any platform; tests).
    """

    config_cls = Config
    # In a model XLA fuses the norm with its neighbours (the residual add before it, the
    # gradient's add into the residual stream after it), which a kernel cannot: alone at
    # the Llama shape (16384x2048) this kernel and its VJP measure faster than XLA's, yet
    # the Llama step runs slower with them (H200, the model suite). Calls given the
    # `residual` too: faster alone, yet slower forward+backward (`python -m benchmarks.run
    # --only "rms norm + residual"`) and in the Llama step.
    kernel_margin = 0.4

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_triton_norm_inputs(ba)

    def _fwd(self, x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
             axis: int, epsilon: float, subtract_mean: bool, config: Config,
             return_residuals: bool, residual: jax.Array | None = None) -> tuple[Any, Any]:
        y, s, mean, rstd = layer_norm_forward(
            x, scale, offset, epsilon=epsilon, subtract_mean=subtract_mean, config=config,
            interpret=self.interpret, residual=residual,
        )
        out = y if residual is None else (y, s)
        return out, ((mean, rstd) if return_residuals else None)

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """Blocks of about 4 KiB (up to 16 short rows to a program, one row from 4 KiB
        up) and one warp per 16 KiB of block: fitted on the H200 to
        `benchmarks/probes/layer_norm_configs_sweep.py` (widths 256 to 6400, float32 and
        bfloat16; `layer_norm_configs.jsonl`) and the library cache's autotuned entries.
        A warp reduces its rows with shuffles alone, no shared memory or barrier; more
        warps pay off on wide float32 rows."""
        x = ba.arguments["x"]
        n = x.shape[-1]
        itemsize = jnp.dtype(x.dtype).itemsize
        block_n = row_chunk(n)
        block_rows = max(1, min(16, HEURISTIC_BLOCK_BYTES // (block_n * itemsize)))
        block_bytes = block_rows * block_n * itemsize
        num_warps = max(1, min(8, block_bytes // HEURISTIC_BYTES_PER_WARP))
        return Config(block_rows=block_rows, block_n=block_n, rows_per_program=block_rows,
                      num_warps=num_warps, num_stages=1 if block_n >= n else 2)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        n = ba.arguments["x"].shape[-1]
        chunks = {row_chunk(n), min(row_chunk(n), 4096)}
        return {
            Config(block_rows=r, block_n=b, rows_per_program=r * p, num_warps=w, num_stages=s)
            for b in chunks
            for r, p, w, s in itertools.product(block_rows_choices(b), (1, 4, 16),
                                                (1, 2, 4, 8, 16), (1, 2, 3))
        }

    def _default_vjp(self) -> Op:
        return PallasTritonLayerNormVjp(interpret=self.interpret)
