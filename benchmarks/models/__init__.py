"""The model suite, the benchmark of record: whole training steps, plain JAX against ours.

    python -m benchmarks.models [--only NAME ...] [--list] [--smoke] [--iterations N]
        [--set FIELD=VALUE ...]

Every config has a `dtype` (activations and weights: bfloat16, the suite's, or float16 or
float32, `--set dtype=float16`); norm weights and Mixtral's router stay float32.

Each model is written once against the `ops` switch, so plain JAX, our ops
(`implementation=None`) and the upstream Tokamax wheel run the same parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from benchmarks.models import decoders, encoder, lm_head


@dataclasses.dataclass(frozen=True)
class Model:
    """A model at its benchmark size and at a tiny size for CPU smoke tests."""

    name: str
    description: str
    config: Any
    smoke_config: Any
    init: Callable[[jax.Array, Any], Any]
    make_batch: Callable[[jax.Array, Any], dict[str, jax.Array]]
    loss: Callable[..., jax.Array]  # loss(ops, params, batch, c=config)
    # Whether the model makes a discrete choice (an MoE router's top-k). At 16 bits a
    # last-bit difference upstream can flip a token's expert (seen at the mixtral smoke
    # size: 1 token of 256, second-expert probabilities 0.2233 and 0.2226), which moves
    # every gradient through that layer by a few percent; the smoke check then compares
    # the loss at 16 bits and the gradients in float32, where the choices agree.
    discrete_routing: bool = False
    # A forward-only step (a decode step): timed as `loss` itself, not `jax.grad(loss)`.
    forward_only: bool = False

    def sized(self, smoke: bool) -> Any:
        return self.smoke_config if smoke else self.config

    def loss_fn(self, ops: Any, smoke: bool) -> Callable[[Any, Any], jax.Array]:
        """`loss(params, batch)` with `ops` and the config bound (a closure: `jax.jit`
        would trace a `functools.partial`'s arguments)."""
        config = self.sized(smoke)
        return lambda params, batch: self.loss(ops, params, batch, c=config)

    def step_fn(self, ops: Any, smoke: bool) -> Callable[[Any, Any], Any]:
        """The timed step: `jax.grad` of the loss, or the loss itself when `forward_only`."""
        loss = self.loss_fn(ops, smoke)
        return loss if self.forward_only else jax.grad(loss)


# DeepSeek-MoE-style fine-grained experts: 64 routed experts of hidden width 1408, top-6,
# one shared expert; its smoke size keeps 16 experts so groups stay small and uneven.
_FINE_MOE = dict(width=2048, heads=16, kv_heads=16, head_dim=128, mlp=1408, vocab=32000,
                 experts=64, top_k=6, shared_mlp=2816)
_FINE_MOE_SMOKE = dict(width=64, heads=4, kv_heads=4, head_dim=16, mlp=48, vocab=256,
                       experts=16, top_k=6, shared_mlp=96)

_DECODER_SMOKE = dict(layers=2, batch=2, seq=128, width=64, heads=4, kv_heads=2, head_dim=16,
                      mlp=96, vocab=256)

MODELS: dict[str, Model] = {m.name: m for m in (
    Model("llama", "Llama-3-style dense decoder: RMSNorm (f32 weights), RoPE, causal GQA "
          "(16 q / 4 kv heads of 128), SwiGLU 5632, untied LM head + cross-entropy",
          decoders.DecoderConfig(layers=4, batch=4, seq=4096, width=2048, heads=16, kv_heads=4,
                                 head_dim=128, mlp=5632, vocab=32000),
          decoders.DecoderConfig(**_DECODER_SMOKE),
          decoders.init, decoders.make_batch, decoders.loss),
    Model("mixtral", "Mixtral-style MoE decoder: top-2 of 8 SwiGLU experts through ragged_dot, "
          "causal GQA attention",
          decoders.DecoderConfig(layers=4, batch=4, seq=4096, width=2048, heads=16, kv_heads=4,
                                 head_dim=128, mlp=5632, vocab=32000, experts=8),
          decoders.DecoderConfig(**_DECODER_SMOKE, experts=4),
          decoders.init, decoders.make_batch, decoders.loss, discrete_routing=True),
    Model("deepseek_moe", "DeepSeek-MoE-style fine-grained MoE decoder: top-6 of 64 SwiGLU "
          "experts of width 1408 through ragged_dot plus a shared expert, causal attention",
          decoders.DecoderConfig(layers=4, batch=2, seq=2048, **_FINE_MOE),
          decoders.DecoderConfig(layers=2, batch=2, seq=64, **_FINE_MOE_SMOKE),
          decoders.init, decoders.make_batch, decoders.loss, discrete_routing=True),
    Model("moe_decode", "The fine-grained MoE's decode step, forward only: 256 tokens "
          "through its MoE layers (top-6 of 64 experts, shared expert) and the LM head",
          decoders.DecoderConfig(layers=4, batch=256, seq=1, with_attention=False,
                                 **_FINE_MOE),
          decoders.DecoderConfig(layers=2, batch=32, seq=1, with_attention=False,
                                 **_FINE_MOE_SMOKE),
          decoders.init, decoders.make_batch, decoders.loss, discrete_routing=True,
          forward_only=True),
    Model("gemma2", "Gemma-2-style decoder: attention logit soft cap 50, local windows of 4096 "
          "alternating with global layers, head dim 256, GeGLU 9216, final soft cap 30",
          decoders.DecoderConfig(layers=4, batch=2, seq=8192, width=2304, heads=8, kv_heads=4,
                                 head_dim=256, mlp=9216, vocab=32000, activation="gelu",
                                 soft_cap=50.0, window=4096, final_soft_cap=30.0),
          decoders.DecoderConfig(**_DECODER_SMOKE, activation="gelu", soft_cap=50.0, window=32,
                                 final_soft_cap=30.0),
          decoders.init, decoders.make_batch, decoders.loss),
    Model("encoder", "ViT/BERT-style encoder: LayerNorm with offset, non-causal attention "
          "(32 heads of 64), GELU MLP 8192",
          encoder.EncoderConfig(layers=4, batch=8, seq=2048, width=2048, heads=32, head_dim=64,
                                mlp=8192, classes=1000),
          encoder.EncoderConfig(layers=2, batch=2, seq=64, width=64, heads=4, head_dim=16,
                                mlp=128, classes=10),
          encoder.init, encoder.make_batch, encoder.loss),
    Model("lm_head", "Llama-3-style LM head and loss alone: final RMSNorm, untied 4096 x "
          "128256 head, mean cross-entropy over 16384 tokens (the hidden states an input)",
          lm_head.LMHeadConfig(batch=4, seq=4096, width=4096, vocab=128256),
          lm_head.LMHeadConfig(batch=2, seq=64, width=64, vocab=512),
          lm_head.init, lm_head.make_batch, lm_head.loss),
)}
