"""cuDNN fused attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

What cuDNN cannot express raises `NotImplementedError` in `check_supported`, so
`implementation=None` moves on: float32/float64 inputs, a logits soft cap, head
dims that are not a multiple of 8 or above 128 (256 on Hopper), local windows
with a right part unless causal, and (backward only) a bias with an odd
sequence length.

Fully masked rows: cuDNN turns a bool mask into a large negative bias, so a
row the mask empties would average the values, and what it returns for rows
that causal/window/length masks empty is not documented; `_fwd` zeroes every
row with nothing to attend to, keeping the family's contract.

Residuals: `jax.nn` exposes cuDNN's logsumexp only cast to the output dtype
(bf16 loses ~3 digits), which a foreign backward would turn into visible errors.
So the `(lse,)` residual is computed exactly by the chunked XLA logsumexp
(`xla_chunked`, no Sq x Sk temporary), and only when residuals are asked for.
The default backward, `CudnnDotProductAttentionVjp`, ignores it and re-runs
`jax.vjp` of the cuDNN forward to use cuDNN's fused backward kernel; under
`jax.jit` the unused lse computation is then dead code that XLA removes. The
price is one recomputed cuDNN forward in the backward pass.

`jax.nn`'s cuDNN path needs the CUDA plugin even to lower, so its cuda lowering
is tested on the GPU only (`pytest -m gpu`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels.attention import xla_chunked
from tokamax_kernels.attention.base import (
    DotProductAttention,
    DotProductAttentionVjp,
    keep_mask,
)
from tokamax_pass.core import BoundArguments, NullConfig, Op, Target

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _require_cudnn_library() -> None:
    """cuDNN attention lowers only where the cuDNN library loads (not on a CPU-only machine
    exporting for cuda): elsewhere `None` moves on to a kernel that lowers anywhere."""
    from jax._src.cudnn import fused_attention_stablehlo

    try:
        fused_attention_stablehlo.check_cudnn_version()
    except RuntimeError as e:
        raise NotImplementedError(f"cuDNN attention cannot be lowered here: {e}") from None


def _check(ba: BoundArguments, target: Target | None, *, backward: bool) -> None:
    a = ba.arguments
    if target is not None:
        _require_cudnn_library()
    if jnp.dtype(a["query"].dtype) not in _CUDNN_DTYPES:
        raise NotImplementedError(f"cuDNN attention needs bf16/f16 inputs, got {a['query'].dtype}")
    if a["logits_soft_cap"] is not None:
        raise NotImplementedError("cuDNN attention has no logits soft cap")
    head_dim = a["query"].shape[-1]
    max_dim = 256 if target is not None and target.is_hopper else 128
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


def _nonempty_rows(a: dict[str, Any]) -> jax.Array:
    """(B|1, Sq, 1|H, 1) True where a query row attends to at least one key.

    Without a bool mask this is O(B * Sq) arithmetic on the allowed key range
    [lo, hi] of each row (causal, window, lengths); with one, the row-wise OR of
    the combined mask (the size of the mask itself).
    """
    q_len, kv_len = a["query"].shape[1], a["key"].shape[1]
    if a["mask"] is not None:
        keep = keep_mask(jnp.arange(q_len), jnp.arange(kv_len), mask=a["mask"],
                         is_causal=a["is_causal"], local_window_size=a["local_window_size"],
                         query_seq_lengths=a["query_seq_lengths"],
                         key_value_seq_lengths=a["key_value_seq_lengths"])
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


def _cudnn_forward(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                   a: dict[str, Any]) -> jax.Array:
    batch, q_len, _, _ = query.shape
    kv_len = key.shape[1]

    def full_seq(x: jax.Array | None) -> jax.Array | None:  # cuDNN needs (.., Sq, Sk) biases
        return None if x is None else jnp.broadcast_to(x, (*x.shape[:2], q_len, kv_len))

    lengths = [a["query_seq_lengths"], a["key_value_seq_lengths"]]
    lengths = [None if x is None else x.astype(jnp.int32) for x in lengths]
    window = a["local_window_size"]
    if window is not None and a["is_causal"]:
        window = (window[0], 0)
    out = jax.nn.dot_product_attention(
        query, key, value, full_seq(bias), full_seq(a["mask"]), scale=a["scale"],
        is_causal=a["is_causal"], query_seq_lengths=lengths[0],
        key_value_seq_lengths=lengths[1], local_window_size=window, implementation="cudnn")
    return jnp.where(_nonempty_rows(a), out, jnp.zeros((), out.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudnnDotProductAttention(DotProductAttention):
    """cuDNN flash attention (NVIDIA GPUs, bf16/f16); see the module docstring."""

    implementation = "cudnn"
    platforms = frozenset({"cuda"})

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        _check(ba, target, backward=False)

    def _fwd(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, *, config: NullConfig, return_residuals: bool,
             **statics: Any) -> tuple[jax.Array, Any]:
        arguments = dict(mask=mask, **statics)
        out = _cudnn_forward(query, key, value, bias, arguments)
        if not return_residuals:
            return out, None
        pb = xla_chunked.problem_for(query, key, value, bias, mask, **statics)
        return out, (xla_chunked.chunked_forward(pb)[1],)

    def _default_vjp(self) -> Op:
        return CudnnDotProductAttentionVjp()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudnnDotProductAttentionVjp(DotProductAttentionVjp):
    """cuDNN's fused backward, by `jax.vjp` of the cuDNN forward (ignores the residuals)."""

    implementation = "cudnn"
    platforms = frozenset({"cuda"})

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        _check(ba, target, backward=True)

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Any, return_residuals: bool,
             query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
             **statics: Any) -> tuple[dict[str, Any], None]:
        del residuals, out, config, return_residuals

        def forward(query: jax.Array, key: jax.Array, value: jax.Array,
                    bias: jax.Array | None) -> jax.Array:
            return _cudnn_forward(query, key, value, bias, statics)

        _, pullback = jax.vjp(forward, query, key, value, bias)
        dq, dk, dv, dbias = pullback(dout)
        return {"query": dq, "key": dk, "value": dv, "bias": dbias}, None
