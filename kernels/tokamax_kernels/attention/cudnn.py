"""cuDNN fused attention: the fused forward and backward kernels that `jax.nn` uses.

What cuDNN cannot express raises `NotImplementedError` in `check_supported`, so
`implementation=None` moves on: float32/float64 inputs, a logits soft cap, head
dims that are not a multiple of 8 or above 128 (256 on Hopper), local windows
with a right part unless causal, and (backward only) a bias with an odd
sequence length.

Fully masked rows: cuDNN turns a bool mask into a large negative bias, so a
row the mask empties would average the values, and what it returns for rows
that causal/window/length masks empty is not documented; `_fwd` zeroes every
row with nothing to attend to, keeping the family's contract.

Residuals: the forward returns cuDNN's own float32 softmax statistics as the family's
`(lse,)` residual, and `CudnnDotProductAttentionVjp` hands them (from any forward of
the family) with the output to cuDNN's fused backward kernel, as `jax.nn`'s own
custom VJP does, so no forward is recomputed. Both custom calls are reached through
`jax._src.cudnn.fused_attention_stablehlo` (private API of the pinned jax), because
`jax.nn` returns the statistics only cast to the output dtype and takes no
residuals in its backward.

The lse as an output (`return_residual=True`): the forward returns it like every
implementation. cuDNN's fused backward computes `delta = rowsum(dout * out)` itself and
takes no lse cotangent (`jax.nn`'s cuDNN path drops that cotangent silently), so
`CudnnDotProductAttentionVjp` raises `NotImplementedError` for a gradient through lse:
`implementation=None` moves on to a backward that takes it.

`jax.nn`'s cuDNN path needs the CUDA plugin even to lower, so its cuda lowering
is tested on the GPU only (`pytest -m gpu`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as fused

from tokamax_kernels.attention.base import (
    DotProductAttention,
    DotProductAttentionVjp,
    keep_mask,
)
from tokamax_pass.core import BoundArguments, CannotLowerHere, NullConfig, Op, Target

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _require_cudnn_library() -> None:
    """cuDNN attention lowers only where the cuDNN library loads (not on a CPU-only machine
    exporting for cuda): elsewhere `None` moves on to a kernel that lowers anywhere, ranked
    with cuDNN's measurements on the target still counted (`CannotLowerHere`)."""
    try:
        fused.check_cudnn_version()
    except RuntimeError as e:
        raise CannotLowerHere(f"cuDNN attention cannot be lowered here: {e}") from None


def _check(ba: BoundArguments, target: Target | None, *, backward: bool) -> None:
    a = ba.arguments
    if jnp.dtype(a["query"].dtype) not in _CUDNN_DTYPES:
        raise NotImplementedError(f"cuDNN attention needs bf16/f16 inputs, got {a['query'].dtype}")
    if a["logits_soft_cap"] is not None:
        raise NotImplementedError("cuDNN attention has no logits soft cap")
    head_dim = a["query"].shape[-1]
    # At trace time (no target) only what no GPU supports is rejected: candidates dropped
    # there are never reconsidered at lowering, where a Hopper target allows 256.
    max_dim = 128 if target is not None and not target.is_hopper else 256
    if head_dim % 8 or head_dim > max_dim:
        raise NotImplementedError(
            f"cuDNN attention needs head_dim a multiple of 8 and <= {max_dim}, got {head_dim}")
    window = a["local_window_size"]
    if window is not None and window[1] != 0 and not a["is_causal"]:
        raise NotImplementedError(
            f"cuDNN attention windows have no right part unless causal, got {window}")
    if backward and a["bias"] is not None and (
            a["query"].shape[1] % 2 or a["key"].shape[1] % 2):
        raise NotImplementedError("cuDNN attention's backward with a bias needs even seq lengths")
    if target is not None:
        # Last: a call cuDNN cannot run at all is unsupported, not just unlowerable here.
        _require_cudnn_library()


