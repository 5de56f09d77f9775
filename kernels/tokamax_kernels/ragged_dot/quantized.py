"""Ragged dots with quantized operands (`quantization.QuantizedArray` or a qwix `QArray`).

A quantized operand whose scales are constant along the contraction (per row of `lhs`,
per group and column of `rhs`, or one for all) is multiplied as stored: the dot reads
the 8-bit values, accumulates in float32 (int32 for two int8 operands in `xla`), and
the scales multiply the product afterwards, `out[r] = (lhs_q[r] @ rhs_q[g]) * ls[r] *
rs[g]`. Scales that vary along the contraction (per block of K) multiply each step's
product in `triton` (where its step divides the blocks) and are dequantized first in
`xla`; a zero point is dequantized first. Values of two different kinds are converted to
one before the dot, each exactly (8-bit integers and float8 e4m3 fit in bf16): bf16
activations with int8 weights run a bf16 dot whose weights are read as int8.

Implementations: `xla` (`jax.lax.ragged_dot` or the tiled form, as for plain operands)
and `triton` (`pallas_triton_quantized`: the conversion in the kernel, the scales in its
epilogue; float8 weights read contraction-major, (G, N, K), as Hopper's float8 `wgmma`
takes them). The Mosaic kernels take bf16/f16 operands only and raise
`NotImplementedError`, so a sequence moves on. `implementation=None` runs `triton` where
the target runs it, else `xla`.

Gradients: a quantized operand is a constant (its cotangents are zeros); an unquantized
`lhs` gets `(dout * rs[g]) @ rhs_q[g]^T`, a ragged dot of the same implementation; an
unquantized `rhs` gets `dequantize(lhs)_g^T @ dout_g` in `xla`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels._triton import MatmulConfig
from tokamax_kernels.ragged_dot import pallas_triton_quantized as triton_quantized
from tokamax_kernels.ragged_dot import quantization as q
from tokamax_kernels.ragged_dot.base import RaggedDot, xla_ragged_dot
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot
from tokamax_pass.core import Op, current_target
from tokamax_pass.core.errors import all_failed
from tokamax_pass.core.registry import Family, Implementation

_OP = "ragged_dot"
_WIDE_FLOATS = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


def dot_dtypes(lhs_dtype: Any, rhs_dtype: Any) -> tuple[Any, Any, Any]:
    """`(lhs dtype, rhs dtype, accumulator dtype)` the dot runs in: two int8 or two
    float8 operands of one kind as they are; an 8-bit (or int4) operand with a 16/32-bit
    float one in that float; any other pair in bf16 (each conversion exact)."""
    a, b = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    if a == b == jnp.dtype(jnp.int8):
        return a, b, jnp.dtype(jnp.int32)
    if a == b and jnp.issubdtype(a, jnp.floating):
        return a, b, jnp.dtype(jnp.float32)
    wide = [d for d in (a, b) if d in _WIDE_FLOATS]
    common = jnp.dtype(jnp.result_type(*wide)) if wide else jnp.dtype(jnp.bfloat16)
    return common, common, jnp.dtype(jnp.float32)


def group_of_rows(group_sizes: jax.Array, m: int) -> jax.Array:
    """The group of each of the `m` rows (rows past the groups: the last group; their
    products are zeros whatever scale they meet)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(m, dtype=jnp.int32)
    groups = jnp.searchsorted(ends, rows, side="right")
    return jnp.minimum(groups, group_sizes.shape[0] - 1).astype(jnp.int32)


def scales_of_rows(rhs_scale: jax.Array, group_sizes: jax.Array, m: int) -> jax.Array:
    """Each of the `m` rows' scales `(m, N)` from per-group ones `(G, 1, N)`: its group's.
    Without groups every row is past them (a zero product) and takes 0: there is no last
    group to read."""
    if rhs_scale.shape[0] == 0:
        return jnp.zeros((m, rhs_scale.shape[2]), rhs_scale.dtype)
    return rhs_scale[:, 0, :][group_of_rows(group_sizes, m)]


