"""CPU tests of the persistent Mosaic GPU attention forward (`MosaicAttentionConfig.
persistent`): one block per SM walks a sequence of tiles (`_mosaic_gpu_tile_order`),
its K/V ring and barriers carried from tile to tile.

In GPU interpret mode with three "SMs" (so every block runs several tiles, the ring
wrapping across tile boundaries at different offsets): numerics against the float32
HIGHEST reference (forward, lse, and the default backward's gradients of random
cotangents) with causal masks, GQA, a window with a soft cap, key lengths, the softmax
overlap, d256 and the next tile's Q prefetched (`prefetch_query`); outputs bitwise equal
to the grid-launched kernel, with and without the prefetch; the tile order as
a permutation with whole L2 sections; the balanced schedule's table and its finishing
times against round robin; lowering for an H200. The device's own checks and
timings: `tests/gpu/test_mosaic_attention_gpu.py -k persistent` and the probe's
`persistent` phase.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
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
from tokamax_kernels.attention import _mosaic_gpu_tile_order as tile_order_module
from tokamax_kernels.attention._mosaic_gpu_common import (
    SMEM_BYTES,
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_kernels.attention._mosaic_gpu_tile_order import (
    L2_BUDGET_BYTES,
    TILE_OVERHEAD_STEPS,
    TileOrder,
    balanced_schedule,
    tile_order,
)
from tokamax_kernels.attention.pallas_mosaic_gpu import forward_smem_bytes
from tokamax_pass import core

SMS = 3  # blocks of the persistent grid in these tests: each walks several tiles


@pytest.fixture
def three_sms(monkeypatch):
    monkeypatch.setattr(fwd_kernel, "sm_count", lambda: SMS)


def _persistent(**fields) -> MosaicAttentionConfig:
    return MosaicAttentionConfig(persistent=True, **({"block_kv": 64} | fields))


@pytest.mark.parametrize("shape, causal, window, cap, lengths, config", [
    # GQA causal, longest first: 8 tiles over 3 blocks, 1-4 K/V tiles each.
    pytest.param((2, 256, 256, 4, 2, 64), True, None, None, None,
                 _persistent(longest_first=True), id="gqa-causal-longest-first"),
    # Cross attention, three stages (the ring wraps at a different tile each time).
    pytest.param((2, 128, 384, 2, 1, 64), False, None, None, None,
                 _persistent(num_stages=3, compute_wgs=1), id="mqa-cross-3-stages"),
    # A causal window with a soft cap: tiles start and end at different K/V tiles.
    pytest.param((2, 256, 256, 2, 2, 64), True, (100, 0), 20.0, None, _persistent(),
                 id="window-cap", marks=pytest.mark.slow),
    # Key lengths (one of 37: most tiles of that batch element never loaded).
    pytest.param((2, 256, 256, 2, 1, 128), True, None, None, (200, 37), _persistent(),
                 id="lengths-d128"),
    # The next tile's Q prefetched: GQA causal, and a batch element with no keys (its
    # tiles compute no K/V step, so they prefetch after the loop).
    pytest.param((2, 256, 256, 4, 2, 64), True, None, None, None,
                 _persistent(longest_first=True, prefetch_query=True), id="prefetch-gqa"),
    pytest.param((2, 256, 256, 2, 1, 64), True, None, None, (200, 0),
                 _persistent(prefetch_query=True), id="prefetch-empty-lengths"),
    pytest.param((2, 256, 256, 2, 2, 64), True, (100, 0), 20.0, None,
                 _persistent(prefetch_query=True), id="prefetch-window-cap",
                 marks=pytest.mark.slow),
    pytest.param((2, 256, 256, 2, 1, 64), True, None, None, None,
                 _persistent(softmax_overlap=True), id="softmax-overlap",
                 marks=pytest.mark.slow),
    pytest.param((2, 128, 128, 2, 1, 256), False, None, None, None,
                 _persistent(compute_wgs=1), id="d256", marks=pytest.mark.slow),
])
def test_interpreted_matches_reference(three_sms, shape, causal, window, cap, lengths,
                                       config):
    interpreted(shape, statics(causal, window, cap, lengths), config,
                MosaicAttentionVjpConfig(compute_wgs=1), seed=11)


@pytest.mark.parametrize("shape, causal, fields, kwargs", [
    ((2, 256, 256, 4, 2, 64), True, dict(longest_first=True), {}),
    ((2, 128, 256, 2, 2, 64), False, dict(num_stages=3), {}),
    ((2, 256, 256, 2, 1, 64), True, dict(compute_wgs=1),
     dict(window=(70, 0), soft_cap=30.0)),
    ((2, 256, 256, 2, 1, 64), True, {}, dict(kv_lengths=jnp.array([130, 0], jnp.int32))),
    # A window over a batch element with no keys: its tiles compute no K/V step.
    ((2, 256, 256, 2, 1, 64), True, {},
     dict(window=(70, 0), kv_lengths=jnp.array([200, 0], jnp.int32))),
])
@pytest.mark.parametrize("prefetch", [False, True])
def test_bitwise_equal_to_the_grid(three_sms, shape, causal, fields, kwargs, prefetch):
    """A tile's work does not depend on which block runs it, after which tile, or which
    of two Q buffers it uses: out and lse equal the grid-launched kernel's bit for bit."""
    assert_forward_variant_bitwise_equal(
        shape, causal, fields, dict(persistent=True, prefetch_query=prefetch), **kwargs)


