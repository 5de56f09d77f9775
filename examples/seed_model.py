"""The seed example's model: layer norm -> attention -> layer norm -> attention, summed.

Every implementation is `None`, so each platform gets its best kernel: the XLA ones on
CPU, the Pallas kernels on an H200.
"""

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax


def loss(x: jax.Array, scale: jax.Array) -> jax.Array:
    x = tokamax.layer_norm(x, scale=scale, offset=None)
    x = tokamax.dot_product_attention(x, x, x)
    x = tokamax.layer_norm(x, scale=scale, offset=None)
    x = tokamax.dot_product_attention(x, x, x)
    return jnp.sum(x.astype(jnp.float32))


loss_grad = jax.grad(loss)
