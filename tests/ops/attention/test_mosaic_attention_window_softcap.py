"""Logits soft cap and local windows in the Mosaic GPU attention kernels, on CPU.

The forward and both backward kernels run in Pallas's GPU interpret mode
(`_mosaic_attention_interpreted.interpreted`, a few seconds a kernel call at these shapes)
against the float32 HIGHEST reference, forward and gradients, with random cotangents;
they lower for an H200 through `jax.export`; the window's tile ranges are checked against
brute force. On the GPU: `tests/gpu/test_mosaic_attention_gpu.py`.
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
from conftest import H200
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    _window,
    dot_product_attention,
)
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_pass import core

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


def _export(fn, *args):
    with core.targeting(H200):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)


def _mosaic(q, k, v, **kwargs):
    return dot_product_attention(q, k, v, implementation="mosaic", **kwargs)


@pytest.mark.parametrize("head_dim, kv_heads, causal, window, cap", [
    (64, 2, True, (128, 0), 50.0), (128, 4, False, (64, 64), None),
    (128, 1, False, None, 30.0), (64, 4, True, (16, 16), None),
])
def test_gradient_lowers_to_three_mosaic_kernels(head_dim, kv_heads, causal, window, cap):
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
