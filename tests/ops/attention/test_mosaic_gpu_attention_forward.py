"""The Mosaic GPU attention forward's schedules on CPU: persistent, a GQA group's query heads in
one block, intra-warpgroup softmax overlap, causal blocks longest first (numerics in GPU
interpret mode, lowering for an H200).

On the device: `tests/gpu/test_mosaic_attention_gpu.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _mosaic_attention_export import export_vjp
from _mosaic_attention_interpreted import (
    assert_forward_variant_bitwise_equal,
    interpreted,
    statics,
)
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, random_normal
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    dot_product_attention,
)
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import _mosaic_gpu_fwd_kernel as fwd_kernel
from tokamax_kernels.attention import _mosaic_gpu_tile_order as tile_order_module
from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
    mosaic_attention_dkv,
    mosaic_attention_dq,
    mosaic_attention_fused_bwd,
)
from tokamax_kernels.attention._mosaic_gpu_common import (
    SMEM_BYTES,
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward
from tokamax_kernels.attention._mosaic_gpu_tile_order import (
    L2_BUDGET_BYTES,
    TILE_OVERHEAD_STEPS,
    TileOrder,
    balanced_schedule,
    tile_order,
)
from tokamax_kernels.attention.pallas_mosaic_gpu import fits, forward_smem_bytes
from tokamax_pass import core

# ------------------------------------------------------------------------------------------
# CPU tests of the persistent Mosaic GPU attention forward (`MosaicAttentionConfig.
# persistent`): one block per SM walks a sequence of tiles (`_mosaic_gpu_tile_order`),
# its K/V ring and barriers carried from tile to tile.
#
# In GPU interpret mode with three "SMs" (so every block runs several tiles, the ring
# wrapping across tile boundaries at different offsets): numerics against the float32
# HIGHEST reference (forward, lse, and the default backward's gradients of random
# cotangents) with causal masks, GQA, a window with a soft cap, key lengths, the softmax
# overlap, d256 and the next tile's Q prefetched (`prefetch_query`); outputs bitwise equal
# to the grid-launched kernel, with and without the prefetch; the tile order as
# a permutation with whole L2 sections; the balanced schedule's table and its finishing
# times against round robin; lowering for an H200. The device's own checks and
# timings: `tests/gpu/test_mosaic_attention_gpu.py -k persistent` and the probe's
# `persistent` phase.


SMS = 3  # blocks of the persistent grid in these tests: each walks several tiles


@pytest.fixture
def three_sms(monkeypatch):
    monkeypatch.setattr(fwd_kernel, "sm_count", lambda: SMS)


def _persistent(**fields) -> MosaicAttentionConfig:
    return MosaicAttentionConfig(persistent=True, **({"block_kv": 64} | fields))


@pytest.mark.variants
@pytest.mark.parametrize("shape, causal, window, cap, lengths, config", [
    # The next tile's Q prefetched, key lengths, and a batch element with no keys (its
    # tiles compute no K/V step, so they prefetch after the loop): CI's case.
    pytest.param((2, 256, 256, 2, 1, 64), True, None, None, (200, 0),
                 _persistent(prefetch_query=True), id="prefetch-empty-lengths"),
    # Cross attention, three stages (the ring wraps at a different tile each time).
    pytest.param((2, 128, 384, 2, 1, 64), False, None, None, None,
                 _persistent(num_stages=3, compute_wgs=1), id="mqa-cross-3-stages"),
    # A causal window with a soft cap: tiles start and end at different K/V tiles.
    pytest.param((2, 256, 256, 2, 2, 64), True, (100, 0), 20.0, None, _persistent(),
                 id="window-cap", marks=pytest.mark.slow),
    # Key lengths (one of 37: most tiles of that batch element never loaded).
    pytest.param((2, 256, 256, 2, 1, 128), True, None, None, (200, 37), _persistent(),
                 id="lengths-d128"),
    # The next tile's Q prefetched: GQA causal, longest first (8 tiles over 3 blocks,
    # 1-4 K/V tiles each). The same GQA call without the prefetch is bitwise equal to
    # the grid (`test_bitwise_equal_to_the_grid[False-shape0-...]`),
    # whose numerics the grid's own interpreted tests check.
    pytest.param((2, 256, 256, 4, 2, 64), True, None, None, None,
                 _persistent(longest_first=True, prefetch_query=True), id="prefetch-gqa"),
    pytest.param((2, 256, 256, 2, 2, 64), True, (100, 0), 20.0, None,
                 _persistent(prefetch_query=True), id="prefetch-window-cap",
                 marks=pytest.mark.slow),
    pytest.param((2, 256, 256, 2, 1, 64), True, None, None, None,
                 _persistent(softmax_overlap=True), id="softmax-overlap",
                 marks=pytest.mark.slow),
    pytest.param((2, 128, 128, 2, 1, 256), False, None, None, None,
                 _persistent(compute_wgs=1), id="d256", marks=pytest.mark.slow),
])
def test_persistent_interpreted_matches_reference(three_sms, shape, causal, window, cap, lengths,
                                       config):
    interpreted(shape, statics(causal, window, cap, lengths), config,
                MosaicAttentionVjpConfig(compute_wgs=1), seed=11)


_GRID_CASES = [
    ((2, 256, 256, 4, 2, 64), True, dict(longest_first=True), {}),
    ((2, 128, 256, 2, 2, 64), False, dict(num_stages=3), {}),
    ((2, 256, 256, 2, 1, 64), True, dict(compute_wgs=1),
     dict(window=(70, 0), soft_cap=30.0)),
    ((2, 256, 256, 2, 1, 64), True, {}, dict(kv_lengths=jnp.array([130, 0], jnp.int32))),
    # A window over a batch element with no keys: its tiles compute no K/V step.
    ((2, 256, 256, 2, 1, 64), True, {},
     dict(window=(70, 0), kv_lengths=jnp.array([200, 0], jnp.int32))),
]


# Every case with the Q prefetch (the persistent loop's ring, barriers and tile table,
# plus the second Q buffer); without it, the GQA longest-first and the three-stage cross
# cases (the ring wrapping at different tiles), which walk the same loop with one Q buffer:
# the window, cap and key-length cases differ only in the K/V range of a tile, which
# does not depend on the prefetch.
@pytest.mark.variants
@pytest.mark.parametrize(("prefetch", "shape", "causal", "fields", "kwargs"), [
    pytest.param(prefetch, *case, id=f"{prefetch}-shape{i}-{case[1]}-fields{i}-kwargs{i}")
    for prefetch in (False, True) for i, case in enumerate(_GRID_CASES)
    if prefetch or i < 2])
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


_LOWERED = [
    (128, True, {}),
    (64, False, dict(local_window_size=(200, 0), logits_soft_cap=30.0)),
    (256, False, dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
]


# Every head dim and mask with the prefetch; without it once (d128 causal): the window,
# cap, key lengths and d256 change the tile's K/V range and tiles, not the Q load.
@pytest.mark.variants
@pytest.mark.parametrize(("prefetch", "head_dim", "causal", "kwargs"), [
    pytest.param(prefetch, *case, id=f"{prefetch}-{case[0]}-{case[1]}-kwargs{i}")
    for prefetch in (False, True) for i, case in enumerate(_LOWERED) if prefetch or i == 0])
def test_persistent_lowers_for_h200(head_dim, causal, kwargs, prefetch):
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


# ------------------------------------------------------------------------------------------
# CPU tests of the Mosaic GPU attention forward with a GQA group's query heads in one
# block (`MosaicAttentionConfig.group_in_block`): each compute warpgroup runs its own query
# head on the block's rows, and the K/V tiles of their shared K/V head stream once.
#
# In GPU interpret mode: numerics against the float32 HIGHEST reference (forward, lse, and
# the default backward's gradients of random cotangents) with causal GQA, MQA, a window
# with a soft cap, key lengths and the persistent launch; outputs bitwise equal to the
# kernel without it (a row's K/V tiles and their order do not depend on the block); the
# launch grid; the group check; lowering for an H200. The device's checks and timings:
# `tests/gpu/test_mosaic_attention_gpu.py -k group_in_block` and the probe's `group` phase.


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
def test_group_in_block_interpreted_matches_reference(shape, causal, window, cap, lengths, config):
    interpreted(shape, statics(causal, window, cap, lengths), config,
                MosaicAttentionVjpConfig(compute_wgs=1), seed=23)


@pytest.mark.variants
@pytest.mark.parametrize("shape, causal, fields, kwargs", [
    ((2, 256, 256, 4, 2, 64), True, dict(longest_first=True), {}),
    ((2, 128, 256, 4, 1, 64), False, dict(num_stages=3), {}),
    ((2, 256, 256, 2, 1, 64), True, {}, dict(window=(70, 0), soft_cap=30.0)),
    ((2, 256, 256, 2, 1, 64), True, {}, dict(kv_lengths=jnp.array([130, 0], jnp.int32))),
    ((2, 256, 256, 4, 2, 64), True, dict(persistent=True, prefetch_query=True), {}),
])
def test_bitwise_equal_to_a_block_per_head(monkeypatch, shape, causal, fields, kwargs):
    """A row's K/V tiles and their order do not depend on which block runs it, so out
    and lse equal the kernel's with a block per query head bit for bit. Persistent (with
    the Q prefetch, whose loop holds the persistent one's; persistent without it is
    bitwise equal to the grid in `test_bitwise_equal_to_the_grid`), over three "SMs"."""
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


@pytest.mark.variants
@pytest.mark.parametrize("launch", [{}, dict(persistent=True, prefetch_query=True)])
def test_group_in_block_lowers_for_h200(launch):
    """Causal GQA with the default backward, lowered for an H200: grid-launched, and
    persistent with the Q prefetch (persistent without it lowers in
    `test_persistent_lowers_for_h200[False-128-...]`)."""
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


# ------------------------------------------------------------------------------------------
# CPU tests of the Mosaic GPU attention forward's intra-warpgroup overlap
# (`MosaicAttentionConfig.softmax_overlap`): numerics in GPU interpret mode against the
# float32 reference (forward, lse and the default backward's gradients of random
# cotangents), lowering for an H200, and the limits it states.
#
# Interpret mode runs each `wgmma` to completion, so these tests check the overlapped
# loop's bookkeeping (the first tile peeled, the P V one step late, the accumulator
# rescaled after it lands); the device test
# `tests/gpu/test_mosaic_attention_gpu.py -k softmax_overlap` checks the asynchrony.


def _overlap(block_q=64, block_kv=64, stages=2, wgs=2):
    return MosaicAttentionConfig(block_q=block_q, block_kv=block_kv, num_stages=stages,
                                 compute_wgs=wgs, softmax_overlap=True)


@pytest.mark.variants
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


@pytest.mark.variants
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


# ------------------------------------------------------------------------------------------
# The Mosaic GPU attention forward and dq kernels with `longest_first`: causal calls
# launch their query blocks last to first (`_mosaic_gpu_common.query_block`).
#
# On CPU: numerics in Pallas's GPU interpret mode against the float32 HIGHEST reference
# (GQA, cross attention both ways, a causal window, key lengths, d64/d128/d256), the
# kernels bitwise equal to the ascending order (a block's work does not depend on when it
# runs), the traced program unchanged without a causal mask, lowering for an H200, and
# the config checks. Interpret mode runs the grid in order, so the launch order itself is
# the device's to measure: `tests/gpu/test_mosaic_attention_gpu.py -k longest_first` and
# `benchmarks/probes/longest_first_probe.py`.


def _fwd(**fields) -> MosaicAttentionConfig:
    return MosaicAttentionConfig(longest_first=True, **({"block_kv": 64} | fields))


def _vjp(**fields) -> MosaicAttentionVjpConfig:
    return MosaicAttentionVjpConfig(longest_first=True, **fields)


@pytest.mark.variants
@pytest.mark.parametrize("shape, window, lengths, config, vjp_config", [
    # GQA, two forward blocks of 2 x 64 rows and four dq blocks of 64 (one warpgroup).
    pytest.param((2, 256, 256, 4, 2, 64), None, None, _fwd(), _vjp(compute_wgs=1),
                 id="gqa-d64"),
    # More keys than queries (top-left aligned: most keys hidden), MQA; two blocks each.
    pytest.param((2, 128, 256, 2, 1, 64), None, None, _fwd(compute_wgs=1),
                 _vjp(compute_wgs=1), id="more-keys-mqa-d64", marks=pytest.mark.slow),
    # d256: two dq warpgroups split the head dim of shared rows (`q_base` from qi alone).
    pytest.param((2, 192, 192, 2, 1, 256), None, None, _fwd(compute_wgs=1), _vjp(),
                 id="gqa-d256-split", marks=pytest.mark.slow),
    # A causal window (its block range starts from qi too) and key lengths.
    pytest.param((2, 256, 256, 2, 2, 64), (100, 0), None, _fwd(compute_wgs=1),
                 _vjp(compute_wgs=1), id="window-d64", marks=pytest.mark.slow),
    pytest.param((2, 256, 256, 2, 1, 128), None, (200, 37), _fwd(), _vjp(),
                 id="lengths-d128"),
])
def test_interpreted_causal_matches_reference(shape, window, lengths, config, vjp_config):
    interpreted(shape, statics(True, window, None, lengths), config, vjp_config, seed=7)


def _inputs(b, sq, sk, h, hk, d):
    q, do = (random_normal(i, (b, sq, h, d), jnp.bfloat16) for i in (1, 2))
    k, v = (random_normal(i, (b, sk, hk, d), jnp.bfloat16) for i in (3, 4))
    return q, k, v, do


def test_kernels_match_the_ascending_order_bitwise():
    """Each block does the same work whenever it runs: out, lse and dq equal the
    default order's bit for bit (a block that read its tiles by one index and masked
    them by another would not). More queries than keys: the last query blocks see
    every key."""
    q, k, v, do = _inputs(2, 256, 128, 2, 1, 64)
    kwargs = dict(scale=0.3, causal=True)

    def run(longest_first):
        out, lse = mosaic_attention_forward(
            q, k, v, config=MosaicAttentionConfig(block_kv=64, longest_first=longest_first),
            **kwargs)
        delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
        dq = mosaic_attention_dq(
            q, k, v, do, lse, jnp.swapaxes(delta, 1, 2),
            config=MosaicAttentionVjpConfig(compute_wgs=1, longest_first=longest_first),
            **kwargs)
        return out, lse, dq

    with interpret_mode():
        got, want = run(True), run(False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _program(kernel, config, *, causal, window=None, head_dim=128, kv_heads=2):
    q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, kv_heads, head_dim), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((2, 4, 512), jnp.float32)
    args = (q, kv, kv) if kernel is mosaic_attention_forward else (q, kv, kv, q, vec, vec)
    kwargs = dict(scale=0.3, causal=causal, config=config, window=window)
    with core.targeting(H200):
        return str(jax.make_jaxpr(lambda *a: kernel(*a, **kwargs))(*args))


@pytest.mark.parametrize("kernel, fields", [
    (mosaic_attention_forward, dict()),
    (mosaic_attention_forward, dict(block_q=128, compute_wgs=1)),
    (mosaic_attention_dq, dict()),
    (mosaic_attention_dq, dict(compute_wgs=1)),
])
@pytest.mark.parametrize("window", [None, (100, 50)])
def test_without_a_causal_mask_the_program_is_unchanged(kernel, fields, window):
    config = (MosaicAttentionConfig if kernel is mosaic_attention_forward
              else MosaicAttentionVjpConfig)
    on, off = config(longest_first=True, **fields), config(**fields)
    assert (_program(kernel, on, causal=False, window=window)
            == _program(kernel, off, causal=False, window=window))
    assert (_program(kernel, on, causal=True, window=window)
            != _program(kernel, off, causal=True, window=window))


@pytest.mark.parametrize("kernel, fields", [
    (mosaic_attention_dkv, dict()),
    (mosaic_attention_dkv, dict(group_in_block=True)),
    (mosaic_attention_fused_bwd, dict(dq_accumulation="ordered", compute_wgs=1)),
])
def test_the_dkv_kernel_ignores_it(kernel, fields):
    """The dk/dv kernel is already longest first; fused, there is no dq kernel."""
    on, off = _vjp(**fields), MosaicAttentionVjpConfig(**fields)
    assert _program(kernel, on, causal=True) == _program(kernel, off, causal=True)


@pytest.mark.variants
@pytest.mark.parametrize("head_dim, kv_heads, kwargs", [
    (128, 2, dict()),
    (64, 1, dict(local_window_size=(200, 0))),
    (256, 2, dict(key_value_seq_lengths=jnp.array([300, 77], jnp.int32))),
])
def test_longest_first_lowers_for_h200(head_dim, kv_heads, kwargs):
    """Forward, dq and dk/dv kernels, causal, with the option on both configs."""
    exported = export_vjp(_vjp(), fwd_config=_fwd(compute_wgs=1 if head_dim == 256 else 2),
                          head_dim=head_dim, kv_heads=kv_heads, **kwargs)
    assert exported.mlir_module().count("mosaic_gpu_v2") == 3


def test_configs_are_validated():
    for config in (MosaicAttentionConfig, MosaicAttentionVjpConfig):
        with pytest.raises(ValueError, match="longest_first must be a bool"):
            config(longest_first=1)
        assert config().longest_first is False


def _vjp_call(q, kv, *, is_causal, local_window_size):
    return PallasMosaicGpuFlashAttentionVjp().bind(
        (jax.ShapeDtypeStruct(q.shape[:1] + q.shape[2:3] + q.shape[1:2], jnp.float32),),
        q, q, query=q, key=kv, value=kv, bias=None, mask=None, scale=0.1,
        is_causal=is_causal, query_seq_lengths=None, key_value_seq_lengths=None,
        local_window_size=local_window_size, logits_soft_cap=None, precision=None)


@pytest.mark.parametrize("shape, kwargs, picked", [
    # The four measured workloads' kinds (`longest_first.jsonl`): causal d128 and d64,
    # MHA and GQA, and one unmeasured size of the same kind.
    ((4, 8192, 16, 16, 128), dict(), True),
    ((4, 4096, 32, 8, 128), dict(), True),
    ((8, 2048, 16, 16, 64), dict(), True),
    ((2, 1024, 8, 1, 128), dict(), True),
    # Not measured: a causal window, head dim 256; without a causal mask it is a no-op.
    ((2, 4096, 8, 4, 128), dict(local_window_size=(1024, 0)), False),
    ((2, 4096, 8, 4, 256), dict(), False),
    ((4, 4096, 16, 4, 128), dict(is_causal=False), False),
])
def test_heuristics_pick_it_where_measured(shape, kwargs, picked):
    """Heuristics and the search spaces launch causal blocks longest first at head dim
    <= 128 without a window, where the device measured it faster; elsewhere grid order."""
    b, s, h, hk, d = shape
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
    call = dict(is_causal=True, local_window_size=None) | kwargs
    with core.targeting(H200):
        fwd = PallasMosaicGpuFlashAttention().bind(q, kv, kv, **call)
        vjp_op = PallasMosaicGpuFlashAttentionVjp()
        vjp = _vjp_call(q, kv, **call)
        configs = [fwd.heuristics_config, *fwd.autotuning_configs,
                   vjp_op._get_heuristics_config(vjp), *vjp_op._get_autotuning_configs(vjp)]
    assert len(configs) > 2
    assert {c.longest_first for c in configs} == {picked}
