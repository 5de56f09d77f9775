"""The Mosaic GPU attention forward and VJP run on CPU in GPU interpret mode against the
float32 HIGHEST reference: outputs, lse and the gradients of random cotangents; and two
forward configs checked bitwise against each other. Shared by the soft cap / window,
head dim 256, persistent and grouped-heads tests."""

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
from tokamax_kernels.attention import _mosaic_gpu_fwd_kernel as fwd_kernel
from tokamax_kernels.attention._mosaic_gpu_common import MosaicAttentionConfig


def statics(causal, window, cap, lengths=None, **extra):
    """The family's static arguments (scale 0.3), key/value `lengths` (a tuple, one a
    batch element) as an int32 array, and `extra` on top."""
    kv_lengths = None if lengths is None else jnp.array(lengths, jnp.int32)
    return dict(scale=0.3, is_causal=causal, query_seq_lengths=None,
                key_value_seq_lengths=kv_lengths, local_window_size=window,
                logits_soft_cap=cap, precision=None) | extra


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

    # One compiled program (eager op-by-op compiles each of the reference's operations).
    @jax.jit
    def reference_and_grads(q, k, v, do):
        (want, (want_lse,)), pullback = jax.vjp(reference, q, k, v)
        return want, want_lse, pullback((do, (jnp.zeros_like(want_lse),)))

    with reference_precision():
        want, want_lse, want_grads = reference_and_grads(
            *(x.astype(jnp.float32) for x in (q, k, v, do)))
    assert_close(out, want, jnp.bfloat16)
    lse = np.asarray(residuals[0])
    seen = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], np.asarray(want_lse)[seen], atol=1e-2)
    for name, want_grad in zip(("query", "key", "value"), want_grads, strict=True):
        assert grads[name].dtype == jnp.bfloat16
        assert_close(grads[name], want_grad, jnp.bfloat16)
    return out, grads


def assert_forward_variant_bitwise_equal(shape, causal, fields, variant, kv_lengths=None,
                                         **kwargs):
    """The forward kernel with `fields | variant` and with `fields` alone, in interpret
    mode: out and lse equal bit for bit (rows that see no key aside, which both leave
    undefined). `kwargs` (window, soft cap) go to the kernel; `shape` as `interpreted`'s."""
    b, sq, sk, h, hk, d = shape
    q = random_normal(1, (b, sq, h, d), jnp.bfloat16)
    k, v = (random_normal(i, (b, sk, hk, d), jnp.bfloat16) for i in (2, 3))

    def run(extra):
        config = MosaicAttentionConfig(**({"block_kv": 64} | fields | extra))
        return fwd_kernel.mosaic_attention_forward(q, k, v, kv_lengths, scale=0.3,
                                                   causal=causal, config=config, **kwargs)

    with interpret_mode():
        got, want = run(variant), run({})
    seen = np.ones((b, sq), bool)
    if kv_lengths is not None:
        seen &= np.asarray(kv_lengths)[:, None] > 0
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if g.ndim == 3:  # lse is (B, H, Sq)
            g, w = np.swapaxes(g, 1, 2), np.swapaxes(w, 1, 2)
        np.testing.assert_array_equal(g[seen], w[seen])
