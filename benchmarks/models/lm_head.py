"""The LM head and its loss alone, at Llama-3 widths: a decoder's last hidden states,
its final RMSNorm, the untied (H, V) head and the mean cross-entropy over the vocabulary.

The hidden states are an input (what the decoder below hands over), so a training step,
`jax.grad(loss)` over the norm and the head, runs the head's backward in full: the
logits' cotangent through the head to the hidden states (for the norm's gradient) and
to the head's weights. At a 128k vocabulary this step is where plain JAX's temporaries
peak: the (tokens, V) logits and their cotangent.
"""

from __future__ import annotations

import dataclasses

import jax

from benchmarks.models import blocks
from benchmarks.models.blocks import Params


@dataclasses.dataclass(frozen=True)
class LMHeadConfig:
    """Tokens (`batch` sequences of `seq`), the hidden width and the vocabulary; `dtype`
    is the hidden states' and the head's (`blocks.DTYPES`); the norm weight is float32."""

    batch: int
    seq: int
    width: int
    vocab: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        blocks.check_dtype(self.dtype)


def init(key: jax.Array, c: LMHeadConfig) -> Params:
    norm_key, head_key = jax.random.split(key)
    return {"final_norm": blocks.norm_scale(norm_key, c.width),
            "head": blocks.normal(head_key, (c.width, c.vocab), c.width, c.dtype)}


def make_batch(key: jax.Array, c: LMHeadConfig) -> dict[str, jax.Array]:
    hidden_key, token_key = jax.random.split(key)
    hidden = jax.random.normal(hidden_key, (c.batch, c.seq, c.width)).astype(c.dtype)
    return {"hidden": hidden,
            "labels": blocks.token_batch(token_key, c.batch, c.seq, c.vocab)["labels"]}


def loss(ops, params: Params, batch: dict[str, jax.Array], c: LMHeadConfig) -> jax.Array:
    del c  # the sizes are the arrays'
    h = ops.rms_norm(batch["hidden"], params["final_norm"])
    return ops.lm_head_loss(h, params["head"], batch["labels"])
