"""The seed example's model: layer norm -> attention -> layer norm -> attention, summed.

Every implementation is `None`, so each platform gets its best kernel: the XLA ones on
CPU, the Pallas kernels or cuDNN on an H200. `make_loss` names them instead (to rerun
an exported artifact's kernel choice in process).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax


def make_loss(attention: str | None = None,
              norm: str | None = None) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The seed loss with the given attention and layer norm implementations."""

    def loss(x: jax.Array, scale: jax.Array) -> jax.Array:
        x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=norm)
        x = tokamax.dot_product_attention(x, x, x, implementation=attention)
        x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=norm)
        x = tokamax.dot_product_attention(x, x, x, implementation=attention)
        return jnp.sum(x.astype(jnp.float32))

    return loss


loss = make_loss()
loss_grad = jax.grad(loss)
