"""Layer norm / RMSNorm backward as a Pallas Triton kernel: dx, dscale, doffset.

With `x_hat = (x - mean) * rstd` and `g = dy * scale`:
`dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g))` (the last term only for
layer norm), `dscale = sum_rows(dy * x_hat)`, `doffset = sum_rows(dy)`.

Each program walks `rows_per_program` rows in `block_rows` steps and keeps its
column sums for dscale/doffset; it writes them as one row of a
`(programs, n)` float32 partial, which XLA sums. No atomics: reruns are bitwise
identical. Rows longer than `block_n` are looped over in chunks (row sums first,
then dx), with the partial row updated in place by its owning program.

With a `residual`, the forward returned `(y, s)`: the kernel normalizes `s` (the saved
output, so nothing is recomputed) and adds `ds` as it writes, `dx + ds` being the one
gradient of both `x` and `residual`; it is returned for both, with no further pass.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _gpu, _triton
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
    masked_load,
    row_chunk,
    row_mask_of,
)
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_pass.core import AutodiffVjp, BoundArguments, Op, Target, VjpOp


@dataclasses.dataclass(frozen=True)
class Config:
    """Rows per step, columns per chunk, rows per program (one partial-sum row each)."""

    block_rows: int
    block_n: int
    rows_per_program: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        check_powers_of_2(self, "block_rows", "block_n", "num_warps")
        check_multiple(self)


def _bwd_kernel(*refs: Any, n: int, rows: int, block_rows: int, block_n: int,
                rows_per_program: int, subtract_mean: bool, has_scale: bool, has_ds: bool,
                want_dscale: bool, want_doffset: bool) -> None:
    it = iter(refs)
    x_ref, dy_ref, mean_ref, rstd_ref = next(it), next(it), next(it), next(it)
    scale_ref = next(it) if has_scale else None
    ds_ref = next(it) if has_ds else None
    dx_ref = next(it)
    dscale_ref = next(it) if want_dscale else None
    doffset_ref = next(it) if want_doffset else None
    program = pl.program_id(0)
    first_row = program * rows_per_program
    num_chunks = _triton.cdiv(n, block_n)
    exact = is_exact(rows, n, rows_per_program, block_n)
    zeros = jnp.zeros((block_rows, block_n), jnp.float32)

    def row_block(i: Any) -> tuple[Any, jax.Array | None, jax.Array, jax.Array]:
        r0 = pl.multiple_of(first_row + i * block_rows, block_rows)
        row_mask = row_mask_of(r0, rows=rows, block_rows=block_rows, exact=exact)
        stats = pl.ds(r0, block_rows)
        mean = masked_load(mean_ref.at[stats], row_mask)
        rstd = masked_load(rstd_ref.at[stats], row_mask)
        return r0, row_mask, mean, rstd

    def chunk(r0: Any, row_mask: jax.Array | None, mean: jax.Array, rstd: jax.Array,
              c: Any) -> tuple:
        """x_hat, dy and g = dy * scale of one chunk (zeros outside the array)."""
        load = functools.partial(load_rows, r0=r0, c=c, row_mask=row_mask, n=n,
                                 block_n=block_n, block_rows=block_rows)
        x, mask, col_mask = load(x_ref)
        dy, _, _ = load(dy_ref)
        x_hat = masked(mask, (x - mean[:, None]) * rstd[:, None])
        g = dy if scale_ref is None else dy * load_vector(scale_ref, c, col_mask, block_n)[None]
        return x_hat, dy, g, mask, col_mask

    def store_dx(r0: Any, c: Any, dx: jax.Array, mask: jax.Array) -> None:
        block = (pl.ds(r0, block_rows), pl.ds(c * block_n, block_n))
        if ds_ref is not None:  # the cotangent of the sum s, added in float32
            dx = dx + masked_load(ds_ref.at[block], mask).astype(jnp.float32)
        plgpu.store(dx_ref.at[block], dx.astype(dx_ref.dtype), mask=mask)

    def dx_of(x_hat: jax.Array, g: jax.Array, rstd: jax.Array, c1: jax.Array,
              c2: jax.Array) -> jax.Array:
        return rstd[:, None] * (g - x_hat * c1[:, None] - c2[:, None])

    def partial_ref(ref: Any, c: Any) -> Any:
        return ref.at[pl.ds(program, 1), pl.ds(c * block_n, block_n)]

    steps = rows_per_program // block_rows
    if num_chunks == 1:
        def step(i: Any, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            r0, row_mask, mean, rstd = row_block(i)
            x_hat, dy, g, mask, _ = chunk(r0, row_mask, mean, rstd, 0)
            c1 = (x_hat * g).sum(axis=1) / n
            c2 = g.sum(axis=1) / n if subtract_mean else jnp.zeros_like(c1)
            store_dx(r0, 0, dx_of(x_hat, g, rstd, c1, c2), mask)
            return acc[0] + dy * x_hat, acc[1] + dy

        dscale, doffset = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
        col_mask = (jnp.arange(block_n) < n)[None, :]
        if dscale_ref is not None:
            plgpu.store(partial_ref(dscale_ref, 0), dscale.sum(axis=0)[None], mask=col_mask)
        if doffset_ref is not None:
            plgpu.store(partial_ref(doffset_ref, 0), doffset.sum(axis=0)[None], mask=col_mask)
        return

    partials = [ref for ref in (dscale_ref, doffset_ref) if ref is not None]

    def zero(c: Any, carry: int) -> int:
        col_mask = (c * block_n + jnp.arange(block_n) < n)[None, :]
        for ref in partials:
            plgpu.store(partial_ref(ref, c), jnp.zeros((1, block_n), jnp.float32), mask=col_mask)
        return carry

    jax.lax.fori_loop(0, num_chunks, zero, 0)

    def long_rows(i: Any, carry: int) -> int:
        r0, row_mask, mean, rstd = row_block(i)

        def row_sums(c: Any, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            x_hat, _, g, _, _ = chunk(r0, row_mask, mean, rstd, c)
            return acc[0] + x_hat * g, acc[1] + g

        sum1, sum2 = jax.lax.fori_loop(0, num_chunks, row_sums, (zeros, zeros))
        c1 = sum1.sum(axis=1) / n
        c2 = sum2.sum(axis=1) / n if subtract_mean else jnp.zeros_like(c1)

        def write(c: Any, carry: int) -> int:
            x_hat, dy, g, mask, col_mask = chunk(r0, row_mask, mean, rstd, c)
            store_dx(r0, c, dx_of(x_hat, g, rstd, c1, c2), mask)
            partial_mask = None if col_mask is None else col_mask[None]
            for ref, value in ((dscale_ref, dy * x_hat), (doffset_ref, dy)):
                if ref is not None:
                    old = masked_load(partial_ref(ref, c), partial_mask)
                    plgpu.store(partial_ref(ref, c), old + value.sum(axis=0)[None],
                                mask=partial_mask)
            return carry

        jax.lax.fori_loop(0, num_chunks, write, 0)
        return carry

    jax.lax.fori_loop(0, steps, long_rows, 0)


def layer_norm_backward(x: jax.Array, dy: jax.Array, mean: jax.Array, rstd: jax.Array,
                        scale: jax.Array | None, *, subtract_mean: bool, want_dscale: bool,
                        want_doffset: bool, config: Config, interpret: bool = False,
                        ds: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """`(dx, dscale, doffset)` in float32 sums (dscale/doffset `None` unless asked for).

    `x` is the array that was normalized; `ds`, an extra cotangent of it (the residual
    sum's, which the forward also returned), is added to `dx`."""
    *_, n = x.shape
    rows = math.prod(x.shape[:-1])
    programs = _triton.cdiv(rows, config.rows_per_program)
    kernel = functools.partial(
        _bwd_kernel, n=n, rows=rows, block_rows=config.block_rows, block_n=config.block_n,
        rows_per_program=config.rows_per_program, subtract_mean=subtract_mean,
        has_scale=scale is not None, has_ds=ds is not None, want_dscale=want_dscale,
        want_doffset=want_doffset,
    )
    partial = jax.ShapeDtypeStruct((programs, n), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((rows, n), x.dtype)]
    out_shape += [partial] * (int(want_dscale) + int(want_doffset))
    outs = pl.pallas_call(
        kernel,
        grid=(programs,),
        out_shape=tuple(out_shape),
        compiler_params=_triton.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="tokamax_layer_norm_bwd",
    )(x.reshape(rows, n), dy.reshape(rows, n), mean.reshape(rows).astype(jnp.float32),
      rstd.reshape(rows).astype(jnp.float32), *([] if scale is None else [scale]),
      *([] if ds is None else [ds.reshape(rows, n)]))
    dx, *sums = outs
    sums = [s.sum(axis=0) for s in sums]
    dscale = sums.pop(0) if want_dscale else None
    doffset = sums.pop(0) if want_doffset else None
    return dx.reshape(x.shape), dscale, doffset


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonLayerNormVjp(TritonKernel, VjpOp):
    """The gradient of `LayerNorm` (any implementation's residuals) as a Triton kernel."""

    config_cls = Config
    forward_family = LayerNorm
    # In a model XLA fuses its norm gradient with the add into the residual stream after
    # it, which a kernel cannot: the kernel must be a fifth faster than XLA's gradient
    # alone. The margin is a judgement; `benchmarks/probes/norms_in_models.py` times the
    # models' steps with the norms as `None` picks them and forced either way.
    kernel_margin = 0.2

    def reference_op(self) -> Op:
        return AutodiffVjp(forward=LayerNorm())

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_triton_norm_inputs(ba)
        for dout in jax.tree.leaves(ba.arguments["dout"]):  # (dy, ds) with a residual
            _triton.require_triton_dtype("dout", dout)

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Config,
             return_residuals: bool, x: jax.Array, scale: jax.Array | None,
             offset: jax.Array | None, axis: int, epsilon: float,
             subtract_mean: bool, residual: jax.Array | None = None
             ) -> tuple[dict[str, Any], None]:
        mean, rstd = residuals
        # With a residual the forward normalized s = x + residual, its second output.
        (normalized, dy, ds) = (x, dout, None) if residual is None else (out[1], *dout)
        dx, dscale, doffset = layer_norm_backward(
            normalized, dy, mean, rstd, scale, subtract_mean=subtract_mean,
            want_dscale=scale is not None, want_doffset=offset is not None, config=config,
            interpret=self.interpret, ds=ds,
        )
        grads = {"x": dx}
        if residual is not None:
            grads["residual"] = dx
        if scale is not None and dscale is not None:  # asked for exactly with a scale
            grads["scale"] = dscale.astype(scale.dtype)
        if offset is not None and doffset is not None:
            grads["offset"] = doffset.astype(offset.dtype)
        return grads, None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """Fitted on the H200 to `benchmarks/probes/layer_norm_configs_sweep.py`: at
        65536x4096 bf16, 128 rows per program and 16 warps; short rows get 2K-element
        blocks (a 64-wide row keeps the memory system busy only in blocks of many rows)."""
        x = ba.arguments["x"]
        n, rows = x.shape[-1], math.prod(x.shape[:-1])
        block_n = row_chunk(n)
        block_rows = max(1, min(64, 2048 // block_n))
        # ~4 programs per SM: enough to hide latency, few partial rows to sum.
        per_program = _triton.cdiv(rows, 4 * _gpu.sm_count())
        rows_per_program = max(block_rows, _triton.next_power_of_2(per_program))
        num_warps = max(4, min(16, block_rows * block_n // 256))
        return Config(block_rows=block_rows, block_n=block_n, rows_per_program=rows_per_program,
                      num_warps=num_warps, num_stages=2)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        x = ba.arguments["x"]
        n, rows = x.shape[-1], math.prod(x.shape[:-1])
        configs = set()
        block_n = row_chunk(n)
        for r, w, s, programs_per_sm in itertools.product(block_rows_choices(block_n), (4, 8, 16),
                                                          (2, 3), (2, 4, 8)):
            per_program = _triton.cdiv(rows, programs_per_sm * _gpu.sm_count())
            rpp = max(r, _triton.next_power_of_2(per_program))
            configs.add(Config(block_rows=r, block_n=block_n, rows_per_program=rpp,
                               num_warps=w, num_stages=s))
        return configs
