"""CPU tests of the Mosaic GPU attention forward with a GQA group's query heads in one
block (`MosaicAttentionConfig.group_in_block`): each compute warpgroup runs its own query
head on the block's rows, and the K/V tiles of their shared K/V head stream once.

In GPU interpret mode: numerics against the float32 HIGHEST reference (forward, lse, and
the default backward's gradients of random cotangents) with causal GQA, MQA, a window
with a soft cap, key lengths and the persistent launch; outputs bitwise equal to the
kernel without it (a row's K/V tiles and their order do not depend on the block); the
launch grid; the group check; lowering for an H200. The device's checks and timings:
`tests/gpu/test_mosaic_attention_gpu.py -k group_in_block` and the probe's `group` phase.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from _mosaic_attention_export import export_vjp
from _mosaic_attention_interpreted import (
    assert_forward_variant_bitwise_equal,
    interpreted,
    statics,
)
from conftest import H200
from tokamax_kernels.attention import PallasMosaicGpuFlashAttention
from tokamax_kernels.attention import _mosaic_gpu_fwd_kernel as fwd_kernel
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_pass import core


def _grouped(**fields) -> MosaicAttentionConfig:
    return MosaicAttentionConfig(group_in_block=True, **({"block_kv": 64} | fields))


@pytest.mark.parametrize("shape, causal, window, cap, lengths, config", [
    # GQA causal, longest first: 2 query heads of each K/V head per block.
    pytest.param((2, 256, 256, 4, 2, 64), True, None, None, None,
                 _grouped(longest_first=True), id="gqa-causal"),
    # MQA cross attention, 3 stages, d128: all 4 query heads share the one K/V head.
    pytest.param((2, 128, 384, 4, 1, 128), False, None, None, None,
                 _grouped(num_stages=3), id="mqa-cross-d128", marks=pytest.mark.slow),
    # A causal window with a soft cap: each block's rows start at a different K/V tile.
    pytest.param((2, 256, 256, 4, 2, 64), True, (100, 0), 20.0, None, _grouped(),
                 id="window-cap", marks=pytest.mark.slow),
    # Key lengths (one of 37: most tiles of that batch element never loaded).
    pytest.param((2, 256, 256, 2, 1, 64), True, None, None, (200, 37), _grouped(),
                 id="lengths", marks=pytest.mark.slow),
])
def test_interpreted_matches_reference(shape, causal, window, cap, lengths, config):
    interpreted(shape, statics(causal, window, cap, lengths), config,
                MosaicAttentionVjpConfig(compute_wgs=1), seed=23)


@pytest.mark.parametrize("shape, causal, fields, kwargs", [
    ((2, 256, 256, 4, 2, 64), True, dict(longest_first=True), {}),
    ((2, 128, 256, 4, 1, 64), False, dict(num_stages=3), {}),
    ((2, 256, 256, 2, 1, 64), True, {}, dict(window=(70, 0), soft_cap=30.0)),
    ((2, 256, 256, 2, 1, 64), True, {}, dict(kv_lengths=jnp.array([130, 0], jnp.int32))),
    ((2, 256, 256, 4, 2, 64), True, dict(persistent=True), {}),
    ((2, 256, 256, 4, 2, 64), True, dict(persistent=True, prefetch_query=True), {}),
])
def test_bitwise_equal_to_a_block_per_head(monkeypatch, shape, causal, fields, kwargs):
    """A row's K/V tiles and their order do not depend on which block runs it, so out
    and lse equal the kernel's with a block per query head bit for bit. Persistent, over
    three "SMs"."""
    monkeypatch.setattr(fwd_kernel, "sm_count", lambda: 3)
    assert_forward_variant_bitwise_equal(shape, causal, fields, dict(group_in_block=True),
                                         **kwargs)


def test_the_grid_runs_a_block_per_head_pair():
    """4 query heads over 2 K/V heads, 1024 rows: a block per (head pair, 64 rows)."""
    q = jax.ShapeDtypeStruct((2, 1024, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 64), jnp.bfloat16)

    def launch(config):
        jaxpr = str(jax.make_jaxpr(lambda q, kv: fwd_kernel.mosaic_attention_forward(
            q, kv, kv, scale=0.3, causal=True, config=config))(q, kv))
        return jaxpr[jaxpr.index("grid="):jaxpr.index(", cluster=")]

    with core.targeting(H200):
        assert launch(MosaicAttentionConfig()) == (
            "grid=(4, 8, 2), grid_names=('heads', 'q', 'batch')")
        assert launch(_grouped()) == "grid=(2, 16, 2), grid_names=('heads', 'q', 'batch')"


def test_groups_that_do_not_divide_are_refused():
    """Three query heads a K/V head cannot split over two warpgroups: the op says so
    (`implementation=None` moves on), and the kernel refuses it too."""
    q = jax.ShapeDtypeStruct((2, 256, 6, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    op = PallasMosaicGpuFlashAttention(config=_grouped())
    with core.targeting(H200):
        target = core.current_target()
        with pytest.raises(NotImplementedError, match="group_in_block=False"):
            op.check_supported(op.bind(q, kv, kv), target)
    with pytest.raises(ValueError, match="divisible by compute_wgs"):
        jax.eval_shape(lambda q, kv: fwd_kernel.mosaic_attention_forward(
            q, kv, kv, scale=0.3, causal=False, config=_grouped()), q, kv)
    # One warpgroup runs one head either way.
    op = PallasMosaicGpuFlashAttention(config=_grouped(compute_wgs=1))
    with core.targeting(H200):
        op.check_supported(op.bind(q, kv, kv), target)
    with pytest.raises(ValueError, match="group_in_block must be a bool"):
        MosaicAttentionConfig(group_in_block=1)
    assert dataclasses.replace(_grouped(), group_in_block=False).rows_per_block == 128


@pytest.mark.parametrize("launch", [{}, dict(persistent=True),
                                    dict(persistent=True, prefetch_query=True)])
def test_lowers_for_h200(launch):
    """Causal GQA with the default backward, lowered for an H200."""
    config = _grouped(longest_first=True, **launch)
    exported = export_vjp(MosaicAttentionVjpConfig(), fwd_config=config, causal=True)
    assert exported.mlir_module().count("mosaic_gpu_v2") == 3


@pytest.mark.parametrize("shape, causal", [
    ((4, 4096, 16, 4, 128), True),   # the Llama layer
    ((2, 8192, 8, 4, 256), True),    # Gemma-2's layers
    ((3, 1536, 6, 2, 64), False),    # an unmeasured shape, 3 query heads a K/V head
    ((4, 2048, 16, 16, 128), False),  # MHA: nothing to group
])
def test_group_in_block_is_tuned_where_the_group_divides(shape, causal):
    """The heuristics never group heads (it ran 0.99-1.03x on the H200); the search space
    offers the grouped twin of each config with two warpgroups where the query heads a
    K/V head divide among them, and never otherwise."""
    b, s, h, hk, d = shape
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    with core.targeting(H200):
        ba = PallasMosaicGpuFlashAttention().bind(q, kv, kv, is_causal=causal)
        heuristics, space = ba.heuristics_config, ba.autotuning_configs
    assert not heuristics.group_in_block
    divides = h > hk and (h // hk) % 2 == 0
    assert any(c.group_in_block for c in space) == divides
    for config in space:
        twin = dataclasses.replace(config, group_in_block=not config.group_in_block)
        assert (twin in space) == (divides and config.compute_wgs == 2), config