@pytest.mark.parametrize("order", [
    TileOrder(batch=2, heads=6, num_q_blocks=5, pairs_per_section=4, reverse_q=True),
    TileOrder(batch=3, heads=4, num_q_blocks=2, pairs_per_section=1, reverse_q=False),
    TileOrder(batch=1, heads=8, num_q_blocks=7, pairs_per_section=8, reverse_q=True),
])
def test_tile_order_visits_every_tile_once(order):
    tiles = jnp.arange(order.num_tiles, dtype=jnp.int32)
    b, h, qi = (np.asarray(x) for x in jax.vmap(order.coordinates)(tiles))
    seen = set(zip(b.tolist(), h.tolist(), qi.tolist(), strict=True))
    assert len(seen) == order.num_tiles
    assert b.max() < order.batch and h.max() < order.heads and qi.max() < order.num_q_blocks
    pair = b * order.heads + h
    section_tiles = order.pairs_per_section * order.num_q_blocks
    for start in range(0, order.num_tiles, section_tiles):
        # A section holds whole (batch, head) pairs, each with all its query blocks.
        pairs = pair[start:start + section_tiles]
        assert len(set(pairs.tolist())) == order.pairs_per_section
        blocks = qi[start:start + section_tiles]
        # Query blocks in rounds: longest (last) first when reversed.
        rounds = blocks.reshape(order.num_q_blocks, order.pairs_per_section)
        assert (rounds == rounds[:, :1]).all()
        want = np.arange(order.num_q_blocks)
        np.testing.assert_array_equal(rounds[:, 0], want[::-1] if order.reverse_q else want)


def test_tile_order_sections_fit_the_l2_budget():
    # b4 s8192 d128 bf16: 4 MiB of K/V per head, so 8 heads a section.
    assert tile_order(4, 16, 16, 32, 8192, 128, 2, reverse_q=False).pairs_per_section == 8
    # GQA with 4 query heads a K/V head: 1 MiB per query head, 32 a section.
    assert tile_order(4, 32, 8, 16, 8192, 128, 2, reverse_q=True).pairs_per_section == 32
    # Sections divide the pairs: 3 x 5 pairs under a budget of 8 -> 5.
    order = tile_order(3, 5, 5, 4, 8192, 128, 2, reverse_q=False)
    assert order.pairs_per_section == 5
    # A head too large for the budget still gets a section of its own.
    assert tile_order(2, 2, 2, 4, 1 << 20, 256, 2, reverse_q=False).pairs_per_section == 1
    for args in [(4, 16, 16, 32, 8192, 128, 2), (7, 3, 1, 8, 4096, 64, 2)]:
        order = tile_order(*args, reverse_q=False)
        pair_bytes = 2 * args[4] * args[5] * args[6] * args[2] / args[1]
        assert order.pairs_per_section * pair_bytes <= max(L2_BUDGET_BYTES, pair_bytes)
        assert (order.batch * order.heads) % order.pairs_per_section == 0


