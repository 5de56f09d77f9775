"""Building blocks the models share: parameters, RoPE, the attention block, the loss.

Every block takes `ops` (`ops.Plain()` or `ops.Library(...)`) for the parts a kernel
library replaces; the projections, RoPE and residual adds are jnp in both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]

# The activation and weight dtypes a model config may name (`dtype`); bfloat16 is the
# suite's. Norm weights and a router stay float32 whatever the dtype.
DTYPES = ("bfloat16", "float16", "float32")


def check_dtype(name: str) -> None:
    """Raises `ValueError` unless `name` is one of `DTYPES` (a config's `dtype`)."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {DTYPES}")


def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int,
           dtype: Any = jnp.bfloat16) -> jax.Array:
    """Random weights scaled by 1/sqrt(fan_in): activations stay O(1) through the layers."""
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def norm_scale(key: jax.Array, width: int) -> jax.Array:
    """A float32 norm weight near 1 (random, never all ones)."""
    return 1.0 + 0.1 * jax.random.normal(key, (width,), jnp.float32)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    width: int
    heads: int
    kv_heads: int
    head_dim: int


def init_attention(key: jax.Array, shape: AttentionShape, dtype: Any = jnp.bfloat16) -> Params:
    kq, kk, kv, ko = jax.random.split(key, 4)
    w, hd = shape.width, shape.head_dim
    return {
        "wq": normal(kq, (w, shape.heads * hd), w, dtype),
        "wk": normal(kk, (w, shape.kv_heads * hd), w, dtype),
        "wv": normal(kv, (w, shape.kv_heads * hd), w, dtype),
        "wo": normal(ko, (shape.heads * hd, w), shape.heads * hd, dtype),
    }


def rope(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding over (batch, seq, heads, head_dim), halves rotated."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = base ** (-jnp.arange(0, dim // 2, dtype=jnp.float32) * 2 / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.astype(x.dtype)


def attention_block(ops: Any, p: Params, h: jax.Array, shape: AttentionShape, *,
                    causal: bool, use_rope: bool = True, window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """Separate q/k/v projections, RoPE, attention (GQA), output projection."""
    b, s, _ = h.shape
    q = (h @ p["wq"]).reshape(b, s, shape.heads, shape.head_dim)
    k = (h @ p["wk"]).reshape(b, s, shape.kv_heads, shape.head_dim)
    v = (h @ p["wv"]).reshape(b, s, shape.kv_heads, shape.head_dim)
    if use_rope:
        q, k = rope(q), rope(k)
    out = ops.attention(q, k, v, causal=causal, window=window, soft_cap=soft_cap)
    return out.reshape(b, s, shape.heads * shape.head_dim) @ p["wo"]


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  soft_cap: float | None = None) -> jax.Array:
    """Mean softmax cross-entropy in float32 (optax's integer-label form)."""
    logits = logits.astype(jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - label_logits)


def token_batch(key: jax.Array, batch: int, seq: int, vocab: int) -> dict[str, jax.Array]:
    """Random token ids and their next-token labels."""
    tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab, jnp.int32)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
