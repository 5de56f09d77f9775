"""The Mosaic GPU attention kernels on CPU: lowering for an H200, support checks, logits soft
cap and local windows, head dim 256 (numerics in GPU interpret mode at small shapes).

On the device: `tests/gpu/test_mosaic_attention_gpu.py`.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _mosaic_attention_interpreted import interpreted, statics
from conftest import H200, measured
from tokamax_kernels.attention import (
    CudnnDotProductAttention,
    DotProductAttention,
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    _window,
    dot_product_attention,
)
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import pallas_mosaic_gpu_vjp as vjp_module
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_pass import core


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export(fn, *args, device_kind=H200):
    with core.targeting(device_kind):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)


def _mosaic(q, k, v, **kwargs):
    return dot_product_attention(q, k, v, implementation="mosaic", **kwargs)


@pytest.mark.variants
@pytest.mark.parametrize("head_dim,kv_heads,causal", [
    (64, 4, False), (128, 4, True), (256, 4, False), (64, 2, True), (128, 1, False),
])
def test_forward_lowers_to_mosaic_gpu(head_dim, kv_heads, causal):
    q = _sds((2, 256, 4, head_dim))
    kv = _sds((2, 256, kv_heads, head_dim))
    text = _export(lambda q, k, v: _mosaic(q, k, v, is_causal=causal), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1
    assert "tokamax_pass_spec" in text and "PallasMosaicGpuFlashAttention" in text


@pytest.mark.variants
@pytest.mark.parametrize("head_dim,kv_heads,causal", [
    (64, 4, True), (128, 4, False), (64, 2, False), (128, 1, True),
])
def test_gradient_lowers_to_three_mosaic_kernels(head_dim, kv_heads, causal):
    q = _sds((1, 256, 4, head_dim))
    kv = _sds((1, 256, kv_heads, head_dim))

    def loss(q, k, v):
        return _mosaic(q, k, v, is_causal=causal).astype(jnp.float32).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3  # forward, dq, dk/dv
    assert "PallasMosaicGpuFlashAttentionVjp" in text


@pytest.mark.variants
@pytest.mark.parametrize("head_dim", [64, 128])
def test_self_attention_gradient_lowers_to_one_backward_kernel(head_dim):
    """attention(x, x, x): dq + dk + dv come from one kernel (the shared-input VJP)."""
    x = _sds((1, 256, 2, head_dim))

    def loss(x, causal=False):
        return _mosaic(x, x, x, is_causal=causal).astype(jnp.float32).sum()

    text = _export(jax.grad(loss), x).mlir_module()
    assert text.count("mosaic_gpu_v2") == 2  # forward, dx
    assert "shared_inputs" in text
    causal = _export(jax.grad(lambda x: loss(x, causal=True)), x).mlir_module()
    assert causal.count("mosaic_gpu_v2") == 3  # causal keeps dq and dk/dv


def test_shared_kernel_configs_tune_its_own_tiles():
    x = _sds((32, 2048, 16, 64))
    vjp = PallasMosaicGpuFlashAttentionVjp()
    forward = PallasMosaicGpuFlashAttention().bind(x, x, x).arguments
    ba = vjp.bind((_sds((32, 16, 2048), jnp.float32),), x, x,
                  shared_inputs=(("key", "query", "value"),), **forward)
    assert vjp_module.runs_shared_kernel(ba.arguments)
    assert ba.heuristics_config == MosaicAttentionVjpConfig(block_q_dkv=64, block_kv_dkv=64)
    configs = ba.autotuning_configs
    dq_fields = {(c.block_q_dq, c.block_kv_dq) for c in configs}
    assert dq_fields == {(64, 64)} and {c.num_stages for c in configs} == {2, 3}
    assert all(vjp_module.shared_fits(c, 2048, 64) for c in configs)
    assert not vjp_module.runs_shared_kernel({**ba.arguments, "is_causal": True})


@pytest.mark.variants
@pytest.mark.parametrize("lengths", ["query", "key_value", "both"])
def test_sequence_lengths_lower_forward_and_gradient(lengths):
    q, kv = _sds((2, 256, 4, 64)), _sds((2, 256, 2, 64))
    seq_lengths = _sds((2,), jnp.int32)

    def loss(q, k, v, n):
        kwargs = {}
        if lengths in ("query", "both"):
            kwargs["query_seq_lengths"] = n
        if lengths in ("key_value", "both"):
            kwargs["key_value_seq_lengths"] = n
        return _mosaic(q, k, v, is_causal=True, **kwargs).astype(jnp.float32).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seq_lengths).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3


def test_automatic_picks_mosaic_for_h200_where_measured_faster_and_xla_otherwise():
    q = _sds((1, 256, 2, 64))
    f = lambda q: dot_product_attention(q, q, q)
    # Unmeasured: the H200 itself runs the plain path, cuDNN's attention (not one of the
    # tiny calls it loses); from this machine, which cannot lower cuDNN, the export holds
    # the fused kernel in its place and says so.
    with core.targeting(H200):
        (row,) = tokamax.optimize(f).plan(q)
    assert (row.implementation, row.fallback_from) == ("mosaic", "cudnn")
    evidence = measured(H200, {PallasMosaicGpuFlashAttention(): 1.0, DotProductAttention(): 3.0,
                               CudnnDotProductAttention(): 2.0}, q, q, q)
    with evidence:
        text = _export(f, q).mlir_module()
        (row,) = tokamax.optimize(f).plan(q)
    assert "mosaic_gpu_v2" in text and row.fallback_from is None
    mask = _sds((1, 1, 256, 256), jnp.bool_)
    text = _export(lambda q, m: dot_product_attention(q, q, q, mask=m), q, mask).mlir_module()
    assert "mosaic_gpu_v2" not in text


def test_explicit_configs_lower():
    q = _sds((1, 512, 2, 128))
    op = PallasMosaicGpuFlashAttention(
        config=MosaicAttentionConfig(block_q=128, block_kv=64, compute_wgs=1),
        vjp=PallasMosaicGpuFlashAttentionVjp(config=MosaicAttentionVjpConfig(
            block_q_dq=64, block_kv_dq=128, compute_wgs=1)))
    text = _export(jax.grad(lambda q: op(q, q, q, is_causal=True).astype(jnp.float32).sum()),
                   q).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3


@pytest.mark.parametrize("name", ["bias", "mask"])
def test_unsupported_features_raise(name):
    q = _sds((1, 256, 2, 64))
    extra = _sds((1, 2, 256, 256), jnp.bfloat16 if name == "bias" else jnp.bool_)
    with pytest.raises(NotImplementedError, match=name):
        _export(lambda q, x: _mosaic(q, q, q, **{name: x}), q, extra)


@pytest.mark.parametrize("shape,dtype,message", [
    ((1, 256, 2, 64), jnp.float32, "bf16/f16"),
    ((1, 256, 2, 96), jnp.bfloat16, "head dims"),
    ((1, 200, 2, 64), jnp.bfloat16, "multiple"),
])
def test_unsupported_inputs_raise(shape, dtype, message):
    q = _sds(shape, dtype)
    with pytest.raises(NotImplementedError, match=message):
        _export(lambda q: _mosaic(q, q, q), q)


def test_older_gpu_raises():
    q = _sds((1, 256, 2, 64))
    with pytest.raises(NotImplementedError, match="Hopper"):
        _export(lambda q: _mosaic(q, q, q), q, device_kind="NVIDIA A100-SXM4-80GB")


def test_cpu_raises_and_none_falls_back_to_xla():
    q = jax.random.normal(jax.random.key(0), (1, 128, 2, 64), jnp.float32).astype(jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="cuda"):
        _mosaic(q, q, q)
    out = dot_product_attention(q, q, q)
    reference = dot_product_attention(q, q, q, implementation="xla")
    assert jnp.array_equal(out, reference)


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="multiples of 64"):
        MosaicAttentionConfig(block_q=96)
    with pytest.raises(ValueError, match="num_stages"):
        MosaicAttentionVjpConfig(num_stages=1)


def test_heuristics_and_search_space_fit_the_benchmark_shapes():
    for seq, head_dim, causal in ((2048, 64, False), (8192, 128, False), (8192, 128, True),
                                  (4096, 256, False)):
        q = _sds((4, seq, 16, head_dim))
        ba = PallasMosaicGpuFlashAttention().bind(q, q, q, is_causal=causal)
        config = ba.heuristics_config
        assert seq % (config.block_q * config.compute_wgs) == 0
        assert config in ba.autotuning_configs
        # At d256 only 64 x 64 tiles fit SMEM and registers: the heuristics config is the space.
        assert len(ba.autotuning_configs) >= (2 if head_dim < 256 else 1)


def test_one_compute_warpgroup_is_tuned_only_when_two_leave_sms_idle():
    assert common.compute_wg_choices(32 * 16, 2048) == (2,)  # 4096 blocks of 2 x 64 rows
    assert common.compute_wg_choices(4 * 16, 8192, 256) == (1, 2)  # 128 dk/dv blocks
    for batch, heads, wgs in ((32, 16, {2}), (1, 4, {1, 2})):
        q = _sds((batch, 2048, heads, 64))
        configs = PallasMosaicGpuFlashAttention().bind(q, q, q).autotuning_configs
        assert {c.compute_wgs for c in configs} == wgs


def test_negative_scale_lowers():
    """A scale <= 0 cannot ride in the exponent's FMA (the max would flip): its path lowers."""
    q = _sds((1, 256, 2, 64))
    text = _export(lambda q: _mosaic(q, q, q, scale=-0.125, is_causal=True), q).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1


