"""A ViT/BERT-style encoder: LayerNorm with offset, non-causal attention at head dim 64,
a GELU MLP, and a classifier over the mean-pooled sequence.

Inputs are patch or token embeddings (batch, seq, width) in the config's `dtype`
(bfloat16 by default), as a ViT's patch projection or a BERT's embedding lookup gives
them; the norms' scales and offsets are float32 in every dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from benchmarks.models import blocks
from benchmarks.models.blocks import AttentionShape, Params


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Sizes of an encoder; `dtype` is the activations' and weights' (`blocks.DTYPES`)."""

    layers: int
    batch: int
    seq: int
    width: int
    heads: int
    head_dim: int
    mlp: int
    classes: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        blocks.check_dtype(self.dtype)

    @property
    def attention(self) -> AttentionShape:
        return AttentionShape(self.width, self.heads, self.heads, self.head_dim)


def init(key: jax.Array, c: EncoderConfig) -> Params:
    keys = jax.random.split(key, c.layers + 1)
    layers = []
    for layer_key in keys[:-1]:
        ka, k1, k2, k3, k4, ku, kd = jax.random.split(layer_key, 7)
        layers.append({
            "attention": blocks.init_attention(ka, c.attention, c.dtype),
            "norm1": (blocks.norm_scale(k1, c.width), 0.1 * jax.random.normal(k2, (c.width,))),
            "norm2": (blocks.norm_scale(k3, c.width), 0.1 * jax.random.normal(k4, (c.width,))),
            "up": blocks.normal(ku, (c.width, c.mlp), c.width, c.dtype),
            "down": blocks.normal(kd, (c.mlp, c.width), c.mlp, c.dtype),
        })
    return {"layers": layers,
            "head": blocks.normal(keys[-1], (c.width, c.classes), c.width, c.dtype)}


def loss(ops, params: Params, batch: dict[str, jax.Array], c: EncoderConfig) -> jax.Array:
    x = batch["inputs"]
    for p in params["layers"]:
        h = ops.layer_norm(x, *p["norm1"])
        x = x + blocks.attention_block(ops, p["attention"], h, c.attention, causal=False,
                                       use_rope=False)
        h = ops.layer_norm(x, *p["norm2"])
        x = x + jax.nn.gelu(h @ p["up"]) @ p["down"]
    pooled = jnp.mean(x.astype(jnp.float32), axis=1).astype(x.dtype)
    return blocks.cross_entropy(pooled @ params["head"], batch["labels"])


def make_batch(key: jax.Array, c: EncoderConfig) -> dict[str, jax.Array]:
    ki, kl = jax.random.split(key)
    inputs = jax.random.normal(ki, (c.batch, c.seq, c.width), jnp.float32).astype(c.dtype)
    return {"inputs": inputs, "labels": jax.random.randint(kl, (c.batch,), 0, c.classes)}

