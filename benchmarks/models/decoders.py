"""Decoder language models: Llama-3-style dense, Mixtral-style and DeepSeek-MoE-style MoE,
Gemma-2-style.

Each is `init(key, config) -> params` and `loss(ops, params, batch) -> scalar`, one
training step being `jax.grad(loss)` over the parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from benchmarks.models import blocks
from benchmarks.models.blocks import AttentionShape, Params


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a decoder. `experts > 0` makes each MLP a top-`top_k` mixture of experts;
    `soft_cap`/`window` give Gemma-2's attention (windowed layers alternate with global
    ones) and `final_soft_cap` its capped logits. `shared_mlp > 0` adds a shared expert (a
    dense SwiGLU of that width every token runs) beside the routed ones, as DeepSeek-MoE.
    `with_attention=False` leaves out the attention blocks: a decode step's MoE layers
    alone (attention over a KV cache is not modelled). `dtype` is the activations' and
    weights' (`blocks.DTYPES`); the norm weights and the router are float32 in every dtype."""

    layers: int
    batch: int
    seq: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    experts: int = 0
    top_k: int = 2
    activation: str = "silu"
    soft_cap: float | None = None
    window: int | None = None
    final_soft_cap: float | None = None
    shared_mlp: int = 0
    with_attention: bool = True
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        blocks.check_dtype(self.dtype)

    @property
    def attention(self) -> AttentionShape:
        return AttentionShape(self.width, self.heads, self.kv_heads, self.head_dim)


_ACTIVATIONS = {"silu": jax.nn.swish, "gelu": jax.nn.gelu}


def init(key: jax.Array, c: DecoderConfig) -> Params:
    keys = jax.random.split(key, c.layers + 2)
    layers = []
    for layer_key in keys[:c.layers]:
        ka, kn1, kn2, kg, kd, kr, ks = jax.random.split(layer_key, 7)
        layer = {"mlp_norm": blocks.norm_scale(kn2, c.width)}
        if c.with_attention:
            layer["attention"] = blocks.init_attention(ka, c.attention, c.dtype)
            layer["attention_norm"] = blocks.norm_scale(kn1, c.width)
        if c.shared_mlp:
            kgs, kds = jax.random.split(ks)
            layer["shared_gate_up"] = blocks.normal(kgs, (c.width, 2, c.shared_mlp), c.width,
                                                    c.dtype)
            layer["shared_down"] = blocks.normal(kds, (c.shared_mlp, c.width), c.shared_mlp,
                                                 c.dtype)
        if c.experts:
            layer["router"] = blocks.normal(kr, (c.width, c.experts), c.width, jnp.float32)
            layer["gate_up"] = blocks.normal(kg, (c.experts, c.width, 2 * c.mlp), c.width,
                                             c.dtype)
            layer["down"] = blocks.normal(kd, (c.experts, c.mlp, c.width), c.mlp, c.dtype)
        else:
            layer["gate_up"] = blocks.normal(kg, (c.width, 2, c.mlp), c.width, c.dtype)
            layer["down"] = blocks.normal(kd, (c.mlp, c.width), c.mlp, c.dtype)
        layers.append(layer)
    return {"embed": blocks.normal(keys[-2], (c.vocab, c.width), 1, c.dtype),
            "layers": layers,
            "final_norm": blocks.norm_scale(keys[-1], c.width),
            "head": blocks.normal(jax.random.fold_in(keys[-1], 1), (c.width, c.vocab), c.width,
                                  c.dtype)}


def _moe(ops, p: Params, h: jax.Array, c: DecoderConfig) -> jax.Array:
    """Top-k routing; token copies sorted by expert (`moe_dispatch`); SwiGLU experts: the
    grouped gate/up GLU, then the down ragged dot; back to token order, weighted
    (`moe_combine`)."""
    router_logits = h.astype(jnp.float32) @ p["router"]
    weights, experts = jax.lax.top_k(jax.nn.softmax(router_logits, axis=-1), c.top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    rows, group_sizes, routing = ops.moe_dispatch(h, experts, c.experts)
    hidden = ops.moe_glu(rows, p["gate_up"], group_sizes, _ACTIVATIONS[c.activation])
    out_sorted = ops.ragged_dot(hidden, p["down"], group_sizes)
    out = ops.moe_combine(out_sorted, routing, weights).astype(h.dtype)
    if c.shared_mlp:
        shared = ops.glu(h, p["shared_gate_up"], _ACTIVATIONS[c.activation]) @ p["shared_down"]
        out = out + shared
    return out


def _mlp(ops, p: Params, h: jax.Array, c: DecoderConfig) -> jax.Array:
    if c.experts:
        return _moe(ops, p, h, c)
    return ops.glu(h, p["gate_up"], _ACTIVATIONS[c.activation]) @ p["down"]


def _pre_norm(ops, x: jax.Array, pending: jax.Array | None,
              scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(rms_norm(x + pending), x + pending)`: the residual add of the block before, fused
    into the next norm (`pending` is None before the first block)."""
    if pending is None:
        return ops.rms_norm(x, scale), x
    return ops.add_rms_norm(x, pending, scale)


def loss(ops, params: Params, batch: dict[str, jax.Array], c: DecoderConfig) -> jax.Array:
    x = params["embed"][batch["tokens"]]
    pending = None  # the last block's output, not yet added to the residual stream x
    for i, p in enumerate(params["layers"]):
        if c.with_attention:
            window = c.window if c.window is not None and i % 2 == 0 else None
            h, x = _pre_norm(ops, x, pending, p["attention_norm"])
            pending = blocks.attention_block(ops, p["attention"], h, c.attention, causal=True,
                                             window=window, soft_cap=c.soft_cap)
        h, x = _pre_norm(ops, x, pending, p["mlp_norm"])
        pending = _mlp(ops, p, h, c)
    h, _ = _pre_norm(ops, x, pending, params["final_norm"])
    return ops.lm_head_loss(h, params["head"], batch["labels"], c.final_soft_cap)


def make_batch(key: jax.Array, c: DecoderConfig) -> dict[str, jax.Array]:
    return blocks.token_batch(key, c.batch, c.seq, c.vocab)

