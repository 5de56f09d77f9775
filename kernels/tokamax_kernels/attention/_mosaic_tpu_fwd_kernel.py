"""The Pallas Mosaic TPU flash-attention forward kernel.

Grid (batch, heads, query blocks, key blocks), key blocks innermost and sequential:
a program keeps its query block's running max `m`, denominator `l` and float32
output accumulator in VMEM scratch across the key blocks (online softmax in base 2),
and writes the output and the logsumexp at the last key block. Key blocks that no
row of the query block can see (causal, window, key length; every block past the
query length) do no work, and their key/value block index is moved onto a visible
block so the pipeline copies nothing for them.

Integer division of grid indices is `lax.div`/`lax.rem` (all are non-negative): `//` and
`%` lower through `sign`, whose Mosaic lowering reads the TPU generation from the
abstract device, an H200 in an export for CUDA and TPU at once.
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
    LN2,
    KernelSpec,
    kv_block_ranges,
    logits2,
)


def visible_kv_blocks(spec: KernelSpec, i: Any, block_q: int, block_k: int, num_kb: int,
                      q_len: Any, kv_len: Any) -> tuple[Any, Any]:
    """Key blocks `[lo, hi)` that some row of query block `i` sees."""
    lo, _, _, hi = kv_block_ranges(spec, i * block_q, block_q, block_k, num_kb, kv_len)
    return lo, jnp.where(i * block_q < q_len, hi, lo)


def _kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref,
            *, spec: KernelSpec, block_q: int, block_k: int, num_kb: int) -> None:
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_len, kv_len = q_len_ref[b], kv_len_ref[b]
    lo, hi = visible_kv_blocks(spec, i, block_q, block_k, num_kb, q_len, kv_len)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((j >= lo) & (j < hi))
    def _step():
        s, _ = logits2(spec, tpu.dot(spec, q_ref[...], k_ref[...], (1, 1)), None)
        ok = tpu.visible(spec, i * block_q, j * block_k, s.shape, kv_len, q_len)
        s = jnp.where(ok, s, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; subtract 0 instead (exp2 -> 0).
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_use)
        alpha = jnp.exp2(m_prev - m_use)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_ref[...] = alpha * acc_ref[...] + tpu.dot(spec, p.astype(v.dtype), v, (1, 0))
        m_ref[...] = m_new

    @pl.when(j == num_kb - 1)
    def _store():
        denom = l_ref[...]
        seen = denom > 0  # a row that saw nothing returns zeros and lse = -inf
        out = acc_ref[...] / jnp.where(seen, denom, 1.0)
        o_ref[...] = jnp.where(seen, out, 0.0).astype(o_ref.dtype)
        lse2 = m_ref[...] + jnp.log2(jnp.where(seen, denom, 1.0))
        lse_ref[...] = jnp.where(seen, lse2 * LN2, -jnp.inf)


def flash_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, q_len: jax.Array,
                            kv_len: jax.Array, *, spec: KernelSpec, block_q: int, block_k: int,
                            interpret: Any) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` for q (B, H, Sq, D) and k, v (B, Hkv, Sk, D), sequences padded to whole
    blocks; `lse` is (B, H, Sq, 1) float32 (natural log)."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_kb = seq_k // block_k

    def kv_index(b, h, i, j, q_len, kv_len):
        lo, hi = visible_kv_blocks(spec, i, block_q, block_k, num_kb, q_len[b], kv_len[b])
        return b, lax.div(h, group), tpu.clamp_block(j, lo, hi), 0

    def q_index(b, h, i, j, q_len, kv_len):
        return b, h, i, 0

    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), kv_index)
    itemsize = jnp.dtype(q.dtype).itemsize
    vmem = (2 * (2 * block_q + 2 * block_k) * head_dim * itemsize
            + block_q * (head_dim + block_k + 2 * 128) * 4)
    kernel = functools.partial(_kernel, spec=spec, block_q=block_q, block_k=block_k,
                               num_kb=num_kb)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads, seq_q // block_q, num_kb),
            in_specs=[pl.BlockSpec((None, None, block_q, head_dim), q_index), kv_spec, kv_spec],
            out_specs=[pl.BlockSpec((None, None, block_q, head_dim), q_index),
                       pl.BlockSpec((None, None, block_q, 1), q_index)],
            scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32),
                            pltpu.VMEM((block_q, 1), jnp.float32),
                            pltpu.VMEM((block_q, head_dim), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, seq_q, 1), jnp.float32)],
        compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary"), vmem),
        interpret=interpret,
        name="tokamax_flash_attention_fwd",
    )(q_len, kv_len, q, k, v)
