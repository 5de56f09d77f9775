"""The Mosaic GPU attention backward's kernels on CPU: dk/dv with a block per K/V head, the
one-pass backward (dq accumulated ordered or atomically), the dq kernel that computes the
row term itself (numerics in GPU interpret mode, lowering for an H200).

On the device: `tests/gpu/test_mosaic_attention_gpu.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _mosaic_attention_export import export_vjp
from _mosaic_attention_interpreted import interpreted, statics
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, random_normal
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttentionVjp,
    dot_product_attention,
)
from tokamax_kernels.attention import _mosaic_gpu_bwd_kernels as kernels
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import pallas_mosaic_gpu_vjp as vjp_module
from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
    computes_delta,
    mosaic_attention_dkv,
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

# ------------------------------------------------------------------------------------------
# The Mosaic GPU dk/dv kernel with `group_in_block`: a block per K/V head walks the
# query tiles of every query head of its group, adding dk/dv up in registers and writing
# (B, Sk, Hkv, D) directly (instead of a block per query head and a float32 sum after).
#
# On CPU: numerics in Pallas's GPU interpret mode against the float32 HIGHEST reference
# (GQA, MQA, causal, a window, key lengths, d64/d128/d256), the dk/dv kernel against the
# default one, lowering for an H200, and the config checks. On the device:
# `tests/gpu/test_mosaic_attention_gpu.py` and `benchmarks/probes/gqa_dkv_probe.py`.


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


@pytest.mark.variants
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


def test_gqa_block_configs_are_validated():
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


# ------------------------------------------------------------------------------------------
# The one-pass Mosaic GPU attention backward (`dq_accumulation` "ordered" / "atomic"):
# the dk/dv kernel also adds each tile's float32 dq share into global memory.
#
# On CPU: the "atomic" form runs in Pallas's GPU interpret mode (the shim adds TMA
# reduce-adds, `_mosaic_gpu_interpret.py`) against the float32 HIGHEST reference with
# random cotangents; the interpreter has no global semaphores, so the "ordered" form is
# checked by lowering for an H200 (and on the device: `tests/gpu/test_mosaic_attention_gpu.py`,
# bitwise reruns included). Also: configs, limits, and that nothing picks it unasked.


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


_FUSED_LOWERED = [
    (dict(), dict()),
    (dict(dq_split="rows"), dict(local_window_size=(200, 0), logits_soft_cap=30.0)),
    (dict(compute_wgs=1), dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
]


@functools.cache
def _separate_kernels(case: int) -> int:
    """Mosaic kernels in the separate backward's program for `_FUSED_LOWERED[case]`'s
    call (exported once, shared by both accumulation modes' cases)."""
    kwargs = _FUSED_LOWERED[case][1]
    return export_vjp(MosaicAttentionVjpConfig(), **kwargs).mlir_module().count("mosaic_gpu_v2")


@pytest.mark.variants
@pytest.mark.parametrize("mode", ["ordered", pytest.param("atomic", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fields, kwargs", [
    pytest.param(*case, id=f"fields{i}-kwargs{i}") for i, case in enumerate(_FUSED_LOWERED)])
def test_fused_backward_lowers_to_one_kernel(mode, fields, kwargs):
    """Forward + one backward kernel (the separate form has a dq kernel too)."""
    text = export_vjp(_fused(mode, **fields), **kwargs).mlir_module()
    assert text.count("mosaic_gpu_v2") == 2
    case = next(i for i, c in enumerate(_FUSED_LOWERED) if c[0] == fields)
    assert _separate_kernels(case) == 3


def test_fused_dq_configs_are_validated():
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
def test_xla_deterministic_ops_are_read_from_the_flags(monkeypatch, flags, forced):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert common.deterministic_ops_forced() is forced


# What the flag does to the lowered backward, forced and not (every spelling's reading is
# `test_xla_deterministic_ops_are_read_from_the_flags`).
@pytest.mark.parametrize("flags, forced", [
    ("", False), ("--xla_gpu_deterministic_ops=true", True),
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


# ------------------------------------------------------------------------------------------
# The dq kernel that computes the backward's row term itself
# (`mosaic_attention_dq_and_delta`): delta against the float32 sum of `out * dout`, dq
# bitwise equal to the dq kernel fed that delta, in GPU interpret mode on CPU (GQA causal,
# key lengths, a window with a soft cap, one warpgroup); the VJP runs it (no row-term
# pass) except where it does not: the lse's cotangent, head dim 256, the one pass; its
# SMEM counted; head dim 256 refused.


V = MosaicAttentionVjpConfig


@pytest.mark.variants
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


@pytest.mark.variants
@pytest.mark.parametrize("head_dim, through_lse, config, delta_pass", [
    (128, False, None, False),
    (64, False, V(compute_wgs=1), False),
    (128, True, None, True),
    (256, False, V(compute_wgs=2), True),
    (256, False, V(compute_wgs=1), True),
    (128, False, V(dq_accumulation="ordered"), True),
])
def test_the_gradient_runs_the_delta_pass_only_where_needed(head_dim, through_lse, config,
                                                           delta_pass):
    text = _gradient_text(head_dim, through_lse=through_lse, config=config)
    assert text.count("mosaic_gpu_v2") == (2 if config and config.fused else 3)
    assert ("attention_delta" in text) == delta_pass
