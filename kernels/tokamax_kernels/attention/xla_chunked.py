"""Memory-efficient attention in plain XLA: online softmax over (q chunk, kv chunk) blocks.

The forward maps over query chunks and scans over key/value chunks with the
running max / sum / accumulator of the online softmax, so the largest temporary
is one (B, H, chunk_q, chunk_k) block: the (Sq, Sk) logits never exist. Shapes
that the chunks do not divide are zero-padded; padded keys are masked out and
padded query rows sliced off.

Its VJP op is chunked too. Autodiff of the forward would save every block's
probabilities for the backward pass (the whole Sq x Sk matrix again), so
`XlaChunkedDotProductAttentionVjp` recomputes each block's probabilities from
the `lse` residual (FlashAttention-2 style) in one scan over kv chunks with an
inner scan over q chunks, accumulating dq (and a float bias's gradient) in place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, overload

import jax
import jax.numpy as jnp

from tokamax_kernels.attention.base import (
    DotProductAttention,
    DotProductAttentionVjp,
    compute_dtype,
    keep_mask,
    split_heads,
)
from tokamax_pass.core import BoundArguments, NullConfig, Op


@dataclasses.dataclass(frozen=True)
class XlaChunkedConfig:
    """Query rows and key/value rows per block (any positive sizes; shapes are padded, and
    a chunk past a sequence's next power of 2 counts as that power)."""

    chunk_q: int
    chunk_k: int

    def __post_init__(self) -> None:
        for name in ("chunk_q", "chunk_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"XlaChunkedConfig: {name} must be a positive int, got {value!r}")


_MAX_BLOCK_ELEMENTS = 1 << 27  # one f32 logits block of B*H*chunk_q*chunk_k: 512 MiB
_CHUNKS = (64, 128, 256, 512, 1024)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def largest_blocks(batch: int, heads: int, q_len: int, kv_len: int) -> list[XlaChunkedConfig]:
    """The chunk pairs of the largest block within the memory cap (the smallest pair when
    none fits). Fewer, larger blocks always ran faster on the H200: at the seed's
    b32 h16 s2048 every halving of the block slowed the forward and the backward, so
    this is the whole search space: which side of the block is long is all there is to
    tune."""
    q_chunks = sorted({min(c, _next_pow2(q_len)) for c in _CHUNKS})
    k_chunks = sorted({min(c, _next_pow2(kv_len)) for c in _CHUNKS})
    pairs = [(cq, ck) for cq in q_chunks for ck in k_chunks
             if batch * heads * cq * ck <= _MAX_BLOCK_ELEMENTS] or [(q_chunks[0], k_chunks[0])]
    largest = max(cq * ck for cq, ck in pairs)
    return [XlaChunkedConfig(cq, ck) for cq, ck in pairs if cq * ck == largest]


def heuristic_config(batch: int, heads: int, q_len: int, kv_len: int, *,
                     long_side: str = "chunk_k") -> XlaChunkedConfig:
    """The largest block, longest along the inner loop's chunk (`long_side`): the forward
    scans key/value chunks (`chunk_k`), the backward query chunks (`chunk_q`), and each
    scan step costs a rescale and a loop iteration."""
    return max(largest_blocks(batch, heads, q_len, kv_len), key=lambda c: getattr(c, long_side))


@overload
def _pad_axis(x: jax.Array, axis: int, size: int, *, broadcast: bool = True) -> jax.Array: ...
@overload
def _pad_axis(x: None, axis: int, size: int, *, broadcast: bool = True) -> None: ...
@overload
def _pad_axis(x: jax.Array | None, axis: int, size: int, *,
              broadcast: bool = True) -> jax.Array | None: ...
def _pad_axis(x: jax.Array | None, axis: int, size: int, *,
              broadcast: bool = True) -> jax.Array | None:
    """Zero (False) padding of `axis` to `size`; with `broadcast`, size-1 axes (a bias's or
    mask's broadcast axes) stay. A sequence of length 1 is no broadcast axis: operands of
    one query row or one key pass `broadcast=False`."""
    if x is None or x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


@overload
def _slice_qk(x: jax.Array, q_start: Any, q_size: int, k_start: Any,
              k_size: int) -> jax.Array: ...
@overload
def _slice_qk(x: jax.Array | None, q_start: Any, q_size: int, k_start: Any,
              k_size: int) -> jax.Array | None: ...
def _slice_qk(x: jax.Array | None, q_start: Any, q_size: int, k_start: Any,
              k_size: int) -> jax.Array | None:
    """The (B|1, H|1, q, k) block of a broadcastable bias or mask."""
    if x is None:
        return None
    if x.shape[2] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, q_start, q_size, axis=2)
    if x.shape[3] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, k_start, k_size, axis=3)
    return x


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Padded operands and static options shared by the forward and backward passes."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_lengths: jax.Array | None
    kv_lengths: jax.Array | None
    statics: dict[str, Any]
    chunk_q: int
    chunk_k: int
    q_len: int
    kv_len: int

    @property
    def kv_heads(self) -> int:
        return self.key.shape[2]

    @property
    def dtype(self) -> Any:
        return compute_dtype(self.query.dtype)

    def blocks_of(self, x: jax.Array, chunk: int) -> jax.Array:
        """(B, n*chunk, ...) -> (n, B, chunk, ...) for scanning."""
        return jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)

    def logits(self, iq: Any, ik: Any, q_blk: jax.Array, k_blk: jax.Array
               ) -> tuple[jax.Array, jax.Array | None]:
        """Soft-capped logits (B, Hkv, G, cq, ck) of one block, unmasked, and its `keep`."""
        cq, ck, s = self.chunk_q, self.chunk_k, self.statics
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_blk, k_blk, precision=s["precision"],
                            preferred_element_type=self.dtype) * s["scale"]
        bias = _slice_qk(self.bias, iq * cq, cq, ik * ck, ck)
        if bias is not None:
            logits = logits + split_heads(bias, self.kv_heads).astype(self.dtype)
        if s["logits_soft_cap"] is not None:
            logits = s["logits_soft_cap"] * jnp.tanh(logits / s["logits_soft_cap"])
        keep = keep_mask(
            iq * cq + jnp.arange(cq), ik * ck + jnp.arange(ck),
            mask=_slice_qk(self.mask, iq * cq, cq, ik * ck, ck), is_causal=s["is_causal"],
            local_window_size=s["local_window_size"], query_seq_lengths=self.q_lengths,
            key_value_seq_lengths=self.kv_lengths)
        return logits, None if keep is None else split_heads(keep, self.kv_heads)


