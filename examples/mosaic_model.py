"""A mixture-of-experts step for the three-platform artifact: one ragged dot and one
attention, each `implementation=("mosaic", "xla")`, so an export for CPU, CUDA and TPU
holds the Mosaic GPU kernels in its CUDA lowering, the Mosaic TPU kernels in its TPU
lowering, and XLA in its CPU lowering (`tests/test_tpu_export.py`, `//:mosaic_artifact`).
"""

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax

IMPLEMENTATION = ("mosaic", "xla")
# (tokens, model dim) x (experts, model dim, expert dim); attention (batch, seq, heads, dim).
ARG_SPECS = ["bf16[256,256]", "bf16[4,256,256]", "s32[4]", "bf16[2,256,4,128]"]


def loss(x: jax.Array, w: jax.Array, sizes: jax.Array, q: jax.Array) -> jax.Array:
    """Expert outputs plus causal self-attention, summed in float32."""
    experts = tokamax.ragged_dot(x, w, sizes, implementation=IMPLEMENTATION)
    attention = tokamax.dot_product_attention(q, q, q, is_causal=True,
                                              implementation=IMPLEMENTATION)
    return experts.astype(jnp.float32).sum() + attention.astype(jnp.float32).sum()


def loss_grad(x: jax.Array, w: jax.Array, sizes: jax.Array, q: jax.Array) -> tuple:
    """Gradients of `loss` with respect to the tokens, the expert weights and the queries."""
    return jax.grad(loss, argnums=(0, 1, 3))(x, w, sizes, q)
