"""The Mosaic GPU dk/dv kernel with `group_in_block`: a block per K/V head walks the
query tiles of every query head of its group, adding dk/dv up in registers and writing
(B, Sk, Hkv, D) directly (instead of a block per query head and a float32 sum after).

On CPU: numerics in Pallas's GPU interpret mode against the float32 HIGHEST reference
(GQA, MQA, causal, a window, key lengths, d64/d128/d256), the dk/dv kernel against the
default one, lowering for an H200, and the config checks. On the device:
`tests/gpu/test_mosaic_attention_gpu.py` and `tests/gpu/gqa_dkv_probe.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _mosaic_attention_export import export_vjp
from _mosaic_attention_interpreted import interpreted, statics
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, random_normal
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttentionVjp,
)
from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import mosaic_attention_dkv
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_pass import core

TILES_64 = MosaicAttentionConfig(block_q=64, block_kv=64)


def _in_block(**fields) -> MosaicAttentionVjpConfig:
    return MosaicAttentionVjpConfig(group_in_block=True, **fields)


@pytest.mark.parametrize("shape, causal, window, vjp_config", [
    # GQA (2 query heads per K/V head), causal, two warpgroups, 3-slot ring: the step
    # count runs on across heads (a slot per tile index would reuse slots wrongly).
    pytest.param((2, 256, 256, 4, 2, 64), True, None, _in_block(num_stages=3),
                 id="gqa-causal-d64"),
    # MQA (3 query heads on one K/V head), d128, one warpgroup, cross attention.
    pytest.param((2, 128, 256, 3, 1, 128), False, None, _in_block(compute_wgs=1),
                 id="mqa-cross-d128", marks=pytest.mark.slow),
    # A window crossing tile edges: skipped tiles still take their ring steps.
    pytest.param((2, 256, 256, 4, 2, 64), True, (100, 3), _in_block(compute_wgs=1),
                 id="gqa-window-d64", marks=pytest.mark.slow),
    # d256: two warpgroups split the head dim of shared key rows.
    pytest.param((2, 128, 128, 2, 1, 256), True, None, _in_block(),
                 id="gqa-causal-d256"),
])
def test_interpreted_backward_matches_reference(shape, causal, window, vjp_config):
    interpreted(shape, statics(causal, window, None), TILES_64, vjp_config, seed=11)


def test_interpreted_backward_with_key_lengths():
    """Keys past a batch element's length get zero gradients from every head."""
    interpreted((2, 128, 256, 4, 2, 64),
                statics(False, None, None,
                        key_value_seq_lengths=jnp.array([200, 37], jnp.int32)),
                TILES_64, _in_block(), seed=3)


def test_dkv_matches_the_per_query_head_kernel():
    """Against the default kernel (one bf16 share per query head, summed in float32
    after): the same sums up to the shares' rounding."""
    b, s, h, hk, d = 2, 128, 4, 1, 64
    q, do = (random_normal(i, (b, s, h, d), jnp.bfloat16) for i in (1, 2))
    k, v = (random_normal(i, (b, s, hk, d), jnp.bfloat16) for i in (3, 4))
    lse = random_normal(5, (b, h, s)) + 6.0
    delta = random_normal(6, (b, h, s))
    kwargs = dict(scale=0.3, causal=True)
    with interpret_mode():
        want = mosaic_attention_dkv(q, k, v, do, lse, delta, config=MosaicAttentionVjpConfig(),
                                    **kwargs)
        got = mosaic_attention_dkv(q, k, v, do, lse, delta, config=_in_block(), **kwargs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (b, s, hk, d) and g.dtype == jnp.bfloat16
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=2e-2 * np.abs(w).max())


@pytest.mark.parametrize("fields, head_dim, kv_heads, kwargs", [
    (dict(), 128, 2, dict()),
    (dict(compute_wgs=1, num_stages=3), 64, 1, dict(local_window_size=(200, 0))),
    (dict(), 256, 2, dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
])
def test_backward_lowers_without_the_group_sum(fields, head_dim, kv_heads, kwargs):
    """Forward, dq and dk/dv kernels; dk/dv come out per K/V head (no reduction after)."""
    exported = export_vjp(_in_block(**fields), head_dim=head_dim, kv_heads=kv_heads,
                            **kwargs)
    text = exported.mlir_module()
    assert text.count("mosaic_gpu_v2") == 3
    assert "stablehlo.reduce" not in text.split("mosaic_gpu_v2")[-1]
    default = export_vjp(MosaicAttentionVjpConfig(**fields), head_dim=head_dim,
                           kv_heads=kv_heads, **kwargs).mlir_module()
    assert "stablehlo.reduce" in default.split("mosaic_gpu_v2")[-1]


@pytest.mark.parametrize("kv_heads, same", [(4, True), (2, False)])
def test_one_query_head_per_kv_head_is_the_default_kernel(kv_heads, same):
    """group == 1: the option traces the very same dk/dv program (kernel and all)."""
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, kv_heads, 64), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((2, 4, 256), jnp.float32)

    def program(config):
        return str(jax.make_jaxpr(lambda *args: mosaic_attention_dkv(
            *args, scale=0.3, causal=True, config=config))(q, kv, kv, q, vec, vec))

    assert (program(_in_block()) == program(MosaicAttentionVjpConfig())) is same


def test_configs_are_validated():
    with pytest.raises(ValueError, match="group_in_block runs with the separate dq kernel"):
        MosaicAttentionVjpConfig(group_in_block=True, dq_accumulation="ordered")
    with pytest.raises(ValueError, match="dq_accumulation='separate'"):
        MosaicAttentionVjpConfig(group_in_block=True, dq_accumulation="atomic")
    with pytest.raises(ValueError, match="group_in_block must be a bool"):
        MosaicAttentionVjpConfig(group_in_block=1)
    assert not MosaicAttentionVjpConfig().group_in_block


def _vjp_call(b, s, h, hk, d):
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    return PallasMosaicGpuFlashAttentionVjp().bind(
        (jax.ShapeDtypeStruct((b, h, s), jnp.float32),), q, q, query=q, key=kv, value=kv,
        bias=None, mask=None, scale=0.1, is_causal=True, query_seq_lengths=None,
        key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None,
        precision=None)


@pytest.mark.parametrize("shape, chosen", [
    pytest.param((4, 4096, 16, 4, 128), True, id="llama-512-blocks"),
    pytest.param((2, 8192, 8, 4, 256), True, id="gemma2-d256-1024-blocks"),
    pytest.param((4, 4096, 16, 1, 128), False, id="mqa-128-blocks"),
    pytest.param((2, 2048, 8, 2, 128), False, id="small-gqa-64-blocks"),
    pytest.param((4, 4096, 16, 16, 128), False, id="mha"),
])
def test_heuristics_and_search_space_take_it_where_its_blocks_fill_the_gpu(shape, chosen):
    """Measured on the H200: 512-1024 dk/dv blocks won, MQA's 128 lost (0.73x)."""
    op = PallasMosaicGpuFlashAttentionVjp()
    with core.targeting(H200):
        ba = _vjp_call(*shape)
        assert op._get_heuristics_config(ba).group_in_block is chosen
        configs = op._get_autotuning_configs(ba)
    assert configs and all(not c.group_in_block for c in configs if not chosen)
    assert any(c.group_in_block for c in configs) is chosen
