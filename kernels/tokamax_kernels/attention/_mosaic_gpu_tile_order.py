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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax import lax

# K/V bytes of the (batch, head) pairs of one section. The H200 has 50 MiB of L2; a
# section takes under two thirds of it, leaving room for the Q tiles and outputs in flight.
L2_BUDGET_BYTES = 32 * 1024 * 1024


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
