"""The one-pass Mosaic GPU attention backward (`dq_accumulation` "ordered" / "atomic"):
the dk/dv kernel also adds each tile's float32 dq share into global memory.

On CPU: the "atomic" form runs in Pallas's GPU interpret mode (the shim adds TMA
reduce-adds, `_mosaic_gpu_interpret.py`) against the float32 HIGHEST reference with
random cotangents; the interpreter has no global semaphores, so the "ordered" form is
checked by lowering for an H200 (and on the device: `tests/gpu/test_mosaic_attention_gpu.py`,
bitwise reruns included). Also: configs, limits, and that nothing picks it unasked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from _mosaic_attention_export import export_vjp
from _mosaic_attention_interpreted import interpreted, statics
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttentionVjp,
)
from tokamax_kernels.attention import _mosaic_gpu_bwd_kernels as kernels
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import pallas_mosaic_gpu_vjp as vjp_module
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)

TILES_64 = MosaicAttentionConfig(block_q=64, block_kv=64)


def _fused(mode: str = "atomic", **fields) -> MosaicAttentionVjpConfig:
    return MosaicAttentionVjpConfig(dq_accumulation=mode, **fields)


@pytest.mark.parametrize("shape, causal, window, cap, vjp_config", [
    # GQA, causal, two warpgroups splitting dq's columns (d128).
    pytest.param((2, 256, 256, 2, 1, 128), True, None, None, _fused(), id="causal-gqa-columns"),
    # Each warpgroup adds the full width of its own key rows (d64), cross attention.
    pytest.param((2, 128, 256, 2, 2, 64), False, None, None, _fused(dq_split="rows"),
                 id="cross-rows"),
    # Gemma-2 style: causal + window crossing tile edges + soft cap; one warpgroup.
    pytest.param((2, 256, 256, 2, 1, 64), True, (100, 3), 5.0, _fused(compute_wgs=1),
                 id="window-softcap-one-wg", marks=pytest.mark.slow),
])
def test_interpreted_atomic_backward_matches_reference(shape, causal, window, cap, vjp_config):
    interpreted(shape, statics(causal, window, cap), TILES_64, vjp_config, seed=5)


def test_interpreted_atomic_backward_with_key_lengths():
    """Keys past a batch element's length get zero gradients; the query tiles still get
    every key block's (zero or not) share."""
    interpreted((2, 128, 256, 2, 1, 128),
                statics(False, None, None,
                        key_value_seq_lengths=jnp.array([200, 37], jnp.int32)),
                TILES_64, _fused(dq_split="rows"), seed=9)


@pytest.mark.parametrize("mode", ["ordered", "atomic"])
@pytest.mark.parametrize("fields, kwargs", [
    (dict(), dict()),
    (dict(dq_split="rows"), dict(local_window_size=(200, 0), logits_soft_cap=30.0)),
    (dict(compute_wgs=1), dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
])
def test_fused_backward_lowers_to_one_kernel(mode, fields, kwargs):
    """Forward + one backward kernel (the separate form has a dq kernel too)."""
    text = export_vjp(_fused(mode, **fields), **kwargs).mlir_module()
    assert text.count("mosaic_gpu_v2") == 2
    separate = export_vjp(MosaicAttentionVjpConfig(), **kwargs).mlir_module()
    assert separate.count("mosaic_gpu_v2") == 3


def test_configs_are_validated():
    with pytest.raises(ValueError, match="dq_accumulation"):
        MosaicAttentionVjpConfig(dq_accumulation="fast")
    with pytest.raises(ValueError, match="dq_split"):
        MosaicAttentionVjpConfig(dq_split="diagonal")
    with pytest.raises(ValueError, match="one-pass backward only"):
        MosaicAttentionVjpConfig(dq_split="rows")
    assert not MosaicAttentionVjpConfig().fused and _fused("ordered").fused


@pytest.mark.parametrize("head_dim, wgs, split, fits", [
    (128, 2, "columns", True), (64, 2, "columns", False), (64, 2, "rows", True),
    (64, 1, "columns", True), (256, 2, "rows", False),
])
def test_which_head_dims_the_one_pass_takes(head_dim, wgs, split, fits):
    """Column slices must be whole 64-wide `wgmma` tiles; d256 has no room for dq."""
    config = _fused(compute_wgs=wgs, dq_split=split)
    assert vjp_module.fits(config, 512, 512, head_dim) is fits
    assert kernels.fused_fits(head_dim, wgs, split) is fits
    if not fits:
        with pytest.raises(NotImplementedError, match="takes head dims up to 128"):
            export_vjp(config, head_dim=head_dim, causal=False)


def test_every_fused_config_that_fits_stays_in_shared_memory():
    for split in ("columns", "rows"):
        for wgs in (1, 2):
            for bq in (64, 128):
                config = _fused(dq_split=split, compute_wgs=wgs, block_q_dkv=bq)
                if vjp_module.fits(config, 1024, 1024, 128):
                    assert vjp_module.backward_smem_bytes(config, 128) <= common.SMEM_BYTES


@pytest.mark.parametrize("flags, forced", [
    ("", False), ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_dump_to=/tmp --xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=false", False),
])
def test_xla_deterministic_ops_turn_atomic_into_ordered(monkeypatch, flags, forced):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert common.deterministic_ops_forced() is forced
    seen = []
    real = kernels.mosaic_attention_fused_bwd

    def spy(*args, config, **kwargs):
        seen.append(config.dq_accumulation)
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(vjp_module, "mosaic_attention_fused_bwd", spy)
    export_vjp(_fused("atomic"))
    assert seen == ["ordered" if forced else "atomic"]


def test_nothing_picks_the_one_pass_unasked():
    """Measured slower than the separate dq kernel at d128 (and the atomic form is not
    reproducible): neither the heuristics nor the search space hold it."""
    q = jax.ShapeDtypeStruct((2, 2048, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2048, 2, 128), jnp.bfloat16)
    ba = PallasMosaicGpuFlashAttentionVjp().bind(
        (jax.ShapeDtypeStruct((2, 8, 2048), jnp.float32),), q, q, query=q, key=kv, value=kv,
        bias=None, mask=None, scale=0.1, is_causal=True, query_seq_lengths=None,
        key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None,
        precision=None)
    op = PallasMosaicGpuFlashAttentionVjp()
    assert not op._get_heuristics_config(ba).fused
    configs = op._get_autotuning_configs(ba)
    assert configs and not any(c.fused for c in configs)
    assert all(dataclasses.replace(c, dq_accumulation="separate") == c for c in configs)