def test_gradient_through_lse_lowers_to_three_mosaic_kernels():
    """`return_residual=True` with lse in the loss: the lse cotangent enters the backward's
    delta (XLA), so the same three kernels run; the VJP call carries `dresiduals`."""
    q = _sds((1, 256, 4, 64))
    kv = _sds((1, 256, 2, 64))

    def loss(q, k, v):
        out, lse = _mosaic(q, k, v, is_causal=True, return_residual=True)
        return out.astype(jnp.float32).sum() + (lse.astype(jnp.float32) ** 2).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3
    assert "PallasMosaicGpuFlashAttentionVjp" in text and "dresiduals" in text


# ------------------------------------------------------------------------------------------
# Logits soft cap and local windows in the Mosaic GPU attention kernels, on CPU.
#
# The forward and both backward kernels run in Pallas's GPU interpret mode
# (`_mosaic_attention_interpreted.interpreted`, a few seconds a kernel call at these shapes)
# against the float32 HIGHEST reference, forward and gradients, with random cotangents;
# they lower for an H200 through `jax.export`; the window's tile ranges are checked against
# brute force. On the GPU: `tests/gpu/test_mosaic_attention_gpu.py`.


Op, Vjp = PallasMosaicGpuFlashAttention, PallasMosaicGpuFlashAttentionVjp
TILES_64 = MosaicAttentionConfig(block_q=64, block_kv=64)


