"""The Mosaic GPU attention forward and VJP run on CPU in GPU interpret mode against the
float32 HIGHEST reference: outputs, lse and the gradients of random cotangents. Shared by
the soft cap / window tests and the head dim 256 tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from _mosaic_gpu_interpret import interpret_mode
from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.attention import (
    DotProductAttention,
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
)


def statics(causal, window, cap, **extra):
    """The family's static arguments (scale 0.3) with `extra` (say lengths) on top."""
    return dict(scale=0.3, is_causal=causal, query_seq_lengths=None,
                key_value_seq_lengths=None, local_window_size=window, logits_soft_cap=cap,
                precision=None) | extra


def interpreted(shape, statics, config, vjp_config, seed):
    """The op's forward and VJP (`_fwd`: no platform check) in GPU interpret mode, against
    the reference's output and gradients; returns the kernels' (out, grads).

    `shape` is (batch, Sq, Sk, heads, kv heads, head dim)."""
    b, sq, sk, h, hk, d = shape
    q = random_normal(seed, (b, sq, h, d), jnp.bfloat16)
    k = random_normal(seed + 1, (b, sk, hk, d), jnp.bfloat16)
    v = random_normal(seed + 2, (b, sk, hk, d), jnp.bfloat16)
    do = random_normal(seed + 3, (b, sq, h, d), jnp.bfloat16)
    with interpret_mode():
        out, residuals = PallasMosaicGpuFlashAttention()._fwd(
            q, k, v, None, None, **statics, config=config, return_residuals=True)
        grads, _ = PallasMosaicGpuFlashAttentionVjp()._fwd(
            residuals, out, do, config=vjp_config, return_residuals=False, query=q, key=k,
            value=v, bias=None, mask=None, **statics)

    def reference(q, k, v):
        return DotProductAttention()._fwd(q, k, v, None, None, **statics, config=None,
                                          return_residuals=True)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with reference_precision():
        (want, (want_lse,)), pullback = jax.vjp(reference, *f32)
        want_grads = pullback((do.astype(jnp.float32), (jnp.zeros_like(want_lse),)))
    assert_close(out, want, jnp.bfloat16)
    lse = np.asarray(residuals[0])
    seen = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], np.asarray(want_lse)[seen], atol=1e-2)
    for name, want_grad in zip(("query", "key", "value"), want_grads, strict=True):
        assert grads[name].dtype == jnp.bfloat16
        assert_close(grads[name], want_grad, jnp.bfloat16)
    return out, grads