@dataclasses.dataclass(frozen=True)
class XlaBackend:
    """Row-grouped ragged dots (forward, dlhs) in plain XLA, scales after the dot."""

    path: str = "auto"

    def forward(self, lhs: Any, rhs: Any, group_sizes: jax.Array, *, precision: Any,
                out_dtype: Any) -> jax.Array:
        """`lhs (M, K) x rhs (G, K, N)`, either quantized: scales constant along K after
        the dot, others dequantized first."""
        lhs_values, lhs_scale = q.post_scale(lhs, 1)
        rhs_values, rhs_scale = q.post_scale(rhs, 1)
        return self._rows(lhs_values, rhs_values, group_sizes, lhs_scale=lhs_scale,
                          rhs_scale=rhs_scale, transpose_rhs=False, precision=precision,
                          out_dtype=out_dtype)

    def dlhs(self, dout: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
             precision: Any, out_dtype: Any) -> jax.Array:
        """`dout (M, N) x rhs (G, K, N)^T`, `rhs` as stored (8-bit or float)."""
        return self._rows(dout, rhs, group_sizes, lhs_scale=None, rhs_scale=None,
                          transpose_rhs=True, precision=precision, out_dtype=out_dtype)

    def _rows(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
              lhs_scale: jax.Array | None, rhs_scale: jax.Array | None, transpose_rhs: bool,
              precision: Any, out_dtype: Any) -> jax.Array:
        """`out[r] = (lhs[r] @ rhs[g(r)]) * lhs_scale[r] * rhs_scale[g(r)]`, `rhs[g]`
        transposed with `transpose_rhs`; `lhs_scale` (M, 1), `rhs_scale` (G, 1, N)."""
        lhs_dtype, rhs_dtype, acc = dot_dtypes(lhs.dtype, rhs.dtype)
        variant = "dlhs" if transpose_rhs else "forward"
        out = xla_ragged_dot(variant, precision, acc, self.path)(
            lhs.astype(lhs_dtype), rhs.astype(rhs_dtype), group_sizes)
        out = out.astype(jnp.float32)
        if lhs_scale is not None:
            out = out * lhs_scale.astype(jnp.float32)
        if rhs_scale is not None:
            per_row = scales_of_rows(rhs_scale, group_sizes, lhs.shape[0])
            out = out * per_row.astype(jnp.float32)
        return out.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class TritonBackend:
    """Row-grouped ragged dots by `pallas_triton_quantized`: scales constant along K in
    the epilogue, scales per block of K on each step's product."""

    op: PallasTritonRaggedDot

    def _config(self, m: int, k: int, n: int, groups: int, dot_dtype: Any) -> MatmulConfig:
        return self.op.config or triton_quantized.heuristics_config(
            m=m, k=k, n=n, groups=groups, dot_dtype=dot_dtype)

    def forward(self, lhs: Any, rhs: Any, group_sizes: jax.Array, *, precision: Any,
                out_dtype: Any) -> jax.Array:
        del precision  # 8/16-bit products are exact in the float32 accumulator
        (m, k), (groups, _, n) = lhs.shape, rhs.shape
        lhs_values, lhs_scale = q.blocked_scale(lhs, 1)
        rhs_values, rhs_scale = q.blocked_scale(rhs, 1)
        dot_dtype = triton_quantized.kernel_dot_dtype(lhs_values.dtype, rhs_values.dtype)
        config = self._config(m, k, n, groups, dot_dtype)
        blocks = [1 if s is None else s.shape[1] for s in (lhs_scale, rhs_scale)]
        block_k = triton_quantized.block_k_for_scales(config.block_k, k, *blocks)
        if block_k is None:  # no step divides the scales' blocks: dequantized instead
            lhs_values, lhs_scale = q.post_scale(lhs, 1)
            rhs_values, rhs_scale = q.post_scale(rhs, 1)
        else:
            config = dataclasses.replace(config, block_k=block_k)
        # Hopper's float8 `wgmma` reads both tiles contraction-major: float8 weights go in
        # as (G, N, K) (free where they are stored so and reach here swapped, as the
        # transposed form of `ragged_dot_general` passes them: the two transposes cancel).
        k_major = triton_quantized.kernel_dot_dtype(
            lhs_values.dtype, rhs_values.dtype) in triton_quantized.FLOAT8
        if k_major:
            rhs_values = jnp.swapaxes(rhs_values, 1, 2)
        return triton_quantized.ragged_dot(
            lhs_values, rhs_values, group_sizes, lhs_scale=lhs_scale,
            rhs_scale=rhs_scale, transpose_rhs=k_major, out_dtype=out_dtype, config=config,
            interpret=self.op.interpret)

    def dlhs(self, dout: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
             precision: Any, out_dtype: Any) -> jax.Array:
        del precision
        dot_dtype = triton_quantized.kernel_dot_dtype(dout.dtype, rhs.dtype)
        config = self._config(dout.shape[0], dout.shape[1], rhs.shape[1], rhs.shape[0],
                              dot_dtype)
        return triton_quantized.ragged_dot(
            dout, rhs, group_sizes, lhs_scale=None, rhs_scale=None, transpose_rhs=True,
            out_dtype=out_dtype, config=config, variant="dlhs", interpret=self.op.interpret)


