"""CPU tests of the Mosaic GPU attention forward's intra-warpgroup overlap
(`MosaicAttentionConfig.softmax_overlap`): numerics in GPU interpret mode against the
float32 reference (forward, lse and the default backward's gradients of random
cotangents), lowering for an H200, and the limits it states.

Interpret mode runs each `wgmma` to completion, so these tests check the overlapped
loop's bookkeeping (the first tile peeled, the P V one step late, the accumulator
rescaled after it lands); the device test
`tests/gpu/test_mosaic_attention_gpu.py -k softmax_overlap` checks the asynchrony.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from _mosaic_attention_interpreted import interpreted, statics
from conftest import H200
from tokamax_kernels.attention import PallasMosaicGpuFlashAttention, dot_product_attention
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_kernels.attention.pallas_mosaic_gpu import fits, forward_smem_bytes
from tokamax_pass import core


def _overlap(block_q=64, block_kv=64, stages=2, wgs=2):
    return MosaicAttentionConfig(block_q=block_q, block_kv=block_kv, num_stages=stages,
                                 compute_wgs=wgs, softmax_overlap=True)


@pytest.mark.parametrize("shape, causal, cap, config", [
    pytest.param((2, 256, 256, 2, 1, 64), True, None, _overlap(), id="mqa-causal"),
    pytest.param((2, 128, 384, 4, 2, 64), False, 20.0, _overlap(wgs=1, stages=3),
                 id="gqa-cross-cap-one-wg", marks=pytest.mark.slow),
    pytest.param((2, 256, 128, 2, 2, 128), True, None, _overlap(block_kv=128),
                 id="d128-causal-more-queries"),
])
def test_interpreted_overlap_matches_reference(shape, causal, cap, config):
    interpreted(shape, statics(causal, None, cap), config, MosaicAttentionVjpConfig(),
                seed=5)


def _export(fn, *args):
    with core.targeting(H200):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)


@pytest.mark.parametrize("head_dim, kv_heads, causal, cap, config", [
    (128, 4, False, None, _overlap(block_kv=128)),
    (128, 1, True, None, _overlap(block_kv=128)),
    (64, 2, True, 30.0, _overlap(block_q=128, block_kv=64, stages=3)),
    (256, 4, True, 50.0, _overlap(wgs=1)),
])
def test_overlap_lowers_for_h200(head_dim, kv_heads, causal, cap, config):
    q = jax.ShapeDtypeStruct((2, 1024, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, kv_heads, head_dim), jnp.bfloat16)
    op = PallasMosaicGpuFlashAttention(config=config)
    text = _export(lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=causal, logits_soft_cap=cap, implementation=op), q, kv, kv
                   ).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1


@pytest.mark.parametrize("kwargs", [dict(local_window_size=(128, 0)),
                                    dict(key_value_seq_lengths=jnp.array([300, 77]))])
def test_overlap_with_a_window_or_key_lengths_says_why(kwargs):
    q = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    op = PallasMosaicGpuFlashAttention(config=_overlap())
    with pytest.raises(NotImplementedError, match="softmax_overlap=False"):
        _export(lambda q: dot_product_attention(q, q, q, is_causal=True, implementation=op,
                                                **kwargs), q)


def test_overlap_counts_the_probabilities_against_shared_memory():
    """Overlapped, each warpgroup keeps its last P tile in SMEM: d128 with 64 x 128 tiles
    and three stages fits without overlap only when the P tiles are left out."""
    config = MosaicAttentionConfig(block_q=64, block_kv=64, num_stages=4)
    assert fits(config, 1024, 1024, 256) is False  # 64K of Q + 256K of K/V: too much
    two = MosaicAttentionConfig(block_q=64, block_kv=128, num_stages=2)
    assert forward_smem_bytes(_overlap(block_kv=128), 128, 2) == (
        forward_smem_bytes(two, 128, 2) + 2 * 64 * 128 * 2)
    assert fits(_overlap(block_kv=128), 1024, 1024, 128)
    assert fits(_overlap(block_q=128, block_kv=128), 1024, 1024, 64)
    assert not fits(_overlap(block_q=64, block_kv=128, stages=3), 1024, 1024, 256)
    assert common.OVERLAP_LIMITS.startswith("the Mosaic attention forward")


def test_nothing_picks_the_overlap_unasked():
    """Until the device says it wins, heuristics and the search space keep it off."""
    q = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)
    ba = PallasMosaicGpuFlashAttention().bind(q, q, q, is_causal=True)
    assert not ba.heuristics_config.softmax_overlap
    assert not any(c.softmax_overlap for c in ba.autotuning_configs)


def test_a_non_bool_overlap_is_refused():
    with pytest.raises(ValueError, match="softmax_overlap must be a bool"):
        MosaicAttentionConfig(softmax_overlap="yes")
