"""The Pallas Triton flash-attention backward kernels: dK/dV and dQ, no atomics.

Two kernels, each owning its outputs, so a rerun is bitwise identical:
- dK/dV, grid `(kv blocks, batch, kv heads)`: a program keeps one key/value tile and
  streams the query blocks (of every query head in its GQA group) that can see it,
  working in the transposed form (`k @ q.T`) so no register tile is transposed.
- dQ (and dBias), grid `(q blocks, batch, q heads)`: a program keeps one query tile
  and streams the key/value blocks it can see, as in the forward.
Both recompute `p = exp2(s - lse)` from the forward's logsumexp; rows that saw
nothing carry `lse = +inf` here so their `p` is 0 without a mask.
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


def _dkdv_kernel(q_ref, k_ref, v_ref, bias_ref, mask_ref, qlen_ref, kvlen_ref, do_ref, lse_ref,
                 delta_ref, dk_ref, dv_ref, *, spec: KernelSpec, block_q: int, block_k: int,
                 num_qb: int, group: int, bias_heads: int, mask_heads: int) -> None:
    kb, b = pl.program_id(0), pl.program_id(1)
    c0 = kb * block_k
    q_len = qlen_ref[b] if spec.has_q_lengths else spec.seq_q
    kv_len = jnp.minimum(kvlen_ref[b], spec.seq_k) if spec.has_kv_lengths else spec.seq_k
    k = k_ref[...]
    v = v_ref[...]
    cols = c0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    a, bb, c, d = tiles.q_block_ranges(spec, c0, block_k, block_q, num_qb, q_len, kv_len)
    needs_edges = spec.positional or spec.has_kv_lengths or spec.seq_k % block_k

    def body(qb: Any, carry: Any, *, g: Any, positional: bool) -> Any:
        dk, dv = carry
        r0 = pl.multiple_of(qb * block_q, block_q)
        rows = pl.ds(r0, block_q)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        lse = lse_ref[g, rows]
        delta = delta_ref[g, rows]
        bias = None
        if spec.has_bias:
            bias = bias_ref[g if bias_heads > 1 else 0, rows, :].T
        s, t = tiles.logits2(spec, spec.dot(k, q.T), bias)  # (block_k, block_q)
        if positional or spec.has_mask:
            ok = jnp.ones(s.shape, jnp.bool_)
            if positional:
                row_ids = r0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
                ok = tiles.visible(spec, row_ids, cols, kv_len, transposed=True)
            if spec.has_mask:
                ok = ok & (mask_ref[g if mask_heads > 1 else 0, rows, :].T != 0)
            s = jnp.where(ok, s, -jnp.inf)
        p = jnp.exp2(s - lse[None, :])
        dv = dv + spec.dot(p.astype(do.dtype), do)
        dp = spec.dot(v, do.T)
        ds = tiles.dlogits(spec, p * (dp - delta[None, :]), t)
        dk = dk + spec.dot(ds.astype(q.dtype), q)
        return dk, dv

    def group_body(g: Any, carry: Any) -> Any:
        masked = functools.partial(body, g=g, positional=True)
        plain = functools.partial(body, g=g, positional=False)
        if needs_edges:
            carry = lax.fori_loop(a, bb, masked, carry)
            carry = lax.fori_loop(bb, c, plain, carry)
            return lax.fori_loop(c, d, masked, carry)
        return lax.fori_loop(a, d, plain, carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    if group == 1:
        dk, dv = group_body(0, zeros)
    else:
        dk, dv = lax.fori_loop(0, group, group_body, zeros)
    dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, bias_ref, mask_ref, qlen_ref, kvlen_ref, do_ref, lse_ref,
               delta_ref, dq_ref, dbias_ref, *, spec: KernelSpec, block_q: int, block_k: int,
               num_kb: int) -> None:
    qi, b = pl.program_id(0), pl.program_id(1)
    r0 = qi * block_q
    q_len = qlen_ref[b] if spec.has_q_lengths else spec.seq_q
    kv_len = jnp.minimum(kvlen_ref[b], spec.seq_k) if spec.has_kv_lengths else spec.seq_k
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    rows = r0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)

    def body(kb: Any, dq: Any, *, positional: bool) -> Any:
        c0 = pl.multiple_of(kb * block_k, block_k)
        k = k_ref[pl.ds(c0, block_k), :]
        v = v_ref[pl.ds(c0, block_k), :]
        bias = bias_ref[:, pl.ds(c0, block_k)] if spec.has_bias else None
        s, t = tiles.logits2(spec, spec.dot(q, k.T), bias)
        if positional or spec.has_mask:
            ok = jnp.ones(s.shape, jnp.bool_)
            if positional:
                cols = c0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
                ok = tiles.visible(spec, rows, cols, kv_len)
            if spec.has_mask:
                ok = ok & (mask_ref[:, pl.ds(c0, block_k)] != 0)
            s = jnp.where(ok, s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])
        dp = spec.dot(do, v.T)
        ds = tiles.dlogits(spec, p * (dp - delta[:, None]), t)
        if dbias_ref is not None:
            dbias_ref[:, pl.ds(c0, block_k)] = ds.astype(dbias_ref.dtype)
        return dq + spec.dot(ds.astype(k.dtype), k)

    a, bb, c, d = tiles.kv_block_ranges(spec, r0, block_q, block_k, num_kb, kv_len)
    if spec.has_q_lengths:
        d = jnp.where(r0 < q_len, d, a)
        bb, c = jnp.minimum(bb, d), jnp.minimum(c, d)
    if dbias_ref is not None:
        # Blocks the loops skip get no gradient: zeros, one (block_q, block_k) tile at a
        # time (Triton's arrays are powers of 2 long; the padded key length need not be).
        def zero(kb: Any, carry: None) -> None:
            c0 = pl.multiple_of(kb * block_k, block_k)
            dbias_ref[:, pl.ds(c0, block_k)] = jnp.zeros((block_q, block_k), dbias_ref.dtype)
            return carry

        lax.fori_loop(0, a, zero, None)
        lax.fori_loop(d, num_kb, zero, None)
    dq = jnp.zeros(q.shape, jnp.float32)
    needs_edges = spec.positional or spec.has_kv_lengths or spec.seq_k % block_k
    masked = functools.partial(body, positional=True)
    plain = functools.partial(body, positional=False)
    if needs_edges:
        dq = lax.fori_loop(a, bb, masked, dq)
        dq = lax.fori_loop(bb, c, plain, dq)
        dq = lax.fori_loop(c, d, masked, dq)
    else:
        dq = lax.fori_loop(0, num_kb, plain, dq)
    dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)


def flash_attention_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, mask: jax.Array | None,
    q_lengths: jax.Array | None, kv_lengths: jax.Array | None, dout: jax.Array,
    lse2: jax.Array, delta: jax.Array, *, spec: KernelSpec, blocks_dkv: tuple[int, int],
    blocks_dq: tuple[int, int], params_dkv: tuple[int, int], params_dq: tuple[int, int],
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`(dq, dk, dv, dbias)` for padded inputs (shapes as in `flash_attention_forward`;
    `dout` has v's head dim).

    `lse2` is the base-2 logsumexp `(B, H, Sq_pad)` with `+inf` on rows that saw nothing,
    `delta = rowsum(out * dout)` `(B, H, Sq_pad)` float32. `dbias` is float32
    `(B, H, Sq_pad, Sk_pad)` (summed over broadcast axes by the caller).
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    common_operands = [q, k, v, bias, mask, q_lengths, kv_lengths, dout, lse2, delta]

    # dK / dV: one program per (key block, batch, kv head); the GQA group is looped inside.
    bq, bk = blocks_dkv

    def extra_spec_dkv(x: jax.Array | None) -> pl.BlockSpec | None:
        if x is None:
            return None
        bb, hb = x.shape[0], x.shape[1]
        return pl.BlockSpec(
            (None, group if hb > 1 else 1, seq_q, bk),
            lambda j, b, h: (b if bb > 1 else 0, h if hb > 1 else 0, 0, j))

    def lengths_spec(x: jax.Array | None) -> pl.BlockSpec | None:
        return None if x is None else pl.BlockSpec((batch,), lambda *_: (0,))

    k_tile = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    v_tile = pl.BlockSpec((None, bk, None, value_dim), lambda j, b, h: (b, j, h, 0))
    q_group = pl.BlockSpec((None, seq_q, group, head_dim), lambda j, b, h: (b, 0, h, 0))
    do_group = pl.BlockSpec((None, seq_q, group, value_dim), lambda j, b, h: (b, 0, h, 0))
    row_group = pl.BlockSpec((None, group, seq_q), lambda j, b, h: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, spec=spec, block_q=bq, block_k=bk, num_qb=seq_q // bq,
                          group=group, bias_heads=1 if bias is None else bias.shape[1],
                          mask_heads=1 if mask is None else mask.shape[1]),
        grid=(seq_k // bk, batch, kv_heads),
        in_specs=[q_group, k_tile, v_tile, extra_spec_dkv(bias), extra_spec_dkv(mask),
                  lengths_spec(q_lengths), lengths_spec(kv_lengths), do_group, row_group,
                  row_group],
        out_specs=[k_tile, v_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=params_dkv[0], num_stages=params_dkv[1]),
        interpret=interpret,
        name="tokamax_pass_flash_attention_dkdv",
    )(*common_operands)

    # dQ (and dBias): one program per (query block, batch, q head).
    bq, bk = blocks_dq

    def extra_spec_dq(x: jax.Array | None) -> pl.BlockSpec | None:
        if x is None:
            return None
        bb, hb = x.shape[0], x.shape[1]
        return pl.BlockSpec((None, None, bq, seq_k),
                            lambda i, b, h: (b if bb > 1 else 0, h if hb > 1 else 0, i, 0))

    q_tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    do_tile = pl.BlockSpec((None, bq, None, value_dim), lambda i, b, h: (b, i, h, 0))
    k_full = pl.BlockSpec((None, seq_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    v_full = pl.BlockSpec((None, seq_k, None, value_dim), lambda i, b, h: (b, 0, h // group, 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    out_specs = [q_tile]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if bias is not None:
        out_specs.append(pl.BlockSpec((None, None, bq, seq_k), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, seq_q, seq_k), jnp.float32))
    kernel = functools.partial(_dq_kernel, spec=spec, block_q=bq, block_k=bk,
                               num_kb=seq_k // bk)
    if bias is None:
        kernel = _with_none_last(kernel)
    outs = pl.pallas_call(
        kernel,
        grid=(seq_q // bq, batch, heads),
        in_specs=[q_tile, k_full, v_full, extra_spec_dq(bias), extra_spec_dq(mask),
                  lengths_spec(q_lengths), lengths_spec(kv_lengths), do_tile, row_tile,
                  row_tile],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=params_dq[0], num_stages=params_dq[1]),
        interpret=interpret,
        name="tokamax_pass_flash_attention_dq",
    )(*common_operands)
    return outs[0], dk, dv, (outs[1] if bias is not None else None)


def _with_none_last(kernel: Any) -> Any:
    def wrapped(*refs: Any) -> None:
        kernel(*refs, None)

    return wrapped
