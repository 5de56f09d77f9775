"""A `custom_vjp` backward with `symbolic_zeros=True` (an op call returning residuals,
one of them stopped) differentiates through `optimize`: the pass re-traces the backward
with the symbolic zeros as they came, not as arrays."""

import jax

import tokamax_pass as tokamax
from conftest import assert_close, random_normal


def test_a_stopped_residual_differentiates_through_optimize():
    q = random_normal(0, (2, 8, 4, 16))
    k, v = random_normal(1, (2, 8, 2, 16)), random_normal(2, (2, 8, 2, 16))
    cotangent = random_normal(3, (2, 8, 4, 16))

    def loss(q, k, v):
        out, lse = tokamax.dot_product_attention(q, k, v, return_residual=True)
        return (out * cotangent).sum() + jax.lax.stop_gradient(lse).sum()

    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    actual = jax.grad(tokamax.optimize(loss), argnums=(0, 1, 2))(q, k, v)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e)
