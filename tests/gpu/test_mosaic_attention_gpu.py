"""Device tests of the Mosaic GPU attention kernels (H200): forward, lse and gradients against
the float32 reference, and bitwise-identical reruns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.attention import DotProductAttention, dot_product_attention

pytestmark = pytest.mark.gpu


def _inputs(b, sq, sk, h, hk, d):
    return (random_normal(0, (b, sq, h, d), jnp.bfloat16),
            random_normal(1, (b, sk, hk, d), jnp.bfloat16),
            random_normal(2, (b, sk, hk, d), jnp.bfloat16),
            random_normal(3, (b, sq, h, d), jnp.bfloat16))


def _mosaic_fwd_bwd(causal):
    def f(q, k, v, do):
        out, pullback = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=causal, implementation="mosaic"), q, k, v)
        return (out, *pullback(do))
    return jax.jit(f)


def _reference(q, k, v, do, causal):
    args = [x.astype(jnp.float32) for x in (q, k, v)]
    with reference_precision():
        out, pullback = jax.vjp(lambda q, k, v: DotProductAttention()(
            q, k, v, is_causal=causal), *args)
        return (out, *pullback(do.astype(jnp.float32)))


@pytest.mark.parametrize("shape,causal", [
    ((2, 256, 256, 4, 4, 64), False), ((2, 256, 256, 4, 4, 64), True),
    ((2, 384, 384, 4, 4, 128), True), ((1, 256, 512, 2, 2, 64), True),
    ((1, 512, 256, 2, 2, 128), False),
    ((1, 1024, 1024, 2, 2, 128), False),
    ((2, 256, 256, 4, 2, 128), False), ((2, 256, 256, 4, 2, 64), True),
    ((1, 512, 512, 4, 1, 64), False),
])
def test_forward_and_gradients_match_reference(shape, causal):
    q, k, v, do = _inputs(*shape)
    results = _mosaic_fwd_bwd(causal)(q, k, v, do)
    for name, got, want in zip(("out", "dq", "dk", "dv"), results, _reference(q, k, v, do, causal),
                               strict=True):
        assert_close(got, want, jnp.bfloat16), name
    again = _mosaic_fwd_bwd(causal)(q, k, v, do)
    assert all(np.array_equal(a, b) for a, b in zip(results, again, strict=True))


@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_forward(causal):
    q, k, v, _ = _inputs(1, 256, 256, 2, 2, 256)
    out = dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")
    with reference_precision():
        want = DotProductAttention()(*(x.astype(jnp.float32) for x in (q, k, v)),
                                     is_causal=causal)
    assert_close(out, want, jnp.bfloat16)


@pytest.mark.parametrize("b,s,h,d,causal", [
    (32, 2048, 16, 64, False), (4, 8192, 16, 128, False), (4, 8192, 16, 128, True),
])
def test_benchmark_shapes_match_reference_on_first_batch(b, s, h, d, causal):
    q, k, v, do = _inputs(b, s, s, h, h, d)
    results = _mosaic_fwd_bwd(causal)(q, k, v, do)
    want = _reference(*(x[:1] for x in (q, k, v, do)), causal)
    for got, ref in zip(results, want, strict=True):
        assert_close(got[:1], ref, jnp.bfloat16)
