"""The attention bias gradient at JAX's own bias-gradient cases (`jax.nn`'s
`testDotProductAttentionBiasGradient`: bf16 self-attention, S 128, 4 heads, a full
(B, N, S, S) bias, an all-true mask), with our batch sizes and random cotangents: every
implementation that takes a bias is at least as close to the float32 HIGHEST reference as
`jax.nn.dot_product_attention` is, forward and every gradient.

The backward's softmax row term came from `out . dout` with `out` rounded to bf16: off by
up to 0.03, which the bias gradient takes whole (0.05 against `jax.nn`'s 0.016 here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.attention import PallasTritonFlashAttention, PallasTritonFlashAttentionVjp

S, N = 128, 4
TRITON = PallasTritonFlashAttention(interpret=True,
                                    vjp=PallasTritonFlashAttentionVjp(interpret=True))
MASK = jnp.ones((1, 1, S), jnp.bool_)


def _reference(x, bias):
    x, bias = x.astype(jnp.float32), bias.astype(jnp.float32)
    return jax.nn.dot_product_attention(x, x, x, bias=bias, mask=MASK, implementation="xla")


def _errors(fn, x, bias, cotangent, want):
    """Max abs errors of the output and of (dx, dbias) against `want`."""
    out, pullback = jax.vjp(fn, x, bias)
    got = (out, *pullback(cotangent.astype(out.dtype)))
    return [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) for g, w in
            zip(got, want, strict=True)]


# Each shape runs in CI once (xla at one, xla_chunked at the other); the rest are `slow`.
@pytest.mark.parametrize("implementation, batch, head_dim", [
    pytest.param("xla", 2, 64, id="xla-b2-d64"),
    pytest.param("xla", 16, 32, id="xla-b16-d32", marks=pytest.mark.slow),
    pytest.param("xla_chunked", 2, 64, id="chunked-b2-d64", marks=pytest.mark.slow),
    pytest.param("xla_chunked", 16, 32, id="chunked-b16-d32"),
    pytest.param(TRITON, 2, 64, id="triton-b2-d64"),
])
def test_bias_gradient_at_least_as_close_as_jax_nn(implementation, batch, head_dim):
    x = random_normal(0, (batch, S, N, head_dim), jnp.bfloat16)
    bias = random_normal(1, (batch, N, S, S), jnp.bfloat16)
    cotangent = random_normal(2, (batch, S, N, head_dim))
    with jax.default_matmul_precision("highest"):
        out, pullback = jax.vjp(_reference, x, bias)
        want = (out, *pullback(cotangent))

    def jax_nn(x, bias):
        return jax.nn.dot_product_attention(x, x, x, bias=bias, mask=MASK, implementation="xla")

    def ours(x, bias):
        return tokamax.dot_product_attention(x, x, x, bias=bias, mask=MASK,
                                             implementation=implementation)

    bound = _errors(jax.jit(jax_nn), x, bias, cotangent, want)
    errors = _errors(jax.jit(ours), x, bias, cotangent, want)
    for name, error, limit in zip(("out", "dx", "dbias"), errors, bound, strict=True):
        assert error <= limit, f"{name}: {error} > jax.nn's {limit}"


def test_a_row_a_bias_hides_whole_gets_jax_nn_gradients_in_xla():
    """Hugging Face's padding bias (`finfo(float32).min` on padding keys) with an example
    all padding, every row in the loss: `xla` matches `jax.nn`'s values and gradients
    there too (its backward's probabilities summed to the key count, whose log the
    log-sum-exp had lost to rounding)."""
    b, t, n, d = 2, 8, 2, 16
    q, k, v = (random_normal(seed, (b, t, n, d)) for seed in range(3))
    keep = jnp.arange(t)[None, :] < jnp.array([[5], [0]])  # example 1: all padding
    bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]
    bias = jnp.broadcast_to(bias, (b, n, t, t))
    cotangent = random_normal(3, (b, t, n, d))

    def loss(f):
        return lambda *args: jnp.sum(f(*args) * cotangent)

    def ours(q, k, v, bias):
        return tokamax.dot_product_attention(q, k, v, bias=bias, implementation="xla")

    def plain(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")

    with jax.default_matmul_precision("highest"):
        got = jax.value_and_grad(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, bias)
        want = jax.value_and_grad(loss(plain), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert_close(g, w)
