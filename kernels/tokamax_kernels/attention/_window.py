"""Local attention windows for tiled kernels: which key tiles a run of query rows sees,
and which query tiles a run of key rows is seen by.

A window `(left, right)` lets query `i` see keys `i - left .. i + right` (the family's
`local_window_size`); causal attention is the right bound clipped to 0. A tiled kernel
splits the tiles of the other operand into four runs: tiles no row sees (skipped, never
loaded), tiles on the window's lower edge (masked), tiles every row sees whole (no mask),
and tiles on the upper edge (masked). The Triton kernels' `kv_block_ranges` and
`q_block_ranges` (`_triton_common.py`, also used by the TPU kernels) do the same
with a query offset and key lengths folded in; this module is the offset-free form the
Mosaic GPU kernels use. Arguments are Python ints or traced int32 scalars.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class TileRange(NamedTuple):
    """Tiles `[first, full_first)` masked, `[full_first, full_end)` whole, `[full_end, end)`
    masked; tiles outside `[first, end)` are not seen at all."""

    first: Any
    full_first: Any
    full_end: Any
    end: Any


def bounds(local_window_size: tuple[int, int] | None, is_causal: bool
           ) -> tuple[int, int] | None:
    """`(left, right)` with causal folded in (`right <= 0`), or None without a window."""
    if local_window_size is None:
        return None
    left, right = local_window_size
    return left, (min(right, 0) if is_causal else right)


def _div(x: Any, y: int) -> Any:
    """Floor division of a non-negative int or int32 scalar."""
    return lax.div(x, jnp.int32(y)) if isinstance(x, jax.Array) else x // y


def _ordered(first: Any, full_first: Any, full_end: Any, end: Any, limit: Any) -> TileRange:
    """The four runs inside `[0, limit)`, each tile in exactly one: rows that see nothing
    get an empty range at or before `limit` (a kernel streaming the tiles of several row
    runs through one ring must never be told to skip a tile past the last one loaded)."""
    first = jnp.minimum(first, limit)
    end = jnp.clip(end, first, limit)
    full_first = jnp.clip(full_first, first, end)
    return TileRange(first, full_first, jnp.clip(full_end, full_first, end), end)


def kv_tiles(window: tuple[int, int], row0: Any, rows: int, tile: int, num_tiles: int,
             kv_len: Any = None) -> TileRange:
    """The key tiles (`tile` keys each, `num_tiles` of them) that query rows
    `[row0, row0 + rows)` see; keys at or after `kv_len` (when given) are never seen."""
    left, right = window
    last = row0 + rows - 1
    first = _div(jnp.maximum(row0 - left, 0), tile)
    full_first = _div(jnp.maximum(last - left + tile - 1, 0), tile)
    full_end = _div(jnp.maximum(row0 + right + 1, 0), tile)
    end = _div(jnp.maximum(last + right + tile, 0), tile)
    limit: int | jax.Array = num_tiles
    if kv_len is not None:
        limit = jnp.minimum(limit, _div(kv_len + tile - 1, tile))
        full_end = jnp.minimum(full_end, _div(kv_len, tile))
    return _ordered(first, full_first, full_end, end, limit)


def q_tiles(window: tuple[int, int], col0: Any, cols: int, tile: int, num_tiles: int
            ) -> TileRange:
    """The query tiles (`tile` rows each, `num_tiles` of them) that see some of the keys
    `[col0, col0 + cols)`: the transpose of `kv_tiles` (key lengths are the caller's)."""
    left, right = window
    last = col0 + cols - 1
    first = _div(jnp.maximum(col0 - right, 0), tile)
    full_first = _div(jnp.maximum(last - right + tile - 1, 0), tile)
    full_end = _div(jnp.maximum(col0 + left + 1, 0), tile)
    end = _div(jnp.maximum(last + left + tile, 0), tile)
    return _ordered(first, full_first, full_end, end, num_tiles)


def visible_below(window: tuple[int, int] | None, kv_len: Any) -> Any:
    """Rows below this see at least one of `kv_len` keys (None: every row does).

    Query `i` sees keys `max(0, i - left) .. min(i + right, kv_len - 1)` (right >= 0
    after the causal fold, as `local_window_size` entries are non-negative): some key
    iff `i < kv_len + left` and `kv_len > 0`."""
    return None if window is None else kv_len + window[0]