def _causal_steps(order: TileOrder, rows: int, block_kv: int) -> tuple[int, ...]:
    """K/V steps of each query block of a causal forward (`rows` query rows a block)."""
    return tuple(-(-(qi + 1) * rows // block_kv) for qi in range(order.num_q_blocks))


def _finish(order: TileOrder, steps, owner_runs) -> np.ndarray:
    """Each block's summed tile cost (`owner_runs`: the flat tiles each block walks)."""
    cost = np.asarray(steps)[order.query_blocks()] + TILE_OVERHEAD_STEPS
    return np.array([cost[run].sum() for run in owner_runs])


@pytest.mark.parametrize("shape, blocks", [
    ((4, 16, 16, 4096), 132),  # MHA b4 s4096 d128: round robin ends 15% late
    ((4, 16, 4, 4096), 132),   # the Llama layer
    ((16, 32, 8, 1024), 132),
    ((2, 6, 2, 1024), 3),
])
def test_balanced_schedule_walks_every_tile_once_and_evens_the_blocks(shape, blocks):
    batch, heads, kv_heads, seq = shape
    order = tile_order(batch, heads, kv_heads, seq // 128, seq, 128, 2, reverse_q=True)
    steps = _causal_steps(order, 128, 128)
    table = balanced_schedule(order, steps, blocks)
    offsets, tiles = table[:blocks + 1], table[blocks + 1:]
    assert table.dtype == np.int32 and offsets[0] == 0 and offsets[-1] == order.num_tiles
    assert (np.diff(offsets) >= 1).all()
    np.testing.assert_array_equal(np.sort(tiles), np.arange(order.num_tiles))
    runs = [tiles[offsets[j]:offsets[j + 1]] for j in range(blocks)]
    assert all((np.diff(run) > 0).all() for run in runs), "a block walks the flat order"
    balanced = _finish(order, steps, runs)
    robin = _finish(order, steps, [np.arange(j, order.num_tiles, blocks)
                                   for j in range(blocks)])
    assert balanced.sum() == robin.sum()
    even = balanced.sum() / blocks
    # List scheduling ends at most one tile after an even split, and never after round robin.
    longest = max(steps) + TILE_OVERHEAD_STEPS
    assert balanced.max() <= even + longest and balanced.max() <= robin.max()
    if shape == (4, 16, 16, 4096):
        assert balanced.max() < 1.02 * even < robin.max() / 1.1


def test_balanced_schedule_is_left_to_round_robin_where_it_cannot_help(monkeypatch):
    order = tile_order(4, 16, 16, 32, 4096, 128, 2, reverse_q=False)
    assert balanced_schedule(order, (32,) * 32, 132) is None  # every tile alike
    steps = _causal_steps(order, 128, 128)
    assert balanced_schedule(order, steps, 132) is not None
    monkeypatch.setattr(tile_order_module, "MAX_SCHEDULED_TILES", order.num_tiles - 1)
    assert balanced_schedule(order, steps, 132) is None  # the table would be too large


@pytest.mark.parametrize("head_dim, causal, kwargs", [
    (128, True, {}),
    (64, False, dict(local_window_size=(200, 0), logits_soft_cap=30.0)),
    (256, False, dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
])
@pytest.mark.parametrize("prefetch", [False, True])
def test_lowers_for_h200(head_dim, causal, kwargs, prefetch):
    """The persistent forward with the default backward, lowered for an H200 (16 tiles,
    so 16 blocks), with and without the Q prefetch."""
    config = _persistent(compute_wgs=1 if head_dim == 256 else 2, longest_first=True,
                         prefetch_query=prefetch)
    exported = export_vjp(MosaicAttentionVjpConfig(), fwd_config=config, head_dim=head_dim,
                          causal=causal, **kwargs)
    assert exported.mlir_module().count("mosaic_gpu_v2") == 3


@pytest.mark.parametrize("batch, grid", [(2, "(64,)"), (8, "(132,)")])
def test_the_grid_is_one_block_per_sm_at_most(batch, grid):
    """Persistent, the kernel launches min(tiles, SMs) blocks over a flat "sm" axis:
    4 heads x 8 query blocks x `batch` tiles against the H200's 132 SMs."""
    q = jax.ShapeDtypeStruct((batch, 1024, 4, 64), jnp.bfloat16)

    def launch(config):
        jaxpr = str(jax.make_jaxpr(lambda q: fwd_kernel.mosaic_attention_forward(
            q, q, q, scale=0.3, causal=True, config=config))(q))
        return jaxpr[jaxpr.index("grid="):jaxpr.index(", cluster=")]

    with core.targeting(H200):
        assert launch(MosaicAttentionConfig()) == (
            f"grid=(4, 8, {batch}), grid_names=('heads', 'q', 'batch')")
        assert launch(MosaicAttentionConfig(persistent=True)) == (
            f"grid={grid}, grid_names=('sm',)")


def test_config_is_validated():
    with pytest.raises(ValueError, match="persistent must be a bool"):
        MosaicAttentionConfig(persistent=1)
    assert MosaicAttentionConfig().persistent is False
    assert dataclasses.replace(MosaicAttentionConfig(), persistent=True).persistent


@pytest.mark.parametrize("shape, causal, window, launched", [
    ((4, 4096, 16, 4, 128), True, None, True),    # the Llama layer (GQA d128)
    ((16, 1024, 32, 8, 128), True, None, True),   # GQA d128, an unbenchmarked shape
    ((4, 4096, 16, 16, 128), True, None, True),   # causal MHA d128: balanced schedule
    ((3, 1536, 6, 6, 128), False, (300, 0), True),  # a window: tiles of two lengths
    ((4, 4096, 16, 16, 128), False, None, False),  # MHA d128, no mask: the grid won
    ((32, 2048, 16, 16, 64), False, None, False),  # d64: two 128 x 128 blocks fit an SM
    ((8, 2048, 16, 4, 64), True, None, True),     # causal d64: prefetching won anyway
    ((6, 1536, 8, 8, 64), True, None, True),      # causal MHA d64, an unmeasured shape
    ((2, 8192, 8, 4, 256), True, None, False),    # Gemma-2's d256 GQA: the grid won
    ((3, 1536, 6, 2, 128), False, None, True),    # an unmeasured GQA shape
])
def test_persistent_where_measured_and_tuned_where_a_block_fills_an_sm(shape, causal,
                                                                        window, launched):
    """The heuristics launch persistent, prefetching the next tile's Q, at head dim <= 128
    where the tiles differ in length (causal, a window) or share K/V (GQA/MQA) with a
    block that fills an SM: where it ran 1.004-1.237x the grid on the H200; never at MHA
    without a mask, d64's two blocks an SM without a mask, or d256. The search space
    offers the persistent twin of each config whose block takes over half the SMEM, and
    at head dim <= 128 of every config where the tiles differ in length; the twin
    prefetches where the second Q buffer fits."""
    b, s, h, hk, d = shape
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    with core.targeting(H200):
        ba = PallasMosaicGpuFlashAttention().bind(q, kv, kv, is_causal=causal,
                                                  local_window_size=window)
        heuristics, space = ba.heuristics_config, ba.autotuning_configs
    assert heuristics.persistent == launched
    assert heuristics.prefetch_query == launched  # 64 x 128 tiles: both Q buffers fit
    assert any(c.persistent for c in space), "every shape here offers persistent configs"
    uneven = causal or window is not None
    for config in space:
        grid = dataclasses.replace(config, persistent=False, prefetch_query=False)
        assert grid in space, config
        prefetching = dataclasses.replace(grid, persistent=True, prefetch_query=True)
        prefetch_fits = forward_smem_bytes(prefetching, d, 2) <= SMEM_BYTES
        twin = prefetching if prefetch_fits else dataclasses.replace(grid, persistent=True)
        offered = 2 * forward_smem_bytes(grid, d, 2) > SMEM_BYTES or (uneven and d <= 128)
        assert (twin in space) == offered, config
        assert config in (grid, twin), config


@pytest.mark.parametrize("fields, head_dim, smem", [
    (dict(), 128, 2 * 64 * (128 * 2 + 4) + 2 * 2 * 128 * 128 * 2),
    (dict(persistent=True, prefetch_query=True), 128,
     2 * 2 * 64 * (128 * 2 + 4) + 2 * 2 * 128 * 128 * 2),
    (dict(block_q=128, num_stages=3, persistent=True, prefetch_query=True), 64,
     2 * 2 * 128 * (64 * 2 + 4) + 2 * 3 * 128 * 64 * 2),
])
def test_forward_smem_counts_both_query_buffers(fields, head_dim, smem):
    """Each warpgroup's Q tile and lse, twice with the prefetch, and the K/V ring."""
    assert forward_smem_bytes(MosaicAttentionConfig(**fields), head_dim, 2) == smem


def test_prefetch_needs_a_persistent_launch():
    with pytest.raises(ValueError, match="set persistent=True, or prefetch_query=False"):
        MosaicAttentionConfig(prefetch_query=True)
    with pytest.raises(ValueError, match="prefetch_query must be a bool"):
        MosaicAttentionConfig(persistent=True, prefetch_query=1)