def _backend(op: Op, lhs: Any, rhs: Any) -> XlaBackend | TritonBackend:
    """The backend that runs `op` for quantized operands, or `NotImplementedError`."""
    if type(op) is RaggedDot:
        return XlaBackend()
    if isinstance(op, PallasTritonRaggedDot):
        op.check_supported_target(current_target())
        triton_quantized.check_supported(lhs, rhs)
        return TritonBackend(op)
    raise NotImplementedError(
        f"{type(op).__name__} does not take quantized operands (bf16/f16 only); "
        f"implementation='xla' or 'triton' does")


def ragged_dot(family: Family, lhs: Any, rhs: Any, group_sizes: jax.Array, *, precision: Any,
               preferred_element_type: Any, implementation: Implementation) -> jax.Array:
    """`lhs (M, K) x rhs (G, K, N)` with either or both quantized (module docstring): the
    first of `implementation`'s ops (names, `Op`s) that takes them. `None`: `triton` where
    the target runs it (on the H200 it runs both goal shapes of
    `benchmarks/probes/quantized_ragged_dot.py` several times faster than `xla`), else
    `xla`."""
    lhs = q.as_quantized_array(lhs) if q.is_quantized(lhs) else jnp.asarray(lhs)
    rhs = q.as_quantized_array(rhs) if q.is_quantized(rhs) else jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"{_OP}: quantized operands must be lhs (M, K) and rhs (G, K, N), "
                         f"got {lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"{_OP}: group_sizes must have shape ({rhs.shape[0]},), got "
                         f"{group_sizes.shape}")
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.result_type(lhs.dtype, rhs.dtype))
    ops = ((PallasTritonRaggedDot(), RaggedDot()) if implementation is None
           else family.resolve(implementation)[0])
    failures: list[tuple[str, Exception]] = []
    for op in ops:
        try:
            backend = _backend(op, lhs, rhs)
        except NotImplementedError as e:
            failures.append((type(op).__name__, e))
            continue
        return _differentiable(backend, precision, out_dtype)(lhs, rhs, group_sizes)
    raise all_failed(f"{_OP}: no implementation takes these quantized operands:", failures)


@functools.cache
def _differentiable(backend: XlaBackend | TritonBackend, precision: Any,
                    out_dtype: Any) -> Any:
    """The quantized forward with its gradient rule (module docstring)."""

    def forward(lhs: Any, rhs: Any, group_sizes: jax.Array) -> jax.Array:
        return backend.forward(lhs, rhs, group_sizes, precision=precision,
                               out_dtype=out_dtype)

    @jax.custom_vjp
    def f(lhs: Any, rhs: Any, group_sizes: jax.Array) -> jax.Array:
        return forward(lhs, rhs, group_sizes)

    def fwd(lhs: Any, rhs: Any, group_sizes: jax.Array) -> tuple[jax.Array, Any]:
        return forward(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(saved: Any, dout: jax.Array) -> tuple[Any, Any, None]:
        lhs, rhs, group_sizes = saved
        dlhs = drhs = None
        if not q.is_quantized(lhs):
            rhs_values, rhs_scale = q.post_scale(rhs, 1)
            scaled = dout.astype(jnp.float32)
            if rhs_scale is not None:
                per_row = scales_of_rows(rhs_scale, group_sizes, lhs.shape[0])
                scaled = scaled * per_row.astype(jnp.float32)
            dlhs = backend.dlhs(scaled.astype(lhs.dtype), rhs_values, group_sizes,
                                precision=precision, out_dtype=lhs.dtype)
        if not q.is_quantized(rhs):
            values = q.dequantize(lhs).astype(rhs.dtype)
            drhs = xla_ragged_dot("drhs", precision, rhs.dtype)(
                values, dout.astype(rhs.dtype), group_sizes)
        return (q.zero_cotangent(lhs) if dlhs is None else dlhs,
                q.zero_cotangent(rhs) if drhs is None else drhs, None)

    f.defvjp(fwd, bwd)
    return f