@pytest.mark.parametrize("shape, causal, window, cap, config, vjp_config", [
    # GQA, a window crossing tile edges on both sides, cross attention (Sk = 2 Sq).
    pytest.param((2, 128, 256, 2, 1, 64), False, (40, 7), None, TILES_64,
                 MosaicAttentionVjpConfig(), id="window-gqa", marks=pytest.mark.slow),
    # Causal + window + soft cap: the Gemma-2 case; 128-key backward tiles.
    pytest.param((2, 256, 256, 2, 1, 64), True, (100, 3), 5.0, TILES_64,
                 MosaicAttentionVjpConfig(block_kv_dq=128, block_q_dkv=128), id="gemma2"),
    # Soft cap alone at d128, one compute warpgroup, 128-key forward tiles.
    pytest.param((2, 128, 128, 2, 2, 128), False, None, 3.0,
                 MosaicAttentionConfig(block_q=64, block_kv=128, compute_wgs=1),
                 MosaicAttentionVjpConfig(compute_wgs=1), id="softcap-d128"),
])
def test_interpreted_kernels_match_reference(shape, causal, window, cap, config, vjp_config):
    interpreted(shape, statics(causal, window, cap), config, vjp_config, seed=11)


def test_interpreted_window_smaller_than_a_tile_empties_late_rows():
    """A 6-key window over 128 keys: query rows from 128 + 0 on see no key (zeros, no
    gradient), and each 64-row tile sees one or two of the key tiles."""
    out, grads = interpreted((2, 256, 128, 2, 1, 64), statics(False, (0, 5), None),
                              TILES_64, MosaicAttentionVjpConfig(), seed=21)
    assert not np.any(np.asarray(out[:, 128:], np.float32))
    assert not np.any(np.asarray(grads["query"][:, 128:], np.float32))


