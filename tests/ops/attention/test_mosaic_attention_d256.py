"""Head dim 256 in the Mosaic GPU attention backward, on CPU (the Gemma-2 shape of heads).

The dk/dv kernel splits the head dim between two warpgroups sharing their key rows, and
the dq kernel holds it whole (`compute_wgs=1`) or splits it likewise (`compute_wgs=2`):
both run in Pallas's GPU interpret mode against the float32 HIGHEST reference, forward
and gradients with random cotangents, with causal masks, soft cap, local windows, GQA and
key lengths; every d256 config lowers for an H200 through `jax.export`. On the GPU:
`tests/gpu/test_mosaic_attention_gpu.py::test_head_dim_256_*`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _mosaic_attention_interpreted import interpreted, statics
from conftest import H200
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    dot_product_attention,
)
from tokamax_kernels.attention import pallas_mosaic_gpu_vjp as vjp_module
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_pass import core

Op, Vjp = PallasMosaicGpuFlashAttention, PallasMosaicGpuFlashAttentionVjp
TILES_64 = MosaicAttentionConfig(block_q=64, block_kv=64)
SPLIT_DQ = MosaicAttentionVjpConfig()  # two warpgroups: dq split too
WHOLE_DQ = MosaicAttentionVjpConfig(compute_wgs=1)  # dq whole in one warpgroup


@pytest.mark.parametrize("shape, causal, window, cap, vjp_config", [
    # Gemma-2's local layers: causal, a window crossing tile edges, soft cap, GQA.
    pytest.param((2, 128, 128, 2, 1, 256), True, (40, 0), 5.0, SPLIT_DQ, id="gemma2-local"),
    pytest.param((2, 128, 128, 2, 1, 256), True, (40, 0), 5.0, WHOLE_DQ,
                 id="gemma2-local-whole-dq", marks=pytest.mark.slow),
    # Gemma-2's global layers: causal and soft cap, cross lengths (Sk = 2 Sq).
    pytest.param((2, 128, 256, 2, 2, 256), True, None, 3.0, SPLIT_DQ, id="causal-cap",
                 marks=pytest.mark.slow),
    # Plain attention, MQA, a two-sided window.
    pytest.param((2, 256, 128, 4, 1, 256), False, None, None, WHOLE_DQ, id="plain-mqa",
                 marks=pytest.mark.slow),
    pytest.param((2, 128, 128, 2, 2, 256), False, (30, 50), None, SPLIT_DQ, id="window",
                 marks=pytest.mark.slow),
])
def test_interpreted_d256_matches_reference(shape, causal, window, cap, vjp_config):
    interpreted(shape, statics(causal, window, cap), TILES_64, vjp_config, seed=41)


def test_interpreted_d256_key_and_query_lengths():
    """Keys past a batch's length get zero gradients; query rows past theirs too."""
    kv_lengths = jnp.array([200, 77], jnp.int32)
    q_lengths = jnp.array([128, 50], jnp.int32)
    _, grads = interpreted((2, 128, 256, 2, 1, 256),
                           statics(True, None, 2.0, key_value_seq_lengths=kv_lengths,
                                   query_seq_lengths=q_lengths), TILES_64, SPLIT_DQ, seed=51)
    assert not np.any(np.asarray(grads["key"][1, 77:], np.float32))
    assert not np.any(np.asarray(grads["query"][1, 50:], np.float32))


def _export(fn, *args):
    with core.targeting(H200):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)


