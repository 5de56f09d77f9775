"""PallasTritonFlashAttention on the GPU at the benchmark shapes: forward and gradient
against a float32 HIGHEST reference (every batch element), and bitwise-identical reruns
of the backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import per_batch_element, reference_precision
from tokamax_kernels.attention.api import dot_product_attention

pytestmark = pytest.mark.gpu

SHAPES = [
    (32, 2048, 16, 64, False, jnp.bfloat16),
    (4, 8192, 16, 128, False, jnp.bfloat16),
    (4, 8192, 16, 128, True, jnp.bfloat16),
    # float32 at head dim 128: the bf16 tiles would not fit in shared memory
    (2, 1024, 8, 128, True, jnp.float32),
]


def _rel_err(x: jax.Array, ref: jax.Array) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(("b", "s", "h", "d", "causal", "dtype"), SHAPES)
def test_forward_and_gradient_match_reference_and_rerun_bitwise(b, s, h, d, causal, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys)

    def fwd_bwd(impl, q, k, v, do):
        def f(q, k, v):
            return dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(do))

    run = jax.jit(lambda *a: fwd_bwd("triton", *a))
    results = run(q, k, v, do)
    again = run(q, k, v, do)
    for x, y in zip(results, again, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), "rerun differs"

    with reference_precision():
        ref = per_batch_element(lambda *a: fwd_bwd("xla", *a),
                                *(x.astype(jnp.float32) for x in (q, k, v, do)))
    for name, x, r in zip(("out", "dq", "dk", "dv"), results, ref, strict=True):
        for i in range(b):  # every batch element on its own: none may hide behind the others
            err = _rel_err(x[i], r[i])
            assert err < 1e-2, f"{name}[{i}]: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bias_and_mask_at_head_dim_128_match_reference(dtype):
    """A float32 bias and a mask stream tiles of their own beside keys and values: the
    heuristic tiles make room for them."""
    b, s, h, d = 2, 1024, 8, 128
    keys = jax.random.split(jax.random.key(1), 6)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys[:4])
    bias = jax.random.normal(keys[4], (b, h, s, s), jnp.float32)
    mask = jax.random.bernoulli(keys[5], 0.9, (b, 1, s, s))

    def fwd_bwd(impl, q, k, v, do, bias, mask):
        def f(q, k, v):
            return dot_product_attention(q, k, v, bias, mask, implementation=impl)
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(do))

    results = jax.jit(lambda *a: fwd_bwd("triton", *a))(q, k, v, do, bias, mask)
    with reference_precision():
        ref = per_batch_element(lambda *a: fwd_bwd("xla", *a),
                                *(x.astype(jnp.float32) for x in (q, k, v, do)), bias, mask)
    for name, x, r in zip(("out", "dq", "dk", "dv"), results, ref, strict=True):
        for i in range(b):
            err = _rel_err(x[i], r[i])
            assert err < 1e-2, f"{name}[{i}]: relative error {err:.3g}"


@pytest.mark.parametrize("fill", [float(jnp.finfo(jnp.float32).min), -1e10])
def test_a_padding_bias_with_an_example_all_padding_matches_reference(fill):
    """Hugging Face's padding bias with one example all padding (compiled Triton contracts
    `s - max` into one instruction): the forward matches everywhere, the all-padding
    example's rows the mean of its values, and the gradients of a loss leaving that
    example out match."""
    b, s, h, d = 2, 1024, 8, 128
    keys = jax.random.split(jax.random.key(2), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
    do = do * jnp.array([1.0, 0.0], jnp.bfloat16)[:, None, None, None]
    keep = jnp.arange(s)[None, :] < jnp.array([[700], [0]])
    bias = jnp.where(keep, 0.0, fill)[:, None, None, :]

    def fwd_bwd(impl, q, k, v, do):
        def f(q, k, v):
            return dot_product_attention(q, k, v, bias, implementation=impl)
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(do))

    results = jax.jit(lambda *a: fwd_bwd("triton", *a))(q, k, v, do)
    with reference_precision():
        ref = fwd_bwd("xla", *(x.astype(jnp.float32) for x in (q, k, v, do)))
    assert np.allclose(np.asarray(results[0][1], np.float32),
                       np.asarray(v[1].astype(jnp.float32).mean(0))[None], atol=2e-2)
    for name, x, r in zip(("out", "dq", "dk", "dv"), results, ref, strict=True):
        err = _rel_err(x[0], r[0])
        assert err < 1e-2, f"{name}[0]: relative error {err:.3g}"
