"""The dot-product-attention family: argument checks, the XLA reference and its VJP op.

Layout is `(batch, seq, heads, head_dim)` for query, key and value. Key and value
may have fewer heads than the query (GQA/MQA: query head `h` uses kv head
`h // (heads_q // heads_kv)`) and a different sequence length (cross attention).

Semantics every implementation follows:
  logits = scale * (q . k) [+ bias]                         (float32)
  logits = cap * tanh(logits / cap)        if logits_soft_cap is set
  logits = where(keep, logits, -inf)
  out    = softmax(logits) @ v
`keep` is one boolean of shape (B, H, Sq, Sk), the AND of:
  * `mask` (True = attend), broadcast to (B, H, Sq, Sk);
  * `is_causal`: key position <= query position (top-left aligned, as `jax.nn`);
  * `local_window_size=(left, right)`: query i sees keys i-left .. i+right;
  * `query_seq_lengths[b]`: query rows at positions >= it see nothing;
  * `key_value_seq_lengths[b]`: keys at positions >= it are never seen.
A fully masked query row (nothing to attend to) returns ZEROS, in every
implementation, and gets zero gradients. Empty sequences follow: no query rows give
an empty output, no keys give zeros. The XLA implementations compute them; kernels
raise `NotImplementedError` (nothing to launch), so `None` moves on to `xla`.

Residual contract (all implementations of the family): `residuals = (lse,)`, `lse`
float32 of shape (B, H, Sq), the logsumexp over keys of the final (scaled,
biased, soft-capped, masked) logits; `-inf` for a fully masked row. A backward
pass must not rely on the lse of fully masked rows (apply `keep` to the
probabilities), so any forward's residuals work with any backward.

Gradient through lse (`dot_product_attention(..., return_residual=True)`): every VJP
op of the family takes the lse cotangent `dresiduals = (dlse,)`, shape (B, H, Sq). As
d lse / d logits = softmax probabilities, the flash backward's
`dlogits = P * (dP - delta)`, `delta = rowsum(dout * out)`, just uses
`delta - dlse`; a fully masked row still gets zero gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_kernels import _validation as v
from tokamax_pass.core import BoundArguments, NullConfig, Op, SizeLike, VjpOp

_OP = "dot_product_attention"
_INT32_MAX = int(np.iinfo(np.int32).max)


def _canonical_precision(precision: Any) -> jax.lax.Precision | None:
    if precision is None or isinstance(precision, jax.lax.Precision):
        return precision
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        first, second = (_canonical_precision(p) for p in precision)
        if first == second:
            return first
        raise ValueError(f"{_OP}: precision pairs must be equal, got {precision!r}")
    try:
        return jax.lax.Precision(precision)
    except (ValueError, TypeError):
        raise ValueError(
            f"{_OP}: precision must be None, a jax.lax.Precision or one of "
            f"'default', 'high', 'highest'; got {precision!r}"
        ) from None


def _canonical_window(window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    pair = (window, window) if isinstance(window, int) else window
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in pair)):
        raise ValueError(
            f"{_OP}: local_window_size must be an int >= 0 or a pair (left, right) of them, "
            f"got {window!r}"
        )
    if max(pair) > _INT32_MAX:  # positions are int32: JAX raised an OverflowError
        raise ValueError(
            f"{_OP}: local_window_size must be at most {_INT32_MAX} (positions are int32), "
            f"got {window!r}; a window longer than the sequence is no window: pass None")
    return int(pair[0]), int(pair[1])


def _check_broadcastable(name: str, value: Any, full: tuple[int, ...]) -> None:
    v.require_array(name, value, op=_OP)
    ok = value.ndim == 4 and all(d in (1, f) for d, f in zip(value.shape, full, strict=True))
    if not ok:
        raise ValueError(
            f"{_OP}: {name} must have rank 4 and broadcast to (batch, heads, q_seq, kv_seq) = "
            f"{full} (each dim 1 or full), got shape {tuple(value.shape)}"
        )


def _check_seq_lengths(name: str, value: Any, batch: int) -> None:
    if value is None:
        return
    v.require_array(name, value, op=_OP)
    if not jnp.issubdtype(value.dtype, jnp.integer) or tuple(value.shape) != (batch,):
        raise ValueError(
            f"{_OP}: {name} must be an integer array of shape (batch,) = ({batch},), "
            f"got {value.dtype}{list(value.shape)}"
        )
    if isinstance(value, (jax.core.Tracer, jax.ShapeDtypeStruct)) or not batch or (
            isinstance(value, jax.Array) and not value.is_fully_addressable):
        return
    # Known now: a negative length silently hid every row or key (zeros out), and a
    # length past int32 wrapped when JAX took a NumPy int64 array as int32.
    lengths = np.asarray(value)
    if lengths.min() < 0 or lengths.max() > _INT32_MAX:
        raise ValueError(
            f"{_OP}: {name} must be >= 0 (and fit int32), got {lengths.tolist()}; a length "
            f"of 0 attends to nothing, a length past the sequence to all of it")


# The implementations that compute empty sequences (XLA; kernels have no grid to launch).
_EMPTY_SEQUENCE_IMPLEMENTATIONS = ("xla", "xla_chunked")


def check_nonempty_sequences(op: Op, ba: BoundArguments) -> None:
    """`NotImplementedError` for a kernel asked to attend over an empty batch or sequence
    (a grid with no blocks: Pallas divides by its size when lowering)."""
    batch, q_len = ba.arguments["query"].shape[:2]
    kv_len = ba.arguments["key"].shape[1]
    if 0 in (batch, q_len, kv_len) and op.implementation not in _EMPTY_SEQUENCE_IMPLEMENTATIONS:
        raise NotImplementedError(
            f"{type(op).__name__}: an empty sequence or batch (batch={batch}, q_seq={q_len}, "
            f"kv_seq={kv_len}) has nothing to launch; implementation='xla' (or None) "
            f"computes it")


def keep_mask(q_pos: jax.Array, k_pos: jax.Array, *, mask: jax.Array | None, is_causal: bool,
              local_window_size: tuple[int, int] | None, query_seq_lengths: jax.Array | None,
              key_value_seq_lengths: jax.Array | None) -> jax.Array | None:
    """The combined `keep` boolean for query positions `q_pos` x key positions `k_pos`.

    `q_pos`/`k_pos` are int vectors; `mask` is already the matching (B|1, H|1, q, k)
    block. Returns a (B|1, H|1, q, k) boolean, or `None` when nothing is masked.
    """
    qp, kp = q_pos[:, None], k_pos[None, :]
    keep = None

    def both(a: jax.Array | None, b: jax.Array) -> jax.Array:
        return b if a is None else jnp.logical_and(a, b)

    if mask is not None:
        keep = mask
    if is_causal:
        keep = both(keep, (kp <= qp)[None, None])
    if local_window_size is not None:
        left, right = local_window_size
        keep = both(keep, ((kp >= qp - left) & (kp <= qp + right))[None, None])
    if query_seq_lengths is not None:
        keep = both(keep, (qp[None] < query_seq_lengths[:, None, None])[:, None])
    if key_value_seq_lengths is not None:
        keep = both(keep, (kp[None] < key_value_seq_lengths[:, None, None])[:, None])
    return keep


@overload
def split_heads(x: jax.Array, num_kv_heads: int) -> jax.Array: ...
@overload
def split_heads(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None: ...
def split_heads(x: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """(B, H|1, ...) -> (B, Hkv|1, G|1, ...): query heads grouped by their kv head."""
    if x is None:
        return None
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], num_kv_heads, x.shape[1] // num_kv_heads, *x.shape[2:])


def grouped_logits(query: jax.Array, key: jax.Array, bias: jax.Array | None,
                   mask: jax.Array | None, *, scale: float, is_causal: bool,
                   query_seq_lengths: jax.Array | None, key_value_seq_lengths: jax.Array | None,
                   local_window_size: tuple[int, int] | None, logits_soft_cap: float | None,
                   precision: jax.lax.Precision | None) -> tuple[jax.Array, jax.Array | None]:
    """The scaled, biased, soft-capped logits (B, Hkv, G, Sq, Sk) in the compute dtype, query
    heads grouped by their kv head, and `keep` in the same grouping (`None`: unmasked).
    The mask is not applied: a backward needs the capped logits where `keep` holds."""
    batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    dtype = compute_dtype(query.dtype)
    q = query.reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, precision=precision,
                        preferred_element_type=dtype) * scale
    if bias is not None:
        logits = logits + split_heads(bias, kv_heads).astype(dtype)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    keep = keep_mask(
        jnp.arange(q_len), jnp.arange(kv_len), mask=mask,
        is_causal=is_causal, local_window_size=local_window_size,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
    return logits, split_heads(keep, kv_heads)


def compute_dtype(dtype: Any) -> Any:
    """float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