@pytest.mark.parametrize("vjp_config", [SPLIT_DQ, WHOLE_DQ], ids=["split-dq", "whole-dq"])
@pytest.mark.parametrize("kv_heads, causal, window, cap, lengths", [
    (4, False, None, None, False), (2, True, (256, 0), 50.0, False),
    (1, True, None, 30.0, True), (4, False, (64, 64), None, True),
])
def test_d256_gradient_lowers_to_three_mosaic_kernels(kv_heads, causal, window, cap, lengths,
                                                      vjp_config):
    q = jax.ShapeDtypeStruct((2, 512, 4, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, kv_heads, 256), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    op = Op(vjp=Vjp(config=vjp_config))

    def loss(q, k, v, n):
        out = op(q, k, v, is_causal=causal, local_window_size=window, logits_soft_cap=cap,
                 key_value_seq_lengths=n if lengths else None)
        return (out.astype(jnp.float32) ** 2).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, n).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3  # forward, dq, dk/dv
    assert "PallasMosaicGpuFlashAttentionVjp" in text


def test_d256_self_attention_takes_the_general_kernels():
    """attention(x, x, x) at d256: the shared-input kernel would need 256 registers a
    thread, so dq and dk/dv run (three kernels, not two)."""
    x = jax.ShapeDtypeStruct((2, 256, 2, 256), jnp.bfloat16)
    loss = jax.grad(lambda x: dot_product_attention(
        x, x, x, implementation="mosaic").astype(jnp.float32).sum())
    assert _export(loss, x).mlir_module().count("mosaic_gpu_v2") == 3
    x64 = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    assert _export(loss, x64).mlir_module().count("mosaic_gpu_v2") == 2


def _vjp_bound(seq, head_dim, heads=16, batch=2, **kwargs):
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
    forward = Op().bind(q, q, q, **kwargs).arguments
    lse = jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)
    return Vjp().bind((lse,), q, q, **forward)


@pytest.mark.parametrize("seq, heads", [(8192, 8), (256, 2)])
def test_d256_heuristics_and_search_space_are_the_fitting_configs(seq, heads):
    """Only 64 x 64 tiles with 2 stages fit at d256; every proposed config passes the
    support check, and `compute_wgs` picks the dq kernel's form where SMs would idle."""
    ba = _vjp_bound(seq, 256, heads=heads, is_causal=True, local_window_size=(4096, 0),
                    logits_soft_cap=50.0)
    assert ba.heuristics_config == SPLIT_DQ
    configs = ba.autotuning_configs
    assert SPLIT_DQ in configs and configs <= {SPLIT_DQ, WHOLE_DQ}
    if seq == 256:  # 2 x 2 x 256 / 128 blocks: fewer than the SMs, one warpgroup tuned too
        assert configs == {SPLIT_DQ, WHOLE_DQ}
    for config in configs | {ba.heuristics_config}:
        Vjp(config=config).check_supported(ba, core.Target("cuda", H200))


@pytest.mark.parametrize("config", [
    MosaicAttentionVjpConfig(block_kv_dkv=128), MosaicAttentionVjpConfig(block_q_dq=128),
    MosaicAttentionVjpConfig(block_kv_dq=128), MosaicAttentionVjpConfig(num_stages=3),
])
def test_d256_larger_tiles_do_not_fit(config):
    assert vjp_module.fits(SPLIT_DQ, 1024, 1024, 256)
    assert not vjp_module.fits(config, 1024, 1024, 256)
    ba = _vjp_bound(1024, 256)
    with pytest.raises(NotImplementedError, match="does not fit"):
        Vjp(config=config).check_supported(ba, core.Target("cuda", H200))


def test_d256_smem_is_the_split_kernels():
    """K, V (64 rows) and a 2-slot Q/dO ring (64 rows each) at d256, bf16, + lse/delta:
    192 KiB + 1 KiB, whatever `compute_wgs` (split warpgroups share their rows)."""
    for config in (SPLIT_DQ, WHOLE_DQ):
        assert vjp_module.backward_smem_bytes(config, 256) == 192 * 1024 + 8 * 128
    # At d128 the dq kernel's tiles lead: Q, dO and out rows of two warpgroups, K/V ring.
    assert vjp_module.backward_smem_bytes(SPLIT_DQ, 128) == (
        128 * 2 * (3 * 2 * 64 + 2 * 2 * 64) + 8 * 128)