def _problem(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, query_seq_lengths: jax.Array | None,
             key_value_seq_lengths: jax.Array | None, config: XlaChunkedConfig,
             statics: dict[str, Any]) -> _Problem:
    batch, q_len, heads, _ = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    # A chunk past the sequence's next power of 2 is one block either way: clamped, a
    # pinned or cached chunk of 2**20 at 24 rows pads to 32 rows, not to 2**20 (a logits
    # block of terabytes).
    chunk_q, chunk_k = min(config.chunk_q, _next_pow2(q_len)), min(config.chunk_k,
                                                                  _next_pow2(kv_len))
    q_pad = math.ceil(q_len / chunk_q) * chunk_q
    k_pad = math.ceil(kv_len / chunk_k) * chunk_k
    kv_lengths = key_value_seq_lengths
    if k_pad != kv_len:  # padded keys must never be attended to
        full = jnp.full((batch,), kv_len, jnp.int32)
        kv_lengths = full if kv_lengths is None else jnp.minimum(kv_lengths, full)
    q_lengths = query_seq_lengths
    if q_pad != q_len:  # padded query rows attend to nothing (zero probabilities)
        full = jnp.full((batch,), q_len, jnp.int32)
        q_lengths = full if q_lengths is None else jnp.minimum(q_lengths, full)
    query = _pad_axis(query, 1, q_pad, broadcast=False).reshape(
        batch, q_pad, kv_heads, heads // kv_heads, -1)
    return _Problem(
        query=query, key=_pad_axis(key, 1, k_pad, broadcast=False),
        value=_pad_axis(value, 1, k_pad, broadcast=False),
        bias=_pad_axis(_pad_axis(bias, 2, q_pad), 3, k_pad),
        mask=_pad_axis(_pad_axis(mask, 2, q_pad), 3, k_pad),
        q_lengths=q_lengths, kv_lengths=kv_lengths, statics=statics,
        chunk_q=chunk_q, chunk_k=chunk_k, q_len=q_len, kv_len=kv_len)


def problem_for(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                mask: jax.Array | None, *, query_seq_lengths: jax.Array | None,
                key_value_seq_lengths: jax.Array | None, **statics: Any) -> _Problem:
    """The chunked problem with the heuristic chunks (for other implementations' lse)."""
    config = heuristic_config(query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    return _problem(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                    config, statics)


def chunked_forward(pb: _Problem) -> tuple[jax.Array, jax.Array]:
    """`(out (B, Sq, H, D) in the input dtype, lse (B, H, Sq) float32)`."""
    batch, q_pad, kv_heads, groups, _ = pb.query.shape
    value_dim = pb.value.shape[3]  # may differ from the query's head dim (MLA)
    k_blocks = pb.blocks_of(pb.key, pb.chunk_k)
    v_blocks = pb.blocks_of(pb.value, pb.chunk_k)
    stat_shape = (batch, kv_heads, groups, pb.chunk_q)

    def q_chunk(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        iq, q_blk = xs

        def kv_chunk(carry: Any, xs: Any) -> tuple[Any, None]:
            row_max, row_sum, acc = carry
            ik, k_blk, v_blk = xs
            logits, keep = pb.logits(iq, ik, q_blk, k_blk)
            if keep is not None:
                logits = jnp.where(keep, logits, -jnp.inf)
            new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
            safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            alpha = jnp.exp(row_max - safe_max)
            probs = jnp.exp(logits - safe_max[..., None])
            row_sum = alpha * row_sum + jnp.sum(probs, axis=-1)
            acc = alpha[..., None] * acc + jnp.einsum(
                "bhgqk,bkhd->bhgqd", probs.astype(v_blk.dtype), v_blk,
                precision=pb.statics["precision"], preferred_element_type=pb.dtype)
            return (new_max, row_sum, acc), None

        init = (jnp.full(stat_shape, -jnp.inf, pb.dtype), jnp.zeros(stat_shape, pb.dtype),
                jnp.zeros((*stat_shape, value_dim), pb.dtype))
        n_k = k_blocks.shape[0]
        (row_max, row_sum, acc), _ = jax.lax.scan(
            kv_chunk, init, (jnp.arange(n_k), k_blocks, v_blocks))
        nonempty = row_sum > 0
        safe_sum = jnp.where(nonempty, row_sum, 1.0)
        out = acc / safe_sum[..., None]
        lse = jnp.where(nonempty, row_max + jnp.log(safe_sum), -jnp.inf)
        return out, lse

    q_blocks = pb.blocks_of(pb.query, pb.chunk_q)
    out, lse = jax.lax.map(q_chunk, (jnp.arange(q_blocks.shape[0]), q_blocks))
    # out: (nq, B, Hkv, G, cq, D) -> (B, nq, cq, Hkv, G, D); lse: (nq, B, Hkv, G, cq).
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(batch, q_pad, -1, value_dim)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(batch, kv_heads * groups, q_pad)
    return out[:, :pb.q_len].astype(pb.key.dtype), lse[..., :pb.q_len].astype(jnp.float32)


def _add_block(acc: jax.Array, block: jax.Array, q_start: Any, k_start: Any) -> jax.Array:
    """Adds a (B, H, cq, ck) gradient block into a broadcast-shaped accumulator."""
    axes = tuple(i for i in range(4) if acc.shape[i] == 1 and block.shape[i] != 1)
    block = jnp.sum(block, axis=axes, keepdims=True)
    starts = (0, 0, q_start if acc.shape[2] != 1 else 0, k_start if acc.shape[3] != 1 else 0)
    current = jax.lax.dynamic_slice(acc, starts, block.shape)
    return jax.lax.dynamic_update_slice(acc, current + block, starts)


def chunked_backward(pb: _Problem, lse: jax.Array, out: jax.Array, dout: jax.Array,
                     dlse: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`(dq, dk, dv, dbias)` from the lse residual; no (Sq, Sk) temporary. `dlse` (B, H, Sq),
    the cotangent of lse as an output, enters as `delta - dlse` (see `base`)."""
    batch, q_pad, kv_heads, groups, head_dim = pb.query.shape
    value_dim = pb.value.shape[3]
    cq, ck, s = pb.chunk_q, pb.chunk_k, pb.statics
    if pb.bias is None:
        delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
    else:  # the bias gradient takes the row term's error whole: its exact value, below
        delta = jnp.zeros(out.shape[:-1], jnp.float32)  # (B, Sq, H)
    if dlse is not None:
        delta = delta - jnp.swapaxes(dlse, 1, 2).astype(jnp.float32)
    delta = _pad_axis(delta, 1, q_pad, broadcast=False).reshape(batch, q_pad, kv_heads, groups)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # fully masked rows: probabilities are 0
    lse = _pad_axis(lse, 2, q_pad, broadcast=False).reshape(batch, kv_heads, groups, -1, cq)
    dout = _pad_axis(dout, 1, q_pad, broadcast=False).reshape(*pb.query.shape[:4], value_dim)
    q_blocks, do_blocks = pb.blocks_of(pb.query, cq), pb.blocks_of(dout, cq)
    lse_blocks = jnp.moveaxis(lse, 3, 0)  # (nq, B, Hkv, G, cq)
    delta_blocks = jnp.transpose(
        delta.reshape(batch, -1, cq, kv_heads, groups), (1, 0, 3, 4, 2))  # (nq, B, Hkv, G, cq)
    n_q = q_blocks.shape[0]
    dbias0 = None if pb.bias is None else jnp.zeros(pb.bias.shape, jnp.float32)
    mm = dict(precision=s["precision"], preferred_element_type=pb.dtype)
    k_blocks, v_blocks = pb.blocks_of(pb.key, ck), pb.blocks_of(pb.value, ck)
    if pb.bias is not None:
        delta_blocks = delta_blocks + _delta_blocks(pb, q_blocks, do_blocks, lse_blocks,
                                                       k_blocks, v_blocks)

    def kv_chunk(carry: Any, xs: Any) -> tuple[Any, Any]:
        dq_acc, dbias_acc = carry
        ik, k_blk, v_blk = xs

        def q_chunk(carry: Any, xs: Any) -> tuple[Any, None]:
            dk, dv, dq_acc, dbias_acc = carry
            iq, q_blk, do_blk, lse_blk, delta_blk = xs
            logits, keep = pb.logits(iq, ik, q_blk, k_blk)
            probs = jnp.exp(logits - lse_blk[..., None])
            if keep is not None:
                probs = jnp.where(keep, probs, 0.0)
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", probs.astype(do_blk.dtype), do_blk, **mm)
            dprobs = jnp.einsum("bqhgd,bkhd->bhgqk", do_blk, v_blk, **mm)
            dlogits = probs * (dprobs - delta_blk[..., None])
            if s["logits_soft_cap"] is not None:
                dlogits = dlogits * (1.0 - jnp.square(logits / s["logits_soft_cap"]))
            if dbias_acc is not None:
                block = dlogits.reshape(batch, kv_heads * groups, cq, ck).astype(jnp.float32)
                dbias_acc = _add_block(dbias_acc, block, iq * cq, ik * ck)
            dlogits = (dlogits * s["scale"]).astype(q_blk.dtype)
            dq = jnp.einsum("bhgqk,bkhd->bqhgd", dlogits, k_blk, **mm)
            dq_acc = dq_acc.at[iq].add(dq.astype(jnp.float32))
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", dlogits, q_blk, **mm)
            return (dk, dv, dq_acc, dbias_acc), None

        dk0 = jnp.zeros((batch, ck, kv_heads, head_dim), pb.dtype)
        dv0 = jnp.zeros((batch, ck, kv_heads, value_dim), pb.dtype)
        (dk, dv, dq_acc, dbias_acc), _ = jax.lax.scan(
            q_chunk, (dk0, dv0, dq_acc, dbias_acc),
            (jnp.arange(n_q), q_blocks, do_blocks, lse_blocks, delta_blocks))
        return (dq_acc, dbias_acc), (dk, dv)

    dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
    (dq, dbias), (dk, dv) = jax.lax.scan(
        kv_chunk, (dq0, dbias0), (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks))
    q_len, kv_len = pb.q_len, pb.kv_len
    dq = jnp.moveaxis(dq, 0, 1).reshape(batch, q_pad, kv_heads * groups, head_dim)[:, :q_len]
    dk = jnp.moveaxis(dk, 0, 1).reshape(batch, -1, kv_heads, head_dim)[:, :kv_len]
    dv = jnp.moveaxis(dv, 0, 1).reshape(batch, -1, kv_heads, value_dim)[:, :kv_len]
    if dbias is not None:
        dbias = dbias[:, :, :q_len if dbias.shape[2] != 1 else 1,
                      :kv_len if dbias.shape[3] != 1 else 1]
    return dq, dk, dv, dbias


def _delta_blocks(pb: _Problem, q_blocks: jax.Array, do_blocks: jax.Array,
                     lse_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array
                     ) -> jax.Array:
    """`rowsum(P * dP)` (nq, B, Hkv, G, cq) in float32, block by block: the softmax row term
    from the probabilities, as autodiff takes it. `out . dout` gives it from the output
    rounded to its dtype (bf16), off by up to 0.03 at JAX's bias-gradient cases, which
    the bias gradient takes whole; this pass recomputes the logits once more instead."""
    mm = dict(precision=pb.statics["precision"], preferred_element_type=pb.dtype)
    n_q = q_blocks.shape[0]

    def kv_chunk(acc: jax.Array, xs: Any) -> tuple[jax.Array, None]:
        ik, k_blk, v_blk = xs

        def q_chunk(_: None, xs: Any) -> tuple[None, jax.Array]:
            iq, q_blk, do_blk, lse_blk = xs
            logits, keep = pb.logits(iq, ik, q_blk, k_blk)
            probs = jnp.exp(logits - lse_blk[..., None])
            if keep is not None:
                probs = jnp.where(keep, probs, 0.0)
            dprobs = jnp.einsum("bqhgd,bkhd->bhgqk", do_blk, v_blk, **mm)
            return None, jnp.sum((probs * dprobs).astype(jnp.float32), axis=-1)

        _, rows = jax.lax.scan(q_chunk, None, (jnp.arange(n_q), q_blocks, do_blocks, lse_blocks))
        return acc + rows, None

    acc = jnp.zeros(lse_blocks.shape, jnp.float32)
    acc, _ = jax.lax.scan(kv_chunk, acc, (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks))
    return acc


def exact_delta(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                   mask: jax.Array | None, lse: jax.Array, dout: jax.Array,
                   dlse: jax.Array | None = None, **statics: Any) -> jax.Array:
    """`delta (B, H, Sq) = rowsum(P * dP) - dlse` in float32 from the lse residual, for
    another implementation's backward (`_delta_blocks`: the row term of a biased call,
    whose bias gradient takes the error of `out . dout` whole)."""
    pb = problem_for(query, key, value, bias, mask, **statics)
    batch, q_pad, kv_heads, groups, _ = pb.query.shape
    cq, ck = pb.chunk_q, pb.chunk_k
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    lse = _pad_axis(lse, 2, q_pad, broadcast=False).reshape(batch, kv_heads, groups, -1, cq)
    dout = _pad_axis(dout, 1, q_pad, broadcast=False).reshape(
        *pb.query.shape[:4], pb.value.shape[3])
    rows = _delta_blocks(pb, pb.blocks_of(pb.query, cq), pb.blocks_of(dout, cq),
                            jnp.moveaxis(lse, 3, 0), pb.blocks_of(pb.key, ck),
                            pb.blocks_of(pb.value, ck))
    delta = jnp.moveaxis(rows, 0, 3).reshape(batch, kv_heads * groups, q_pad)[:, :, :pb.q_len]
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def _empty(query: jax.Array, key: jax.Array) -> bool:
    """No batch, query rows or keys: no chunk to loop over (the reference computes it)."""
    return 0 in (query.shape[0], query.shape[1], key.shape[1])


def _sizes(ba: BoundArguments) -> tuple[int, int, int, int]:
    """(batch, heads, q_len, kv_len) of a bound call."""
    batch, q_len, heads, _ = ba.arguments["query"].shape
    return batch, heads, q_len, ba.arguments["key"].shape[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedDotProductAttention(DotProductAttention):
    """Online-softmax attention in XLA loops; peak memory O(B*H*chunk_q*chunk_k)."""

    config_cls = XlaChunkedConfig
    implementation = "xla_chunked"

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, *, query_seq_lengths: jax.Array | None,
             key_value_seq_lengths: jax.Array | None, config: XlaChunkedConfig,
             return_residuals: bool, **statics: Any) -> tuple[jax.Array, Any]:
        if _empty(query, key):
            return DotProductAttention._fwd(
                self, query, key, value, bias, mask, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths, config=NullConfig(),
                return_residuals=return_residuals, **statics)
        pb = _problem(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                      config, statics)
        out, lse = chunked_forward(pb)
        return out, (lse,) if return_residuals else None

    def _get_heuristics_config(self, ba: BoundArguments) -> XlaChunkedConfig:
        return heuristic_config(*_sizes(ba), long_side="chunk_k")

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[XlaChunkedConfig]:
        return set(largest_blocks(*_sizes(ba)))

    def _default_vjp(self) -> Op:
        return XlaChunkedDotProductAttentionVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaChunkedDotProductAttentionVjp(DotProductAttentionVjp):
    """Chunked backward from the family's `(lse,)` residual (pairs with any forward)."""

    config_cls = XlaChunkedConfig
    implementation = "xla_chunked"

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: XlaChunkedConfig,
             return_residuals: bool, query: jax.Array, key: jax.Array, value: jax.Array,
             bias: jax.Array | None, mask: jax.Array | None,
             query_seq_lengths: jax.Array | None = None,
             key_value_seq_lengths: jax.Array | None = None,
             dresiduals: Any = None, **statics: Any) -> tuple[dict[str, Any], None]:
        if _empty(query, key):
            return DotProductAttentionVjp._fwd(
                self, residuals, out, dout, config=NullConfig(),
                return_residuals=return_residuals, query=query, key=key, value=value,
                bias=bias, mask=mask, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths, dresiduals=dresiduals,
                **statics)
        (lse,) = residuals
        pb = _problem(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                      config, statics)
        dlse = None if dresiduals is None else dresiduals[0]
        dq, dk, dv, dbias = chunked_backward(pb, lse, out, dout, dlse)
        return {"query": dq, "key": dk, "value": dv, "bias": dbias}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> XlaChunkedConfig:
        return heuristic_config(*_sizes(ba), long_side="chunk_q")

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[XlaChunkedConfig]:
        return set(largest_blocks(*_sizes(ba)))