def _nonempty_rows(q_len: int, kv_len: int, a: dict[str, Any]) -> jax.Array:
    """(B|1, Sq, 1|H, 1) True where a query row attends to at least one key.

    Without a bool mask this is O(B * Sq) arithmetic on the allowed key range
    [lo, hi] of each row (causal, window, lengths); with one, the row-wise OR of
    the combined mask (the size of the mask itself).
    """
    if a["mask"] is not None:
        keep = keep_mask(jnp.arange(q_len), jnp.arange(kv_len), mask=a["mask"],
                         is_causal=a["is_causal"], local_window_size=a["local_window_size"],
                         query_seq_lengths=a["query_seq_lengths"],
                         key_value_seq_lengths=a["key_value_seq_lengths"])
        assert keep is not None  # a mask is given
        return jnp.transpose(jnp.any(keep, axis=-1), (0, 2, 1))[..., None]
    row = jnp.arange(q_len)
    lo, hi = jnp.zeros_like(row), jnp.full_like(row, kv_len - 1)
    if a["is_causal"]:
        hi = jnp.minimum(hi, row)
    if a["local_window_size"] is not None:
        left, right = a["local_window_size"]
        lo, hi = jnp.maximum(lo, row - left), jnp.minimum(hi, row + right)
    hi = hi[None]
    if a["key_value_seq_lengths"] is not None:
        hi = jnp.minimum(hi, a["key_value_seq_lengths"][:, None] - 1)
    nonempty = lo[None] <= hi
    if a["query_seq_lengths"] is not None:
        nonempty = nonempty & (row[None] < a["query_seq_lengths"][:, None])
    return nonempty[:, :, None, None]


def _full_bias(bias: jax.Array | None, mask: jax.Array | None, query: jax.Array,
               key: jax.Array) -> jax.Array | None:
    """The bias operand of cuDNN's custom calls: `bias` plus the bool mask as a large
    negative number (as `jax.nn` combines them), broadcast to (.., Sq, Sk)."""
    combined = fused.combine_bias_and_mask(bias, mask, query.dtype)
    if combined is None:
        return None
    return jnp.broadcast_to(combined, (*combined.shape[:2], query.shape[1], key.shape[1]))


@dataclasses.dataclass(frozen=True)
class _CudnnCall:
    """The operands and parameters of cuDNN's forward and backward custom calls, prepared
    as `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` prepares them.

    Calling the two custom calls directly (private API of the pinned jax 0.11.2) lets the
    forward hand cuDNN's float32 softmax statistics (the natural-log logsumexp of the
    scaled logits, shape (B, H, Sq)) out as the family's `(lse,)` residual, and the
    backward take them back: no forward is recomputed in the backward pass.
    """

    operands: tuple[jax.Array, ...]
    params: dict[str, Any]

    @classmethod
    def prepare(cls, query: jax.Array, key: jax.Array, value: jax.Array,
                bias: jax.Array | None, a: dict[str, Any]) -> _CudnnCall:
        batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
        lengths = [a["query_seq_lengths"], a["key_value_seq_lengths"]]
        padded = any(x is not None for x in lengths)
        if padded:
            lengths = [jnp.full((batch,), n, jnp.int32) if x is None else x.astype(jnp.int32)
                       for x, n in zip(lengths, (q_len, kv_len), strict=True)]
        mask_type = {(False, False): fused.MaskType.NO_MASK,
                     (False, True): fused.MaskType.CAUSAL,
                     (True, False): fused.MaskType.PADDING,
                     (True, True): fused.MaskType.PADDING_CAUSAL}[padded, a["is_causal"]]
        window = a["local_window_size"]
        full_bias = _full_bias(bias, a["mask"], query, key)
        unused = jnp.zeros(0, query.dtype)
        operands = (query, key, value, unused if full_bias is None else full_bias,
                    *(unused if x is None else x for x in lengths), unused, unused, unused,
                    unused)
        params = dict(
            scale=a["scale"], seed=42, dropout_rate=0.0,
            variadic_args=(full_bias is not None, bias is not None),
            mask_type=mask_type, layout=fused.AttentionLayout.BTNH.value,
            sliding_window_length=None if window is None else window[0] + 1)
        return cls(operands, params)

    def forward(self) -> tuple[jax.Array, jax.Array]:
        """(out, softmax statistics (B, H, Sq) float32)."""
        return fused._dot_product_attention_fwd(
            *self.operands, **{**self.params, "cudnn_version": fused.check_cudnn_version(),
                               "return_residual": True})

    def backward(self, lse: jax.Array, out: jax.Array,
                 dout: jax.Array) -> tuple[jax.Array, ...]:
        """(dq, dk, dv) and, when the bias is differentiable, d(full bias)."""
        return tuple(fused._dot_product_attention_bwd_p_wrapper.bind(
            *self.operands, lse, out, dout, **self.params))


def _rows_may_be_empty(a: dict[str, Any]) -> bool:
    """Whether any query row can have nothing to attend to (causal alone never empties a
    row: top-left aligned, every row sees key 0), so `_nonempty_rows` can be skipped."""
    return any(a[name] is not None for name in (
        "mask", "local_window_size", "query_seq_lengths", "key_value_seq_lengths"))


