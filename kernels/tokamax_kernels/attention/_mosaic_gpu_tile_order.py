"""The order in which a persistent Mosaic GPU attention forward walks its tiles.

A persistent forward launches one block per SM, and each block runs the (batch, head,
query block) tiles `i, i + blocks, i + 2 * blocks, ...` of one flat order, carrying its
K/V ring and barriers from tile to tile: no block launch, Q load and pipeline fill per
tile stands between the tensor-core work. The flat order does two things:

- **L2 sections.** The (batch, head) pairs are cut into sections whose K and V fit in
  `L2_BUDGET_BYTES` together; a section's tiles all run before the next section's, so
  the blocks running at once read the same few heads' K/V from L2 (FlashAttention-3's
  tile scheduler swizzles its heads the same way). Query heads of one K/V head (GQA) are
  neighbours in the order and share their K/V.
- **Longest first** (`reverse_q`, causal calls): within a section the query blocks go
  last to first, so each round of tiles handed out together has tiles of about one
  length, the longest first, and the short ones fill the end.

Where the tiles' lengths differ (causal masks, windows), a block taking every
`blocks`-th tile of the order would take the longest tile of every round and finish
last: up to 15% after the others at a causal MHA b4 s4096 d128 forward. There
`balanced_schedule` hands the order out as a dynamic scheduler would with equally fast
SMs, each tile in turn to the block that frees first (list scheduling, longest first:
within 1% of an even split at the persistent-schedule shapes of
`tests/ops/attention/test_mosaic_gpu_attention_forward.py`).
Built at trace time from the tiles' static K/V step counts, it needs no atomic counter,
and which block runs a tile never changes its numerics.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax

# K/V bytes of the (batch, head) pairs of one section. The H200 has 50 MiB of L2; a
# section takes under two thirds of it, leaving room for the Q tiles and outputs in flight.
L2_BUDGET_BYTES = 32 * 1024 * 1024
# Tiles of the largest schedule a persistent forward carries: its int32 table is built at
# trace time and embedded in the program (256 KiB at most). Beyond it the blocks take the
# order round robin.
MAX_SCHEDULED_TILES = 1 << 16
# A tile's fixed cost in K/V steps beside its own (its Q load, output store, and the
# ring's refill at the tile boundary), for `balanced_schedule`'s estimate.
TILE_OVERHEAD_STEPS = 1


@dataclasses.dataclass(frozen=True)
class TileOrder:
    """A flat order of the `batch * heads * num_q_blocks` tiles (see the module doc).

    Attributes:
      batch: batch size.
      heads: query heads.
      num_q_blocks: query blocks per (batch, head).
      pairs_per_section: (batch, head) pairs per L2 section (divides `batch * heads`).
      reverse_q: walk the query blocks of a section last to first (causal calls).
    """

    batch: int
    heads: int
    num_q_blocks: int
    pairs_per_section: int
    reverse_q: bool

    @property
    def num_tiles(self) -> int:
        return self.batch * self.heads * self.num_q_blocks

    def coordinates(self, tile: Any) -> tuple[Any, Any, Any]:
        """(batch index, head, query block) of flat tile index `tile` (traced int32)."""
        section_tiles = self.pairs_per_section * self.num_q_blocks
        section, within = lax.div(tile, section_tiles), lax.rem(tile, section_tiles)
        q_rank = lax.div(within, self.pairs_per_section)
        pair = section * self.pairs_per_section + lax.rem(within, self.pairs_per_section)
        qi = self.num_q_blocks - 1 - q_rank if self.reverse_q else q_rank
        return lax.div(pair, self.heads), lax.rem(pair, self.heads), qi

    def query_blocks(self) -> np.ndarray:
        """The query block of every flat tile index, in order (numpy)."""
        within = np.arange(self.num_tiles) % (self.pairs_per_section * self.num_q_blocks)
        q_rank = within // self.pairs_per_section
        return self.num_q_blocks - 1 - q_rank if self.reverse_q else q_rank


def tile_order(batch: int, heads: int, kv_heads: int, num_q_blocks: int, seq_kv: int,
               head_dim: int, itemsize: int, *, reverse_q: bool) -> TileOrder:
    """The order for these shapes: the largest section (a divisor of `batch * heads`, so
    every section is whole) whose pairs' K/V fit in `L2_BUDGET_BYTES`, one pair at least."""
    group = heads // kv_heads
    # K and V of one query head's pair; the query heads of a group share theirs.
    pair_bytes = 2 * seq_kv * head_dim * itemsize / group
    fit = max(1, int(L2_BUDGET_BYTES // pair_bytes))
    pairs = batch * heads
    per_section = max(d for d in range(1, min(fit, pairs) + 1) if pairs % d == 0)
    return TileOrder(batch, heads, num_q_blocks, per_section, reverse_q)


def balanced_schedule(order: TileOrder, q_block_steps: Sequence[int], blocks: int
                      ) -> np.ndarray | None:
    """The tiles of `order` handed to `blocks` persistent blocks by list scheduling: each
    flat tile in turn to the block whose tiles so far cost least (`q_block_steps[qi]` K/V
    steps plus `TILE_OVERHEAD_STEPS` for a tile of query block `qi`; ties to the lower
    block), as a dynamic scheduler would hand them out on equally fast SMs.

    Returns an int32 table: `table[j]` to `table[j + 1]` (the first `blocks + 1`
    entries) index the run of `table[blocks + 1:]` that block `j` walks, in order. None
    where every tile costs the same (round robin is that schedule already) or the order
    holds more than `MAX_SCHEDULED_TILES` tiles.
    """
    if len(set(q_block_steps)) == 1 or order.num_tiles > MAX_SCHEDULED_TILES:
        return None
    costs = np.asarray(q_block_steps, np.int64)[order.query_blocks()] + TILE_OVERHEAD_STEPS
    owner = np.empty(order.num_tiles, np.int64)
    free_at = [(0, j) for j in range(blocks)]  # a heap of (cost so far, block)
    for tile, cost in enumerate(costs.tolist()):
        total, block = heapq.heappop(free_at)
        owner[tile] = block
        heapq.heappush(free_at, (total + cost, block))
    walk = np.argsort(owner, kind="stable")  # each block's tiles, in the flat order
    offsets = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=blocks))])
    return np.concatenate([offsets, walk]).astype(np.int32)
