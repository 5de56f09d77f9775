"""The Pallas Mosaic TPU kernels of the layer norm: forward and backward over row blocks.

Both walk the `(rows, n)` view of `x` in `(block_rows, n)` blocks, one grid step each
(a "parallel" axis: TPUs with two TensorCores split it). A block holds whole rows, so
each row's statistics are one lane reduction in VMEM; `n` is any size (Mosaic takes a
block spanning a whole axis; a multiple of 128 fills the lanes without padding).

forward: float32 statistics of `x` (of `s = x + residual`, rounded to x's dtype as plain
JAX rounds it, with a residual; `s` is written too), `y` in x's dtype, and the family's
residuals `(mean, rstd)` as float32 `(rows, 1)` columns (`mean` zero for RMSNorm).

backward: with `x_hat = (x - mean) * rstd` and `g = dy * scale`,
`dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g))` (the last term for layer norm
only), plus `ds` (the residual sum's cotangent) when given; each block also writes its
column sums `sum(dy * x_hat)` and `sum(dy)`, one float32 `(1, n)` row per block, which
XLA adds up into dscale and doffset. No block writes another's output: the grid needs
no order and reruns are bitwise identical.

Tails: the last row block of a row count it does not divide reads past the array's end
(unspecified values on a TPU, NaN in Pallas's interpreter). Rows are independent, so
those rows' outputs are simply dropped on write; only the backward's column sums mix
rows, and there the rows past the end are excluded with `where` (a product with zero
would keep a NaN).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokamax_kernels._mosaic_tpu import compiler_params


def _forward_kernel(*refs: Any, epsilon: float, subtract_mean: bool, has_residual: bool,
                    has_scale: bool, has_offset: bool) -> None:
    it = iter(refs)
    x_ref = next(it)
    residual_ref = next(it) if has_residual else None
    scale_ref = next(it) if has_scale else None
    offset_ref = next(it) if has_offset else None
    y_ref = next(it)
    s_ref: Any = next(it) if has_residual else None  # a ref exactly where residual_ref is
    mean_ref, rstd_ref = it
    x = x_ref[...].astype(jnp.float32)
    if residual_ref is not None:
        # One float32 add rounded once to x's dtype is the correctly rounded sum, as
        # `x + residual` gives in plain JAX (and bf16 arithmetic is not on every TPU).
        s = (x + residual_ref[...].astype(jnp.float32)).astype(s_ref.dtype)
        s_ref[...] = s
        x = s.astype(jnp.float32)
    if subtract_mean:
        mean = jnp.mean(x, axis=1, keepdims=True)
    else:
        mean = jnp.zeros((x.shape[0], 1), jnp.float32)
    centered = x - mean
    rstd = lax.rsqrt(jnp.mean(centered * centered, axis=1, keepdims=True) + epsilon)
    y = centered * rstd
    if scale_ref is not None:
        y = y * scale_ref[...]
    if offset_ref is not None:
        y = y + offset_ref[...]
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _row_spec(block_rows: int, width: int) -> pl.BlockSpec:
    return pl.BlockSpec((block_rows, width), lambda i: (i, 0))


def _vector_spec(n: int) -> pl.BlockSpec:
    """A `(1, n)` float32 row (scale, offset) that every block reads whole."""
    return pl.BlockSpec((1, n), lambda i: (0, 0))


def layer_norm_forward(x: jax.Array, residual: jax.Array | None, scale: jax.Array | None,
                       offset: jax.Array | None, *, epsilon: float, subtract_mean: bool,
                       block_rows: int, vmem_bytes: int, interpret: Any
                       ) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """`(y, s, mean, rstd)` of `(rows, n)` x (and residual), scale and offset as float32
    `(1, n)` or None: y and s `(rows, n)` in x's dtype (s None without a residual), mean
    and rstd float32 `(rows, 1)`."""
    rows, n = x.shape
    rows_out = jax.ShapeDtypeStruct((rows, n), x.dtype)
    stats = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
    inputs = [a for a in (x, residual) if a is not None]
    vectors = [v for v in (scale, offset) if v is not None]
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, epsilon=epsilon, subtract_mean=subtract_mean,
                          has_residual=residual is not None, has_scale=scale is not None,
                          has_offset=offset is not None),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[_row_spec(block_rows, n)] * len(inputs) + [_vector_spec(n)] * len(vectors),
        out_specs=[_row_spec(block_rows, n)] * len(inputs) + [_row_spec(block_rows, 1)] * 2,
        out_shape=[rows_out] * len(inputs) + [stats] * 2,
        compiler_params=compiler_params(("parallel",), vmem_bytes),
        interpret=interpret,
        name="tokamax_layer_norm_forward",
    )(*inputs, *vectors)
    y, *s, mean, rstd = outs
    return y, (s[0] if s else None), mean, rstd


def _backward_kernel(*refs: Any, rows: int, subtract_mean: bool, has_scale: bool,
                     has_ds: bool, want_dscale: bool, want_doffset: bool) -> None:
    it = iter(refs)
    x_ref, dy_ref, mean_ref, rstd_ref = next(it), next(it), next(it), next(it)
    scale_ref = next(it) if has_scale else None
    ds_ref = next(it) if has_ds else None
    dx_ref = next(it)
    dscale_ref = next(it) if want_dscale else None
    doffset_ref = next(it) if want_doffset else None
    x = x_ref[...].astype(jnp.float32)
    dy = dy_ref[...].astype(jnp.float32)
    rstd = rstd_ref[...]
    x_hat = (x - mean_ref[...]) * rstd
    g = dy if scale_ref is None else dy * scale_ref[...]
    dx = g - x_hat * jnp.mean(x_hat * g, axis=1, keepdims=True)
    if subtract_mean:
        dx = dx - jnp.mean(g, axis=1, keepdims=True)
    dx = dx * rstd
    if ds_ref is not None:  # the cotangent of the sum s, added in float32
        dx = dx + ds_ref[...].astype(jnp.float32)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    if dscale_ref is None and doffset_ref is None:
        return
    block_rows = x.shape[0]
    if rows % block_rows:  # rows past the end (the last block's tail) join no sum
        first = pl.program_id(0) * block_rows
        valid = first + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0) < rows
        dy = jnp.where(valid, dy, 0.0)
        x_hat = jnp.where(valid, x_hat, 0.0)
    if dscale_ref is not None:
        dscale_ref[...] = jnp.sum(dy * x_hat, axis=0, keepdims=True)
    if doffset_ref is not None:
        doffset_ref[...] = jnp.sum(dy, axis=0, keepdims=True)


def layer_norm_backward(x: jax.Array, dy: jax.Array, mean: jax.Array, rstd: jax.Array,
                        scale: jax.Array | None, ds: jax.Array | None, *, subtract_mean: bool,
                        want_dscale: bool, want_doffset: bool, block_rows: int,
                        vmem_bytes: int, interpret: Any
                        ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """`(dx, dscale, doffset)` of the normalized `(rows, n)` x: dx in x's dtype (plus
    `ds`, when given), dscale and doffset float32 `(n,)` (None unless wanted). mean and
    rstd are float32 `(rows, 1)`, scale float32 `(1, n)` or None."""
    rows, n = x.shape
    blocks = pl.cdiv(rows, block_rows)
    partial = jax.ShapeDtypeStruct((blocks, 1, n), jnp.float32)
    partial_spec = pl.BlockSpec((pl.squeezed, 1, n), lambda i: (i, 0, 0))
    wanted = int(want_dscale) + int(want_doffset)
    in_specs = [_row_spec(block_rows, n)] * 2 + [_row_spec(block_rows, 1)] * 2
    if scale is not None:
        in_specs.append(_vector_spec(n))
    if ds is not None:
        in_specs.append(_row_spec(block_rows, n))
    outs = pl.pallas_call(
        functools.partial(_backward_kernel, rows=rows, subtract_mean=subtract_mean,
                          has_scale=scale is not None, has_ds=ds is not None,
                          want_dscale=want_dscale, want_doffset=want_doffset),
        grid=(blocks,),
        in_specs=in_specs,
        out_specs=[_row_spec(block_rows, n)] + [partial_spec] * wanted,
        out_shape=[jax.ShapeDtypeStruct((rows, n), x.dtype)] + [partial] * wanted,
        compiler_params=compiler_params(("parallel",), vmem_bytes),
        interpret=interpret,
        name="tokamax_layer_norm_backward",
    )(x, dy, mean, rstd, *(a for a in (scale, ds) if a is not None))
    dx, *partials = outs
    sums = [p.sum(axis=(0, 1)) for p in partials]
    dscale = sums.pop(0) if want_dscale else None
    doffset = sums.pop(0) if want_doffset else None
    return dx, dscale, doffset