def _nonempty_lse_rows(nonempty: jax.Array) -> jax.Array:
    """`_nonempty_rows` as (B|1, H|1, Sq), the layout of the lse residual."""
    return jnp.transpose(nonempty[..., 0], (0, 2, 1))


# cuDNN against `jax.nn.dot_product_attention`'s default (XLA), forward and forward+
# backward, H200 (`benchmarks/probes/cudnn_vs_xla_attention_sweep.py`, 60 shapes x causal):
# cuDNN leads everywhere but at b1 s128 h8, the smallest call swept, with head dims over
# 64 (its fixed cost dominates there). Calls with at most that many score elements go to
# XLA unless measured.
TINY_SCORE_ELEMENTS = 1 * 8 * 128 * 128
TINY_MIN_HEAD_DIM = 128


def loses_to_xla_unmeasured(ba: BoundArguments) -> bool:
    """Whether cuDNN runs a call this small (vmaps included) slower than XLA's attention."""
    q, k = ba.arguments["query"], ba.arguments["key"]
    batch, seq_q, heads, head_dim = q.shape
    mapped = math.prod(level.size for level in ba.vmap)
    scores = mapped * batch * heads * seq_q * k.shape[1]
    return scores <= TINY_SCORE_ELEMENTS and head_dim >= TINY_MIN_HEAD_DIM


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudnnDotProductAttention(DotProductAttention):
    """cuDNN flash attention (NVIDIA GPUs, bf16/f16); see the module docstring."""

    implementation = "cudnn"
    plain_jax_path = True  # jax.nn.dot_product_attention(implementation="cudnn")
    platforms = frozenset({"cuda"})

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        _check(ba, target, backward=False)

    def unmeasured_plain_path_loses(self, ba: BoundArguments) -> bool:
        return loses_to_xla_unmeasured(ba)

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, *, config: NullConfig, return_residuals: bool,
             **statics: Any) -> tuple[jax.Array, Any]:
        arguments = dict(mask=mask, **statics)
        out, stats = _CudnnCall.prepare(query, key, value, bias, arguments).forward()
        if _rows_may_be_empty(arguments):
            nonempty = _nonempty_rows(query.shape[1], key.shape[1], arguments)
            out = jnp.where(nonempty, out, jnp.zeros((), out.dtype))
            stats = jnp.where(_nonempty_lse_rows(nonempty), stats, -jnp.inf)
        return out, (stats,) if return_residuals else None

    def _default_vjp(self) -> Op:
        return CudnnDotProductAttentionVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudnnDotProductAttentionVjp(DotProductAttentionVjp):
    """cuDNN's fused backward, fed with the forward's `(lse,)` residual and output."""

    implementation = "cudnn"
    plain_jax_path = True  # jax.nn.dot_product_attention(implementation="cudnn")
    platforms = frozenset({"cuda"})

    def unmeasured_plain_path_loses(self, ba: BoundArguments) -> bool:
        return loses_to_xla_unmeasured(ba)

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        _check(ba, target, backward=True)
        if ba.arguments.get("dresiduals") is not None:
            raise NotImplementedError(
                "cuDNN attention's backward cannot differentiate through the lse that "
                "return_residual=True returns (its fused kernel takes no lse cotangent): wrap "
                "lse in jax.lax.stop_gradient to keep cuDNN, or use implementation=None "
                "(another backward then runs) or another implementation")

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             **statics: Any) -> tuple[dict[str, Any], None]:
        del config, return_residuals
        (lse,) = residuals
        # A fully masked row has zero output and gets zero gradients: its cotangent is
        # dropped, and an lse of +inf turns its probabilities into zeros (its own -inf
        # would give NaN against masked logits).
        if _rows_may_be_empty(statics):
            nonempty = _nonempty_rows(query.shape[1], key.shape[1], statics)
            dout = jnp.where(nonempty, dout, jnp.zeros((), dout.dtype))
            lse = jnp.where(_nonempty_lse_rows(nonempty), lse, jnp.inf)
        call = _CudnnCall.prepare(query, key, value, bias, statics)
        dq, dk, dv, *dfull_bias = call.backward(lse.astype(jnp.float32), out, dout)
        dbias = None
        if bias is not None:
            _, pullback = jax.vjp(
                lambda b: _full_bias(b, statics["mask"], query, key), bias)
            (dbias,) = pullback(dfull_bias[0])
        return {"query": dq, "key": dk, "value": dv, "bias": dbias}, None
