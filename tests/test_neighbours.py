"""Which measured shapes stand in for an unmeasured call (`autotuning.neighbours`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tokamax_kernels.attention.base import DotProductAttention, DotProductAttentionVjp
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp
from tokamax_pass.autotuning import keys, neighbours


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_distance_is_finite_only_within_the_ratio_for_every_size():
    assert neighbours.distance((1024, 64), (1024, 64)) == 0
    assert neighbours.distance((1024, 64), (2048, 64)) == 1
    assert neighbours.distance((1024, 64), (2048, 32)) == 2
    assert neighbours.distance((1024, 64), (4096, 64)) == math.inf
    assert neighbours.distance((1024, 64), (1024, 64, 1)) == math.inf
    assert neighbours.distance((0, 64), (1, 64)) == math.inf


def test_norms_compare_rows_by_features_whatever_the_scale_offset_and_split():
    a = keys.similarity(LayerNorm().bind(_sds((4, 4096, 2048)), _sds((2048,), jnp.float32)))
    b = keys.similarity(LayerNorm().bind(_sds((16384, 2048)), _sds((2048,)), _sds((2048,))))
    assert a == b
    rms = keys.similarity(LayerNorm().bind(_sds((16384, 2048)), None, subtract_mean=False))
    assert rms[0] != a[0]  # RMSNorm is another kind of call
    f32 = keys.similarity(LayerNorm().bind(_sds((16384, 2048), jnp.float32), None))
    assert f32[0] != a[0]


def test_a_vjp_compares_as_its_forward_call():
    x, scale = _sds((8, 1024, 512)), _sds((512,), jnp.float32)
    forward = LayerNorm().bind(x, scale)
    mean = _sds((8, 1024), jnp.float32)
    vjp = PallasTritonLayerNormVjp().bind((mean, mean), x, x, x=x, scale=scale, offset=None,
                                          axis=2, epsilon=1e-6, subtract_mean=True)
    assert keys.similarity(vjp)[1] == keys.similarity(forward)[1]


def test_attention_keeps_head_dim_and_group_exact_and_merges_batch_with_heads():
    def sim(b, s, h, kv, d):
        q, k = _sds((b, s, h, d)), _sds((b, s, kv, d))
        return keys.similarity(DotProductAttention().bind(q, k, k, is_causal=True))

    assert sim(4, 4096, 16, 4, 128)[1] == sim(8, 4096, 8, 2, 128)[1]
    assert sim(4, 4096, 16, 4, 128)[0] == sim(8, 4096, 8, 2, 128)[0]
    assert sim(4, 4096, 16, 4, 128)[0] != sim(4, 4096, 16, 4, 64)[0]  # head dim
    assert sim(4, 4096, 16, 4, 128)[0] != sim(4, 4096, 16, 8, 128)[0]  # GQA group
    q = _sds((2, 256, 4, 64))
    forward = DotProductAttention().bind(q, q, q)
    vjp = DotProductAttentionVjp().bind(None, q, q, **forward.arguments)
    assert keys.similarity(vjp)[1] == keys.similarity(forward)[1]


def test_glu_merges_leading_axes():
    w = _sds((2048, 2, 5632))
    a = keys.similarity(GatedLinearUnit().bind(_sds((4, 4096, 2048)), w))
    b = keys.similarity(GatedLinearUnit().bind(_sds((16384, 2048)), w))
    assert a == b