def test_interpreted_window_soft_cap_and_key_lengths():
    lengths = jnp.array([200, 77], jnp.int32)
    interpreted((2, 128, 256, 2, 2, 64),
                 statics(False, (30, 30), 2.0, key_value_seq_lengths=lengths),
                 TILES_64, MosaicAttentionVjpConfig(), seed=31)


def _brute_force(window, starts, size, tile, num_tiles, sees):
    """(first, full_first, full_end, end) of the tiles of `size` positions from `starts`."""
    first = full_first = full_end = end = None
    seen = [[sees(p, t * tile + j) for p in range(starts, starts + size) for j in range(tile)]
            for t in range(num_tiles)]
    any_seen = [t for t in range(num_tiles) if any(seen[t])]
    whole = [t for t in range(num_tiles) if all(seen[t])]
    if any_seen:
        first, end = any_seen[0], any_seen[-1] + 1
    if whole:
        full_first, full_end = whole[0], whole[-1] + 1
    return first, full_first, full_end, end


@pytest.mark.parametrize("window", [(0, 0), (5, 3), (40, 7), (100, 0), (0, 130), (300, 300)])
def test_tile_ranges_match_brute_force(window):
    tile, num_tiles, rows = 16, 12, 32
    left, right = window
    for start in range(0, num_tiles * tile, rows):
        for kv_len in (num_tiles * tile, 70):
            def sees(i, j, kv_len=kv_len):
                return i - left <= j <= i + right and j < kv_len

            got = _window.kv_tiles(window, start, rows, tile, num_tiles, kv_len)
            first, full_first, full_end, end = _brute_force(
                window, start, rows, tile, num_tiles, sees)
            got = [int(x) for x in got]
            assert got[3] <= min(num_tiles, -(-kv_len // tile))  # never past the last tile
            if first is None:
                assert got[0] == got[3]  # nothing to visit
                continue
            assert (got[0], got[3]) == (first, end)
            if full_first is not None:
                assert (got[1], got[2]) == (full_first, full_end)
            else:
                assert got[1] == got[2]
            # Tiles are visited once each, in order.
            assert got[0] <= got[1] <= got[2] <= got[3]
        q = _window.q_tiles(window, start, rows, tile, num_tiles)
        first, full_first, full_end, end = _brute_force(
            window, start, rows, tile, num_tiles, lambda j, i: i - left <= j <= i + right)
        q = [int(x) for x in q]
        assert q[3] <= num_tiles
        if first is None:
            assert q[0] == q[3]
            continue
        assert (q[0], q[3]) == (first, end)
        if full_first is not None:
            assert (q[1], q[2]) == (full_first, full_end)


@pytest.mark.parametrize("window", [(0, 0), (0, 5), (40, 7), (100, 0), (0, 130)])
def test_warpgroup_ranges_nest_in_their_blocks(window):
    """A block's ring streams its range; each warpgroup's range lies inside it (its skips
    at either end release tiles the ring did load)."""
    tile, num_tiles, rows, wgs = 64, 3, 64, 2
    for block in range(6):
        for tiles in (_window.kv_tiles, _window.q_tiles):
            outer = [int(x) for x in tiles(window, block * wgs * rows, wgs * rows, tile,
                                           num_tiles)]
            for wg in range(wgs):
                inner = [int(x) for x in tiles(window, (block * wgs + wg) * rows, rows, tile,
                                               num_tiles)]
                assert outer[0] <= inner[0] <= inner[3] <= outer[3] <= num_tiles


def test_a_4096_key_window_over_8192_keys_loads_about_half_the_tiles():
    """What the kernels load: per block of 128 query rows (2 warpgroups x 64), the K/V
    tiles of 128 keys that its rows see."""
    seq, rows, tile = 8192, 128, 128
    num_tiles = seq // tile
    loaded = sum(int(t.end - t.first) for t in (
        _window.kv_tiles((2048, 2047), start, rows, tile, num_tiles)
        for start in range(0, seq, rows)))
    assert 0.4 <= loaded / (num_tiles * seq // rows) <= 0.53  # edges see fewer
    causal = sum(int(t.end - t.first) for t in (
        _window.kv_tiles((4095, 0), start, rows, tile, num_tiles)
        for start in range(0, seq, rows)))
    assert causal / (num_tiles * seq // rows) <= 0.53  # against 1 for full attention


@pytest.mark.variants
@pytest.mark.parametrize("head_dim, kv_heads, causal, window, cap", [
    (64, 2, True, (128, 0), 50.0), (128, 4, False, (64, 64), None),
    pytest.param(128, 1, False, None, 30.0, marks=pytest.mark.slow),
    pytest.param(64, 4, True, (16, 16), None, marks=pytest.mark.slow),
])
def test_window_softcap_gradient_lowers_to_three_mosaic_kernels(
        head_dim, kv_heads, causal, window, cap):
    q, kv = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16), jax.ShapeDtypeStruct(
        (2, 512, kv_heads, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        out = _mosaic(q, k, v, is_causal=causal, local_window_size=window, logits_soft_cap=cap)
        return (out.astype(jnp.float32) ** 2).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3  # forward, dq, dk/dv
    forward = _export(lambda q, k, v: _mosaic(q, k, v, is_causal=causal,
                                              local_window_size=window,
                                              logits_soft_cap=cap), q, kv, kv).mlir_module()
    assert forward.count("mosaic_gpu_v2") == 1


@pytest.mark.parametrize("kwargs", [dict(local_window_size=(64, 64)),
                                    dict(logits_soft_cap=20.0)])
def test_self_attention_with_window_or_cap_takes_the_general_kernels(kwargs):
    """attention(x, x, x) with a window or cap: dq and dk/dv kernels, not the shared one."""
    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    text = _export(jax.grad(lambda x: _mosaic(x, x, x, **kwargs).astype(jnp.float32).sum()),
                   x).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3


def test_small_windows_get_64_key_tiles_and_every_config_fits():
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    narrow = Op().bind(q, q, q, is_causal=True, local_window_size=(32, 0))
    assert narrow.heuristics_config.block_kv == 64
    wide = Op().bind(q, q, q, is_causal=True, local_window_size=(512, 0))
    # The same tiles; only the launch order differs (longest first is measured without
    # a window only).
    assert wide.heuristics_config == dataclasses.replace(
        Op().bind(q, q, q, is_causal=True).heuristics_config, longest_first=False)
    for ba in (narrow, wide):
        vjp = Vjp().bind((jax.ShapeDtypeStruct((2, 8, 1024), jnp.float32),), q, q,
                         **ba.arguments)
        for config in itertools.chain([vjp.heuristics_config], vjp.autotuning_configs):
            Vjp(config=config).check_supported(vjp, core.Target("cuda", H200))


# ------------------------------------------------------------------------------------------
# Head dim 256 in the Mosaic GPU attention backward, on CPU (the Gemma-2 shape of heads).
#
# The dk/dv kernel splits the head dim between two warpgroups sharing their key rows, and
# the dq kernel holds it whole (`compute_wgs=1`) or splits it likewise (`compute_wgs=2`):
# both run in Pallas's GPU interpret mode against the float32 HIGHEST reference, forward
# and gradients with random cotangents, with causal masks, soft cap, local windows, GQA and
# key lengths; every d256 config lowers for an H200 through `jax.export`. On the GPU:
# `tests/gpu/test_mosaic_attention_gpu.py::test_head_dim_256_*`.


Op, Vjp = PallasMosaicGpuFlashAttention, PallasMosaicGpuFlashAttentionVjp
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


_D256_LOWERED = [
    (4, False, None, None, False), (2, True, (256, 0), 50.0, False),
    (1, True, None, 30.0, True), (4, False, (64, 64), None, True),
]


# The split dq at every mask; the whole dq at the two windowed calls, which between them
# hold causal and not, the soft cap, key lengths and GQA (its dq kernel's K/V range and
# masks are the split one's; the plain and MQA calls add nothing the whole dq reads).
@pytest.mark.variants
@pytest.mark.parametrize(("kv_heads", "causal", "window", "cap", "lengths", "vjp_config"), [
    pytest.param(*case, config,
                 id=f"{case[0]}-{case[1]}-window{i}-{case[3]}-{case[4]}-{name}")
    for name, config in (("split-dq", SPLIT_DQ), ("whole-dq", WHOLE_DQ))
    for i, case in enumerate(_D256_LOWERED) if name == "split-dq" or case[2] is not None])
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
