"""`dot_product_attention`: the public function and its implementations."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal

import jax.numpy as jnp

from tokamax_kernels import _dispatch
from tokamax_kernels import _validation as v
from tokamax_kernels.attention import layout
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_kernels.attention.cudnn import CudnnDotProductAttention
from tokamax_kernels.attention.pallas_mosaic_gpu import PallasMosaicGpuFlashAttention
from tokamax_kernels.attention.pallas_mosaic_tpu import PallasMosaicTpuFlashAttention
from tokamax_kernels.attention.pallas_triton import PallasTritonFlashAttention
from tokamax_kernels.attention.xla_chunked import XlaChunkedDotProductAttention
from tokamax_pass.core import Family, register_family
from tokamax_pass.core.registry import Implementation

_OP = "dot_product_attention"

# Upstream Tokamax's names for the arrays, accepted as keywords by `bind` of every
# attention op (they bind as `query`, `key`, `value`). Set here with the family, so the
# ops' modules, whose source the caches' entries record, stay as they are.
DotProductAttention.argument_aliases = MappingProxyType(
    {"q": "query", "k": "key", "v": "value"})

# `None` tries cuDNN first: on the H200 it is still faster than our Mosaic (0.79-0.95x of
# cuDNN) and Triton (0.7-0.8x) kernels (benchmarks/results); measured timings in an active
# result or cache override this order per shape.
FAMILY = register_family(Family(
    name="dot_product_attention",
    implementations={
        "mosaic_gpu": PallasMosaicGpuFlashAttention,
        "mosaic_tpu": PallasMosaicTpuFlashAttention,
        "triton": PallasTritonFlashAttention,
        "cudnn": CudnnDotProductAttention,
        "xla_chunked": XlaChunkedDotProductAttention,
        "xla": DotProductAttention,
    },
    automatic=("cudnn", "mosaic_gpu", "mosaic_tpu", "triton", "xla"),
    aliases={"mosaic": ("mosaic_gpu", "mosaic_tpu")},
))

# The implementation names `implementation=` takes (upstream Tokamax's type of that name).
type DotProductAttentionImplementation = Literal[
    "cudnn", "mosaic", "mosaic_gpu", "mosaic_tpu", "triton", "xla", "xla_chunked"]


def dot_product_attention(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
    scale: float | None = None, is_causal: bool = False, query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None, local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None, precision: Any = None,
    implementation: Implementation = None, return_residual: bool = False,
) -> Any:
    """Multi-head attention `softmax(scale * q.k^T + bias, masked) @ v`, a drop-in for
    `jax.nn.dot_product_attention` (layout `(..., seq, heads, head_dim)`).

    Args:
      query: (*batch, q_seq, heads, head_dim); key, value: (*batch, kv_seq, kv_heads,
        head_dim) with kv_heads dividing heads (GQA/MQA); all one float dtype. `*batch`
        is any number of leading axes, none included (`(T, N, H)` as under a per-example
        `jax.vmap`); a missing leading axis counts as 1, as in `jax.nn`.
      bias: float, broadcastable to (*batch, heads, q_seq, kv_seq); leading dims may be
        left out (`(q_seq, kv_seq)`, `(1, 1, kv_seq)`, ...).
      mask: bool (True = attend), broadcastable like `bias`.
      scale: logits scale, default 1/sqrt(head_dim); static (a Python or NumPy number, or
        a concrete 0-d array), as `is_causal`, `local_window_size` and `logits_soft_cap`.
      is_causal: key position <= query position (top-left aligned).
      query_seq_lengths, key_value_seq_lengths: int, shape `batch` (`(1,)` or `()` without
        a batch axis): valid lengths, of any integer dtype (int4 and narrower ones are
        taken as int32). Concrete ones must be >= 0 (a ValueError); traced ones (under
        `jit` or `vmap`) cannot be checked, and a negative one counts as 0.
      local_window_size: `w` or `(left, right)`: query i sees keys i-left .. i+right.
      logits_soft_cap: `cap * tanh(logits / cap)` before masking.
      precision: matmul precision (`jax.lax.Precision` or its name).
      implementation: `None` (the plain-JAX path, unless a measurement shows a
        kernel faster here: see `tokamax_pass.core.selection`), a name from
        `FAMILY.implementations` (`"mosaic"`: the Mosaic kernel of the platform, GPU or
        TPU), an `Op` instance, a function, or a sequence of those, tried in order until
        one does not raise `NotImplementedError` (as upstream Tokamax does). A function
        is called as `f(query, key, value, bias, mask, **keywords)` with the keywords
        this call was given (`jax.nn.dot_product_attention` is one).
      return_residual: also return `lse`, the logsumexp (natural log) over keys of each
        query row's final (scaled, biased, soft-capped, masked) logits, as `jax.nn` does:
        shape `(*batch, q_seq, heads)` (the query's shape without head_dim), the inputs'
        dtype. Unlike `jax.nn` (whose `xla` path stops its gradient and whose `cudnn`
        path drops it), lse is differentiable: d lse / d logits = softmax probabilities.
        Every implementation returns it; cuDNN's backward cannot take its gradient, so a
        gradient through lse moves `None` on to another backward (and raises
        `NotImplementedError` for `implementation="cudnn"`).

    Returns the output, an array of the query's shape, or `(output, lse)` with
    `return_residual=True`.

    A query row that can attend to nothing (its mask, window and lengths hide every key)
    returns ZEROS in every implementation, and gets zero gradients (see `base.py`), as
    cuDNN and flash kernels do; `jax.nn`'s `xla` implementation averages the values
    there instead (rows past `query_seq_lengths` aside, which it zeroes too). Such a
    row's lse is `jax.nn`'s: `-0.7 * float32 max` (the logsumexp of a row of only
    masked logits) cast to the dtype (`-inf` in float16); it gets no gradient.
    """
    given = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                 precision=precision, return_residual=return_residual)
    return _dispatch.call(
        implementation,
        lambda impl: _attention(query, key, value, bias, mask, **given, implementation=impl),
        # A callable gets the call's arguments as given (the keywords left at their
        # defaults left out), so `jax.nn.dot_product_attention` fits.
        lambda f: f(query, key, value, bias, mask,
                    **{k: x for k, x in given.items() if x is not None and x is not False}),
        op=_OP)


def _attention(query: Any, key: Any, value: Any, bias: Any, mask: Any, *,
               scale: float | None, is_causal: bool, query_seq_lengths: Any,
               key_value_seq_lengths: Any, local_window_size: int | tuple[int, int] | None,
               logits_soft_cap: float | None, precision: Any, implementation: Implementation,
               return_residual: bool) -> Any:
    """`dot_product_attention` with `implementation` free of callables."""
    query, key, value, bias = v.numpy_floats_as_jax((query, key, value, bias))
    arrays = dict(query=query, key=key, value=value, bias=bias, mask=mask,
                  query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths)
    for name, static in (("local_window_size", local_window_size),
                         ("return_residual", return_residual)):
        v.reject_traced(name, static, op=_OP)
    if scale is not None:  # a NumPy or concrete JAX scalar too, as `jax.nn` takes
        scale = v.static_number("scale", scale, op=_OP, minimum=None)
    if not isinstance(return_residual, bool):
        raise TypeError(f"dot_product_attention: return_residual must be a bool, got "
                        f"{return_residual!r}")
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        # Lists work as in `jax.nn`, also where nothing needs folding (rank-4 inputs).
        if isinstance(arrays[name], (list, tuple)):
            arrays[name] = jnp.asarray(arrays[name])
        # Any integer dtype: int4 lengths failed deep inside with a TypePromotionError.
        arrays[name] = v.sub_byte_integers_as_int32(arrays[name])
    out_shape = None
    if layout.needs_folding(query, key, value, bias, mask):
        arrays, out_shape = layout.fold(**arrays)
    result = FAMILY(
        implementation, **arrays, scale=scale, is_causal=is_causal,
        local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
        precision=precision, return_residuals=return_residual,
    )
    out, residuals = result if return_residual else (result, None)
    out = out if out_shape is None else out.reshape(out_shape)
    if residuals is None:
        return out
    (lse,) = residuals
    return out, layout.lse_as_jax_nn(lse, out.shape, out.dtype)
