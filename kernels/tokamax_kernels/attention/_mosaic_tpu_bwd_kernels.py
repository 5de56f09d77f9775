"""The Pallas Mosaic TPU flash-attention backward kernels: dK/dV and dQ.

Both recompute the probabilities of a (query block, key block) tile from the forward's
logsumexp, `p = exp2(s - lse2)` (`lse2 = +inf` on rows that saw nothing, so their `p`
is 0), and `ds = p * (dp - delta)` with `delta = rowsum(out * dout)`.

dK/dV: grid (batch, kv heads, key blocks, query heads of the group x query blocks); a
key block accumulates `p^T dout` and `ds^T q` over every query head that reads it (GQA)
and every query block, in float32 VMEM scratch, and is written once at the end.
dQ: grid (batch, heads, query blocks, key blocks), accumulating `ds k`.
Each output block has one owner and a fixed order: no atomics, deterministic reruns.
Tiles no row/key of the block can see do no work and copy nothing (as the forward).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_kernels._mosaic_tpu import compiler_params
from tokamax_kernels.attention import _mosaic_tpu_common as tpu
from tokamax_kernels.attention._flash_tiles import (
    KernelSpec,
    dlogits,
    logits2,
    q_block_ranges,
)
from tokamax_kernels.attention._mosaic_tpu_fwd_kernel import visible_kv_blocks


def _visible_q_blocks(spec: KernelSpec, j: Any, block_k: int, block_q: int, num_qb: int,
                      q_len: Any, kv_len: Any) -> tuple[Any, Any]:
    """Query blocks `[lo, hi)` of which some row sees a key of key block `j`."""
    lo, _, _, hi = q_block_ranges(spec, j * block_k, block_k, block_q, num_qb, q_len, kv_len)
    return lo, hi


def _tile_grads(spec: KernelSpec, q, k, v, do, lse2, delta, r0: Any, c0: Any, q_len: Any,
                kv_len: Any) -> tuple[jax.Array, jax.Array]:
    """`(p, ds)` of one tile: the probabilities and the gradient of the pre-scale logits."""
    s, t = logits2(spec, tpu.dot(spec, q, k, (1, 1)), None)
    ok = tpu.visible(spec, r0, c0, s.shape, kv_len, q_len)
    p = jnp.where(ok, jnp.exp2(s - lse2), 0.0)
    dp = tpu.dot(spec, do, v, (1, 1))
    ds = dlogits(spec, p * (dp - delta), t) * spec.scale
    return p, ds


def _dkv_kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref,
                dk_ref, dv_ref, dk_acc, dv_acc, *, spec: KernelSpec, block_q: int,
                block_k: int, num_qb: int) -> None:
    b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    i = lax.rem(t, num_qb)
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    lo, hi = _visible_q_blocks(spec, j, block_k, block_q, num_qb, q_len, kv_len)

    @pl.when(t == 0)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when((i >= lo) & (i < hi))
    def _step():
        q, do = q_ref[...], do_ref[...]
        p, ds = _tile_grads(spec, q, k_ref[...], v_ref[...], do, lse2_ref[...], delta_ref[...],
                            i * block_q, j * block_k, q_len, kv_len)
        # p^T and ds^T: float32 tiles transposed (a 32-bit transpose), then cast for the MXU.
        dv_acc[...] += tpu.dot(spec, p.T.astype(do.dtype), do, (1, 0))
        dk_acc[...] += tpu.dot(spec, ds.T.astype(q.dtype), q, (1, 0))

    @pl.when(t == pl.num_programs(3) - 1)
    def _store():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref,
               dq_acc, *, spec: KernelSpec, block_q: int, block_k: int, num_kb: int) -> None:
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    lo, hi = visible_kv_blocks(spec, i, block_q, block_k, num_kb, q_len, kv_len)

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    @pl.when((j >= lo) & (j < hi))
    def _step():
        k = k_ref[...]
        _, ds = _tile_grads(spec, q_ref[...], k, v_ref[...], do_ref[...], lse2_ref[...],
                            delta_ref[...], i * block_q, j * block_k, q_len, kv_len)
        dq_acc[...] += tpu.dot(spec, ds.astype(k.dtype), k, (1, 0))

    @pl.when(j == num_kb - 1)
    def _store():
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def flash_attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
                             lse2: jax.Array, delta: jax.Array, q_len: jax.Array,
                             kv_len: jax.Array, *, spec: KernelSpec, block_q: int, block_k: int,
                             interpret: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(dq, dk, dv)` in the kernel layout: q, do (B, H, Sq, D); k, v (B, Hkv, Sk, D);
    lse2 (base-2 logsumexp, +inf on empty rows) and delta (B, H, Sq, 1) float32."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_qb, num_kb = seq_q // block_q, seq_k // block_k
    itemsize = jnp.dtype(q.dtype).itemsize
    vmem = (2 * (3 * block_q + 2 * block_k) * head_dim * itemsize
            + (2 * block_k * head_dim + 3 * block_q * block_k + 4 * block_q * 128) * 4)
    scalars = (q_len, kv_len)
    operands = (q, k, v, do, lse2, delta)

    # dK/dV: the innermost axis walks (query head in the group, query block); `lax.div`
    # and `lax.rem`, not `//` and `%` (see `_mosaic_tpu_fwd_kernel`'s docstring).
    def dkv_q_index(b, hk, j, t, q_len, kv_len):
        lo, hi = _visible_q_blocks(spec, j, block_k, block_q, num_qb, q_len[b], kv_len[b])
        head, i = hk * group + lax.div(t, num_qb), lax.rem(t, num_qb)
        return b, head, tpu.clamp_block(i, lo, hi), 0

    def dkv_k_index(b, hk, j, t, q_len, kv_len):
        return b, hk, j, 0

    row_specs = _row_specs(block_q, block_k, head_dim, dkv_q_index, dkv_k_index)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, spec=spec, block_q=block_q, block_k=block_k,
                          num_qb=num_qb),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(batch, kv_heads, num_kb, group * num_qb),
            in_specs=row_specs, out_specs=[row_specs[1], row_specs[1]],
            scratch_shapes=[pltpu.VMEM((block_k, head_dim), jnp.float32)] * 2),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
        compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary"), vmem),
        interpret=interpret, name="tokamax_flash_attention_dkv",
    )(*scalars, *operands)

    def dq_q_index(b, h, i, j, q_len, kv_len):
        return b, h, i, 0

    def dq_k_index(b, h, i, j, q_len, kv_len):
        lo, hi = visible_kv_blocks(spec, i, block_q, block_k, num_kb, q_len[b], kv_len[b])
        return b, lax.div(h, group), tpu.clamp_block(j, lo, hi), 0

    row_specs = _row_specs(block_q, block_k, head_dim, dq_q_index, dq_k_index)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec, block_q=block_q, block_k=block_k,
                          num_kb=num_kb),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(batch, heads, num_qb, num_kb),
            in_specs=row_specs, out_specs=row_specs[0],
            scratch_shapes=[pltpu.VMEM((block_q, head_dim), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary"), vmem),
        interpret=interpret, name="tokamax_flash_attention_dq",
    )(*scalars, *operands)
    return dq, dk, dv


def _row_specs(block_q: int, block_k: int, head_dim: int, q_index: Any, k_index: Any
               ) -> list[pl.BlockSpec]:
    """Block specs of (q, k, v, do, lse2, delta) for the given query/key index maps."""
    q_block = pl.BlockSpec((None, None, block_q, head_dim), q_index)
    k_block = pl.BlockSpec((None, None, block_k, head_dim), k_index)
    row = pl.BlockSpec((None, None, block_q, 1), q_index)
    return [q_block, k_block, k_block, q_block, row, row]
