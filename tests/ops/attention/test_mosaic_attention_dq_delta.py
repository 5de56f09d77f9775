"""The dq kernel that computes the backward's row term itself
(`mosaic_attention_dq_and_delta`): delta against the float32 sum of `out * dout`, dq
bitwise equal to the dq kernel fed that delta, in GPU interpret mode on CPU (GQA causal,
key lengths, a window with a soft cap, one warpgroup); the VJP runs it (no row-term
pass) except where it does not: the lse's cotangent, head dim 256, the one pass; its
SMEM counted; head dim 256 refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, random_normal
from tokamax_kernels.attention import dot_product_attention
from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
    computes_delta,
    mosaic_attention_dq,
    mosaic_attention_dq_and_delta,
)
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
from tokamax_kernels.attention.pallas_mosaic_gpu_vjp import backward_smem_bytes
from tokamax_pass import core

V = MosaicAttentionVjpConfig


@pytest.mark.parametrize("shape, causal, window, cap, lengths, config, dtype", [
    pytest.param((2, 256, 4, 2, 64), True, None, None, None, V(), jnp.bfloat16,
                 id="gqa-causal-d64"),
    pytest.param((2, 256, 2, 1, 128), False, None, None, (200, 37), V(compute_wgs=1),
                 jnp.bfloat16, id="lengths-d128-one-wg"),
    pytest.param((2, 256, 2, 2, 128), True, (100, 0), 20.0, None, V(), jnp.bfloat16,
                 id="window-cap-d128"),
    pytest.param((2, 256, 2, 2, 64), False, None, None, None, V(), jnp.float16,
                 id="f16-d64"),
])
def test_delta_matches_the_row_sum_and_dq_the_kernel_fed_it(shape, causal, window, cap,
                                                            lengths, config, dtype):
    b, s, h, hk, d = shape
    q, do = (random_normal(i, (b, s, h, d), dtype) for i in (11, 12))
    k, v = (random_normal(i, (b, s, hk, d), dtype) for i in (13, 14))
    kv_lengths = None if lengths is None else jnp.array(lengths, jnp.int32)
    kwargs = dict(scale=0.3, causal=causal, window=window, soft_cap=cap)
    with interpret_mode():
        out, lse = mosaic_attention_forward(q, k, v, kv_lengths, config=config_fwd(config),
                                            **kwargs)
        dq, delta = mosaic_attention_dq_and_delta(q, k, v, do, out, lse, kv_lengths,
                                                  config=config, **kwargs)
        fed = mosaic_attention_dq(q, k, v, do, lse, delta, kv_lengths, config=config,
                                  **kwargs)
    want = np.einsum("bshd,bshd->bhs", np.asarray(out, np.float32), np.asarray(do, np.float32))
    assert delta.shape == (b, h, s) and delta.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(delta), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(dq, np.float32), np.asarray(fed, np.float32))


def config_fwd(config: MosaicAttentionVjpConfig) -> MosaicAttentionConfig:
    """The forward config of the same warpgroups, 64-row tiles."""
    return MosaicAttentionConfig(block_q=64, block_kv=64, compute_wgs=config.compute_wgs)


def test_head_dim_256_is_refused():
    q = jax.ShapeDtypeStruct((1, 128, 2, 256), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((1, 2, 128), jnp.float32)
    assert computes_delta(64) and computes_delta(128) and not computes_delta(256)
    with pytest.raises(ValueError, match="head dims up to 128, got 256"):
        jax.eval_shape(lambda *a: mosaic_attention_dq_and_delta(
            *a, scale=0.1, causal=False, config=V(compute_wgs=1)), q, q, q, q, q, vec)


def test_smem_counts_the_output_rows():
    """Two 64 x 128 bf16 row tiles of out beside Q and dO: 32 KiB more for dq; d256 (no
    out tile) as before."""
    with_out = backward_smem_bytes(V(block_q_dkv=64, block_kv_dkv=64), 128)
    rows = 2 * 64 * 128 * 2
    assert with_out == 128 * 2 * (3 * 2 * 64 + 2 * 2 * 64) + 8 * 128
    assert with_out - rows == 128 * 2 * (2 * 2 * 64 + 2 * 2 * 64) + 8 * 128
    assert backward_smem_bytes(V(), 256) == max(
        256 * 2 * (2 * 64 + 2 * 2 * 64), 2 * 256 * 2 * (64 + 2 * 64)) + 8 * 128


def _gradient_text(head_dim, *, through_lse=False, config=None):
    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
    )
    q = jax.ShapeDtypeStruct((2, 256, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
    impl = PallasMosaicGpuFlashAttention(vjp=PallasMosaicGpuFlashAttentionVjp(config=config))

    def loss(q, k, v):
        out, lse = dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                         return_residual=True)
        total = out.astype(jnp.float32).sum()
        return total + ((lse.astype(jnp.float32) ** 2).sum() if through_lse else 0.0)

    with core.targeting(H200):
        return jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS
                                 )(q, kv, kv).mlir_module()


@pytest.mark.parametrize("head_dim, through_lse, config, row_term_pass", [
    (128, False, None, False),
    (64, False, V(compute_wgs=1), False),
    (128, True, None, True),
    (256, False, V(compute_wgs=2), True),
    (256, False, V(compute_wgs=1), True),
    (128, False, V(dq_accumulation="ordered"), True),
])
def test_the_gradient_runs_the_row_term_pass_only_where_needed(head_dim, through_lse, config,
                                                               row_term_pass):
    text = _gradient_text(head_dim, through_lse=through_lse, config=config)
    assert text.count("mosaic_gpu_v2") == (2 if config and config.fused else 3)
    assert ("softmax_row_term" in text) == row_term_pass
