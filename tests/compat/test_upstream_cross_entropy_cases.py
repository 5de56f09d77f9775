"""Upstream Tokamax's cross-entropy cases (the api test's sizes and reductions, the
chunked test's dtypes and reductions) run through
`tokamax_pass.linear_softmax_cross_entropy_loss` against a float32 `Precision.HIGHEST`
reference, with upstream's tolerances."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from compat._upstream import NONE_ON_CPU, assert_trees_all_close

HIGHEST = jax.lax.Precision.HIGHEST


def _data(b, h, v, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(42), 3)
    x = jax.random.normal(k1, (b, h), jnp.float32).astype(dtype)
    labels = jax.random.randint(k2, (b,), 0, v)
    w = jax.random.normal(k3, (h, v), jnp.float32).astype(dtype)
    return x, labels, w


def _reference(x, labels, w, reduction):
    logits = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
    losses = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, labels[:, None], -1)[:, 0]
    return {"sum": jnp.sum, "mean": jnp.mean, "none": lambda a: a}[reduction](losses)


def _value_and_grads(f, x, labels, w, dout):
    """The loss and its pullback of `dout`, in one compiled program (eagerly, every small
    op compiles on its own)."""
    @jax.jit
    def run(x, labels, w, dout):
        loss, pullback = jax.vjp(lambda x, w: f(x, labels, w), x, w)
        return loss, pullback(dout.astype(loss.dtype))
    return run(x, labels, w, dout)


@functools.cache
def _expected(size, reduction, dtype, dout_key, dout_shape):
    """The reference's loss and gradients, once per case (the implementations of a case
    compare against the same values)."""
    x, labels, w = _data(*size, dtype)
    dout = jax.random.normal(jax.random.key(dout_key), dout_shape).astype(dtype)
    return _value_and_grads(lambda x, labels, w: _reference(x, labels, w, reduction),
                            x, labels, w, dout)


SIZES = {"small": (1024, 512, 2048), "small_unaligned": (1024, 520, 2049),
         "medium": (4096, 1024, 4096)}


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", ["xla", "chunked_xla", NONE_ON_CPU])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("size", [
    "small", "small_unaligned", pytest.param("medium", marks=pytest.mark.slow)])
def test_api_fwd_bwd_matches_reference(implementation, reduction, size):
    """Upstream's api test: loss within 1e-4, gradients within 3e-2 of the reference."""
    x, labels, w = _data(*SIZES[size])
    f = lambda x, labels, w: tokamax.linear_softmax_cross_entropy_loss(
        x, labels, w, reduction=reduction, implementation=implementation)
    dout = jax.random.normal(jax.random.key(3), ())
    loss, grads = _value_and_grads(f, x, labels, w, dout)
    loss_ref, grads_ref = _expected(SIZES[size], reduction, jnp.float32, 3, ())
    assert_trees_all_close(loss, loss_ref, atol=1e-4, rtol=1e-4)
    assert_trees_all_close(grads, grads_ref, atol=3e-2, rtol=3e-2)


@pytest.mark.exhaustive
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_chunked_matches_reference(reduction, dtype):
    """Upstream's chunked test (b 256, h 1024, v 2048): loss within 1e-3 and gradients
    within 3e-3 (0.3 for `reduction="none"`) of the float32 reference."""
    x, labels, w = _data(256, 1024, 2048, dtype)
    f = lambda x, labels, w: tokamax.linear_softmax_cross_entropy_loss(
        x, labels, w, reduction=reduction, implementation="chunked_xla")
    shape = (256,) if reduction == "none" else ()
    dout = jax.random.normal(jax.random.key(123), shape).astype(dtype)
    loss, grads = _value_and_grads(f, x, labels, w, dout)
    loss_ref, grads_ref = _expected((256, 1024, 2048), reduction, dtype, 123, shape)
    fwd_tol, bwd_tol = (0.3, 0.3) if reduction == "none" else (1e-3, 3e-3)
    assert_trees_all_close(loss, loss_ref, atol=fwd_tol, rtol=fwd_tol)
    assert_trees_all_close(grads, grads_ref, atol=bwd_tol, rtol=bwd_tol)
