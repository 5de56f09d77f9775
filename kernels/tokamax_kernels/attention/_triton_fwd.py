"""The Pallas Triton flash-attention forward kernel (online softmax, FlashAttention-2 style).

Grid `(q blocks, batch, q heads)`: each program keeps one `(block_q, D)` query tile and
streams the key/value blocks its rows can see, with float32 accumulators. Per tile
row it tracks the running max `m` and sum `denom` in the base-2 domain (`exp2` with
`log2(e)` folded into the scale). Key blocks are visited in three runs: masked edge
blocks, fully visible blocks (no positional mask), masked edge blocks; blocks that
no row can see (causal, local window, key lengths) are never loaded.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels.attention import _flash_tiles as tiles
from tokamax_kernels.attention._flash_tiles import KernelSpec


def _kernel(q_ref, k_ref, v_ref, bias_ref, mask_ref, qlen_ref, kvlen_ref, o_ref, lse_ref, *,
            spec: KernelSpec, block_q: int, block_k: int, num_kb: int, reverse: bool) -> None:
    num_qb = pl.num_programs(0)
    qi = num_qb - 1 - pl.program_id(0) if reverse else pl.program_id(0)
    b = pl.program_id(1)
    r0 = qi * block_q
    q_len = qlen_ref[b] if spec.has_q_lengths else spec.seq_q
    kv_len = jnp.minimum(kvlen_ref[b], spec.seq_k) if spec.has_kv_lengths else spec.seq_k
    q = q_ref[...]
    rows = r0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    value_dim = v_ref.shape[-1]
    element_masks = spec.has_mask or spec.has_bias  # per-element inputs on every block

    def body(kb: Any, carry: Any, *, positional: bool) -> Any:
        acc, m, denom = carry
        c0 = pl.multiple_of(kb * block_k, block_k)
        k = k_ref[pl.ds(c0, block_k), :]
        v = v_ref[pl.ds(c0, block_k), :]
        qk = spec.dot(q, k.T)
        bias = bias_ref[:, pl.ds(c0, block_k)] if spec.has_bias else None
        s, _ = tiles.logits2(spec, qk, bias)
        masked = positional or spec.has_mask
        if masked:
            ok = jnp.ones(s.shape, jnp.bool_)
            if positional:
                cols = c0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
                ok = tiles.visible(spec, rows, cols, kv_len)
            if spec.has_mask:
                ok = ok & (mask_ref[:, pl.ds(c0, block_k)] != 0)
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A masked row with nothing visible yet keeps m = -inf; subtract 0 instead (exp2 -> 0).
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        denom = denom * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + spec.dot(p.astype(v.dtype), v)
        return acc, m_new, denom

    carry = (
        jnp.zeros((block_q, value_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    a, bb, c, d = tiles.kv_block_ranges(spec, r0, block_q, block_k, num_kb, kv_len)
    if spec.has_q_lengths:
        d = jnp.where(r0 < q_len, d, a)
        bb, c = jnp.minimum(bb, d), jnp.minimum(c, d)
    needs_edges = spec.positional or spec.has_kv_lengths or spec.seq_k % block_k
    masked_body = functools.partial(body, positional=True)
    plain_body = functools.partial(body, positional=False)
    if needs_edges:
        carry = lax.fori_loop(a, bb, masked_body, carry)
        carry = lax.fori_loop(bb, c, plain_body, carry)
        carry = lax.fori_loop(c, d, masked_body, carry)
    else:
        carry = lax.fori_loop(0, num_kb, plain_body, carry)
    acc, m, denom = carry
    empty = denom == 0.0
    if spec.has_q_lengths:
        empty = empty | (rows >= q_len)
    if element_masks or needs_edges or spec.has_q_lengths:
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, denom))
        lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, denom))) * tiles.LN2)
    else:
        inv = 1.0 / denom
        lse = (m + jnp.log2(denom)) * tiles.LN2
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = lse


def flash_attention_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, mask: jax.Array | None,
    q_lengths: jax.Array | None, kv_lengths: jax.Array | None, *, spec: KernelSpec,
    block_q: int, block_k: int, num_warps: int, num_stages: int, return_lse: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """`(out, lse)` for padded inputs: q `(B, Sq_pad, H, D)`, k `(B, Sk_pad, Hk, D)`, v
    `(B, Sk_pad, Hk, Dv)` (out `(B, Sq_pad, H, Dv)`),
    bias/mask `(Bb, Hb, Sq_pad, Sk_pad)` with `Bb in (1, B)`, `Hb in (1, H)`; lse is
    `(B, H, Sq_pad)` float32 natural-log logsumexp (`-inf` where a row sees nothing)."""
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    num_qb, num_kb = seq_q // block_q, seq_k // block_k
    in_specs: list[pl.BlockSpec | None]  # `None`: an absent bias, mask or lengths
    reverse = spec.right is not None and spec.left is None  # causal: heavy blocks first

    def q_index(i, b, h):
        return (b, num_qb - 1 - i if reverse else i, h, 0)

    def qrow_index(i, b, h):
        return num_qb - 1 - i if reverse else i

    in_specs = [
        pl.BlockSpec((None, block_q, None, head_dim), q_index),
        pl.BlockSpec((None, seq_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, seq_k, None, value_dim), lambda i, b, h: (b, 0, h // group, 0)),
    ]
    operands: list[Any] = [q, k, v]
    for extra in (bias, mask):
        if extra is None:
            in_specs.append(None)
            operands.append(None)
            continue
        bb, hb = extra.shape[0], extra.shape[1]
        in_specs.append(pl.BlockSpec(
            (None, None, block_q, seq_k),
            lambda i, b, h, bb=bb, hb=hb: (b if bb > 1 else 0, h if hb > 1 else 0,
                                           qrow_index(i, b, h), 0)))
        operands.append(extra)
    for lengths in (q_lengths, kv_lengths):
        in_specs.append(None if lengths is None else pl.BlockSpec((batch,), lambda i, b, h: (0,)))
        operands.append(lengths)
    out_shape = [jax.ShapeDtypeStruct((batch, seq_q, heads, value_dim), q.dtype)]
    out_specs = [pl.BlockSpec((None, block_q, None, value_dim), q_index)]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, block_q),
                                      lambda i, b, h: (b, h, qrow_index(i, b, h))))
    kernel = functools.partial(_kernel, spec=spec, block_q=block_q, block_k=block_k,
                               num_kb=num_kb, reverse=reverse)
    if not return_lse:
        kernel = _without_lse(kernel)
    outs = pl.pallas_call(
        kernel,
        grid=(num_qb, batch, heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tokamax_pass_flash_attention_fwd",
    )(*operands)
    return outs[0], (outs[1] if return_lse else None)


def _without_lse(kernel: Any) -> Any:
    def wrapped(*refs: Any) -> None:
        kernel(*refs, None)

    return wrapped
