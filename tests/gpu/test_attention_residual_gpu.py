"""`dot_product_attention(..., return_residual=True)` on the GPU: for cuDNN, Mosaic GPU and
Triton, the output and lse against `jax.nn`'s (its `cudnn` and `xla` paths), and the
gradient of a loss using both outputs (random cotangents) against the float32 HIGHEST
reference; cuDNN's forward with another backward where lse is differentiated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.attention.api import dot_product_attention

pytestmark = pytest.mark.gpu

B, S, H, HKV, D = 2, 256, 4, 2, 64


def _inputs():
    q = random_normal(0, (B, S, H, D), jnp.bfloat16)
    k, v = random_normal(1, (B, S, HKV, D), jnp.bfloat16), random_normal(2, (B, S, HKV, D),
                                                                          jnp.bfloat16)
    return q, k, v, random_normal(3, q.shape, jnp.bfloat16), random_normal(4, q.shape[:-1])


def _loss_and_grads(impl, q, k, v, dout, dlse, **options):
    def loss(q, k, v):
        out, lse = dot_product_attention(q, k, v, implementation=impl, return_residual=True,
                                         **options)
        return (jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
                + jnp.sum(lse.astype(jnp.float32) * dlse)), (out, lse)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize("impl", ["cudnn", "mosaic", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_output_and_lse_match_jax_nn(impl, causal):
    q, k, v, _, _ = _inputs()
    out, lse = jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl, return_residual=True))(q, k, v)
    nn_impl = "cudnn" if impl == "cudnn" else "xla"
    out_nn, lse_nn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=nn_impl, return_residual=True))(q, k, v)
    assert lse.shape == lse_nn.shape == (B, S, H) and lse.dtype == lse_nn.dtype
    assert_close(out, out_nn, jnp.bfloat16)
    assert_close(lse, lse_nn, jnp.bfloat16)


@pytest.mark.parametrize("impl", ["mosaic", "triton", None])
@pytest.mark.parametrize("options", [dict(is_causal=True), dict(
    key_value_seq_lengths=jnp.array([256, 100]), query_seq_lengths=jnp.array([200, 256]))])
def test_gradient_through_lse_matches_reference(impl, options):
    q, k, v, dout, dlse = _inputs()
    (_, (out, _)), grads = _loss_and_grads(impl, q, k, v, dout, dlse, **options)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with reference_precision():
        (_, (out_ref, _)), grads_ref = _loss_and_grads("xla", *f32, dout, dlse, **options)
    assert_close(out, out_ref, jnp.bfloat16)
    for got, want in zip(grads, grads_ref, strict=True):
        assert_close(got, want, jnp.bfloat16)
    assert np.all(np.isfinite(np.asarray(grads[0], np.float32)))


def test_cudnn_forward_with_another_backward_for_lse():
    """`None` on the GPU: cuDNN's forward, and a backward that takes the lse cotangent."""
    q, k, v, dout, dlse = _inputs()
    _, grads = _loss_and_grads(None, q, k, v, dout, dlse, is_causal=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with reference_precision():
        _, grads_ref = _loss_and_grads("xla", *f32, dout, dlse, is_causal=True)
    for got, want in zip(grads, grads_ref, strict=True):
        assert_close(got, want, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="return_residual"):
        _loss_and_grads("cudnn", q, k, v, dout, dlse, is_causal=True)