# Implementations that take a value head dim other than the query's (MLA); the others
# tile one head dim for query, key and value.
ANY_VALUE_HEAD_DIM = frozenset({"xla", "xla_chunked", "triton"})


def check_value_head_dim(op: Op, ba: BoundArguments) -> None:
    """`NotImplementedError` where the value head dim differs from the query's and `op` is
    not among `ANY_VALUE_HEAD_DIM`, so a sequence of implementations or `None` moves on."""
    query, value = ba.arguments["query"], ba.arguments["value"]
    if value.shape[3] != query.shape[3] and op.implementation not in ANY_VALUE_HEAD_DIM:
        raise NotImplementedError(
            f"{type(op).__name__}: value head_dim {value.shape[3]} differs from the query's "
            f"{query.shape[3]}; implementations {sorted(ANY_VALUE_HEAD_DIM)} take it")


def yields_to_cudnn(other: BoundArguments) -> bool:
    """Whether `other` is cuDNN's attention (forward or gradient) at a call where it is
    not among the tiny ones XLA wins (`Op.unmeasured_plain_path_loses`)."""
    return other.op.implementation == "cudnn" and not other.op.unmeasured_plain_path_loses(other)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotProductAttention(Op[Any]):
    """Multi-head dot-product attention; this class is the XLA reference.

    It materializes the (B, H, Sq, Sk) logits in float32 (float64 for float64
    inputs); see the module docstring for the semantics and the residual contract.
    """

    def partition_rule(self, ba: BoundArguments) -> Any:
        """How a call splits over devices (`tokamax_pass.core.sharding`)."""
        from tokamax_kernels.attention.sharding import partition_rule

        return partition_rule(ba)

    def check_supported(self, ba: BoundArguments, target: Any) -> None:
        super().check_supported(ba, target)
        check_nonempty_sequences(self, ba)
        check_value_head_dim(self, ba)

    def yields_unmeasured_to(self, ba: BoundArguments, other: BoundArguments) -> bool:
        """XLA's attention yields to cuDNN's wherever cuDNN runs a call and is not one of
        the tiny calls it loses: `benchmarks/probes/cudnn_vs_xla_attention_sweep.py`, 60 shapes
        (batch 1-8, sequence 128-2048, GQA, head dims 64-256) causal and not, forward
        and forward+backward, has cuDNN faster everywhere else."""
        del ba
        return yields_to_cudnn(other)

    def similarity_arguments(self, arguments: Any) -> dict[str, Any]:
        """Batch and heads merged (their split does not matter to a kernel), the head dim
        exact (it does), the scale and soft cap's value dropped. The GQA group and the
        window's reach (a global call reaches the whole key sequence) are sizes
        (`SizeLike`): a Gemma-2 layer at another head split or window length is a
        neighbour of a measured one, as a longer sequence is."""
        query, key = arguments["query"], arguments["key"]
        batch, q_len, heads, head_dim = query.shape
        kv_len, kv_heads = key.shape[1], key.shape[2]
        left, right = arguments["local_window_size"] or (kv_len, kv_len)
        if arguments["is_causal"]:
            right = 0  # the causal mask already stops every query at its own position
        return {
            **arguments,
            "query": jax.ShapeDtypeStruct((batch * heads, q_len), query.dtype),
            "key": jax.ShapeDtypeStruct((kv_len,), key.dtype), "value": None,
            "head_dim": head_dim, "group": SizeLike(heads // kv_heads), "scale": None,
            "logits_soft_cap": arguments["logits_soft_cap"] is not None,
            "local_window_size": tuple(SizeLike(min(w, kv_len) + 1) for w in (left, right)),
        }

    def bind(self, query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
             scale: float | None = None, is_causal: bool = False,
             query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
             local_window_size: int | tuple[int, int] | None = None,
             logits_soft_cap: float | None = None, precision: Any = None) -> BoundArguments:
        for name, x in (("query", query), ("key", key), ("value", value)):
            v.require_rank(name, x, (4,), op=_OP)
            v.require_float(name, x, op=_OP)
        if not query.dtype == key.dtype == value.dtype:
            raise ValueError(f"{_OP}: query, key and value must share a dtype, got "
                             f"{query.dtype}, {key.dtype}, {value.dtype}")
        batch, q_len, heads, head_dim = query.shape
        if not heads or not head_dim or not key.shape[2]:
            raise ValueError(f"{_OP}: query and key need at least one head and a head_dim of "
                             f"at least 1, got query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)} (batch, seq, heads, head_dim)")
        if key.shape[0] != batch:
            raise ValueError(f"{_OP}: key batch {key.shape[0]} != query batch {batch}")
        if key.shape[3] != head_dim:
            raise ValueError(
                f"{_OP}: key head_dim {key.shape[3]} != query head_dim {head_dim}")
        if tuple(value.shape[:3]) != tuple(key.shape[:3]) or not value.shape[3]:
            raise ValueError(
                f"{_OP}: value must have key's batch, sequence and heads {tuple(key.shape[:3])} "
                f"and a head_dim of at least 1, got {tuple(value.shape)}")
        kv_heads = key.shape[2]
        if heads % kv_heads:
            raise ValueError(f"{_OP}: key/value heads ({kv_heads}) must divide query heads "
                             f"({heads}) for GQA/MQA")
        full = (batch, heads, q_len, key.shape[1])
        if bias is not None:
            _check_broadcastable("bias", bias, full)
            v.require_float("bias", bias, op=_OP)
        if mask is not None:
            _check_broadcastable("mask", mask, full)
            if mask.dtype != jnp.bool_:
                raise ValueError(f"{_OP}: mask must be a bool array (True = attend), "
                                 f"got {mask.dtype}")
        _check_seq_lengths("query_seq_lengths", query_seq_lengths, batch)
        _check_seq_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(
                scale):
            raise ValueError(f"{_OP}: scale must be a finite Python number, got {scale!r}")
        if logits_soft_cap is not None:  # an infinite cap would give NaN logits (inf * 0)
            logits_soft_cap = v.static_number("logits_soft_cap", logits_soft_cap, op=_OP,
                                              minimum=0.0, inclusive=False)
        return BoundArguments(self, dict(
            query=query, key=key, value=value, bias=bias, mask=mask, scale=float(scale),
            is_causal=v.require_bool("is_causal", is_causal, op=_OP),
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=_canonical_window(local_window_size),
            logits_soft_cap=logits_soft_cap,
            precision=_canonical_precision(precision),
        ))

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, *, scale: float, is_causal: bool,
             query_seq_lengths: jax.Array | None, key_value_seq_lengths: jax.Array | None,
             local_window_size: tuple[int, int] | None, logits_soft_cap: float | None,
             precision: jax.lax.Precision | None, config: Any,
             return_residuals: bool) -> tuple[jax.Array, Any]:
        batch, q_len, heads, head_dim = query.shape
        dtype = compute_dtype(query.dtype)
        logits, keep = grouped_logits(
            query, key, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
            precision=precision)
        if keep is not None:
            logits = jnp.where(keep, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)  # kv_len may be 0
        row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        probs = jnp.exp(logits - row_max)
        denom = jnp.sum(probs, axis=-1, keepdims=True)
        safe_denom = jnp.where(denom > 0, denom, 1.0)
        probs = probs / safe_denom
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(value.dtype), value,
                         precision=precision, preferred_element_type=dtype)
        out = out.reshape(batch, q_len, heads, value.shape[3]).astype(query.dtype)
        if not return_residuals:
            return out, None
        lse = jnp.where(denom > 0, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]
        return out, (lse.reshape(batch, heads, q_len).astype(jnp.float32),)

    def _default_vjp(self) -> Op:
        return XlaDotProductAttentionVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotProductAttentionVjp(VjpOp):
    """The reference gradient: JAX autodiff of `DotProductAttention._fwd` (materializes SxS).

    Returns gradients for query, key, value and a float bias; mask and sequence
    lengths get none. It ignores the residuals, so it pairs with any forward; a
    `dresiduals = (dlse,)` cotangent is differentiated through the reference's lse.
    """

    forward_family = DotProductAttention
    accepts_residual_cotangents = True

    def check_supported(self, ba: BoundArguments, target: Any) -> None:
        super().check_supported(ba, target)
        check_nonempty_sequences(self, ba)
        check_value_head_dim(self, ba)

    def yields_unmeasured_to(self, ba: BoundArguments, other: BoundArguments) -> bool:
        """As the forward's (`DotProductAttention.yields_unmeasured_to`): the sweep timed
        forward+backward too."""
        del ba
        return yields_to_cudnn(other)

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, dresiduals: Any = None,
             **statics: Any) -> tuple[dict[str, Any], None]:
        del residuals, out, config, return_residuals
        reference = DotProductAttention()
        with_lse = dresiduals is not None

        def forward(query: jax.Array, key: jax.Array, value: jax.Array,
                    bias: jax.Array | None) -> Any:
            out, lse = reference._fwd(query, key, value, bias, mask, **statics,
                                      config=NullConfig(), return_residuals=with_lse)
            return (out, lse) if with_lse else out

        _, pullback = jax.vjp(forward, query, key, value, bias)
        dq, dk, dv, dbias = pullback((dout, dresiduals) if with_lse else dout)
        return {"query": dq, "key": dk, "value": dv, "bias": dbias}, None


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`x` summed over the axes a rank-4 `shape` broadcasts (its size-1 axes)."""
    axes = tuple(i for i, (n, full) in enumerate(zip(shape, x.shape, strict=True))
                 if n == 1 and full != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaDotProductAttentionVjp(DotProductAttentionVjp):
    """The `xla` implementation's gradient, from the family's `(lse,)` residual.

    Autodiff of the reference (`DotProductAttentionVjp`) reruns the whole forward,
    softmax passes included, inside the backward: about 1.3-1.8x the backward a user gets
    from autodiff of the plain expression on the H200. This one recomputes only the
    logits, takes `P = exp(logits - lse)` in the same fusion as `dS = P * (dP - delta)`
    (`delta = rowsum(dout * out) - dlse`), and runs the four gradient products on
    operands in the inputs' dtype with float32 accumulation, as FlashAttention does.
    """

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, dresiduals: Any = None,
             **statics: Any) -> tuple[dict[str, Any], None]:
        batch, q_len, heads, head_dim = query.shape
        kv_len, kv_heads = key.shape[1], key.shape[2]
        if residuals is None or not q_len or not kv_len:
            return super()._fwd(residuals, out, dout, config=config,
                                return_residuals=return_residuals, query=query, key=key,
                                value=value, bias=bias, mask=mask, dresiduals=dresiduals,
                                **statics)
        groups = heads // kv_heads
        dtype = compute_dtype(query.dtype)
        mm = dict(precision=statics["precision"], preferred_element_type=dtype)
        logits, keep = grouped_logits(query, key, bias, mask, **statics)
        (lse,) = residuals
        lse = lse.reshape(batch, kv_heads, groups, q_len, 1).astype(dtype)
        probs = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0))
        if keep is not None:  # fully masked rows (lse -inf) are all masked: probs 0
            probs = jnp.where(keep, probs, 0.0)
        if bias is not None:
            # A row a bias hides whole (a padding bias near float32's lowest value) has an
            # lse that lost `log(keys)` to rounding: its probabilities sum to the key count
            # until divided by their sum, which is 1 in every other row.
            total = jnp.sum(probs, axis=-1, keepdims=True)
            probs = probs / jnp.where(total > 0.0, total, 1.0)
        q = query.reshape(batch, q_len, kv_heads, groups, head_dim)
        do = dout.reshape(*q.shape[:4], dout.shape[3])
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", probs.astype(value.dtype), do, **mm)
        dprobs = jnp.einsum("bqhgd,bkhd->bhgqk", do, value, **mm)
        if bias is None:
            delta = jnp.sum(out.astype(dtype) * dout.astype(dtype), axis=-1)  # (B, Sq, H)
            delta = jnp.transpose(delta.reshape(batch, q_len, kv_heads, groups), (0, 2, 3, 1))
        else:  # from the probabilities, in float32: `out . dout` from the rounded (bf16)
            # output misses it by up to 0.03 at JAX's bias-gradient cases, an error the bias
            # gradient takes whole
            delta = jnp.sum(probs * dprobs, axis=-1)  # (B, Hkv, G, Sq)
        if dresiduals is not None:
            delta = delta - dresiduals[0].reshape(batch, kv_heads, groups, q_len).astype(dtype)
        dlogits = probs * (dprobs - delta[..., None])
        cap = statics["logits_soft_cap"]
        if cap is not None:
            dlogits = dlogits * (1.0 - jnp.square(logits / cap))
        dbias = None
        if bias is not None:
            full = dlogits.reshape(batch, heads, q_len, kv_len)
            dbias = _sum_to_shape(full, bias.shape).astype(bias.dtype)
        dlogits = (dlogits * statics["scale"]).astype(query.dtype)
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", dlogits, key, **mm)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", dlogits, q, **mm)
        return {"query": dq.reshape(query.shape).astype(query.dtype),
                "key": dk.astype(key.dtype), "value": dv.astype(value.dtype),
                "bias": dbias}, None
