"""A ragged dot in plain XLA whose work follows the rows, not groups times rows.

XLA's GPU `jax.lax.ragged_dot` multiplies every row by every group's matrix and
masks, so its work grows with the number of groups. Here the rows, already
consecutive by group, are cut into row tiles of `tile_m` rows that start at each
group's first row (a group of s rows takes ceil(s / tile_m) tiles, the last one
padded), so the work is about (M + G * tile_m) * K * N whatever the group sizes
(traced sizes included: the tile count, ceil(M / tile_m) + G, is static). A
`lax.scan` walks the tiles `tiles_per_step` at a time: each step gathers its tiles'
rows and their groups' matrices and runs one batched matmul; rows are scattered
back at the end (rows past the sum of the sizes stay zero).

Semantics are `jax.lax.ragged_dot_general`'s for the family's three variants: the
output dtype is the one it gives, products accumulate in float32 (or wider) for
floating inputs, and `precision` goes to every matmul.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Where the tiled form may run on its own (`path="auto"`): platforms on which
# `jax.lax.ragged_dot` lowers to dense work per group (a masked matmul per group). TPU
# lowers it to a grouped matmul of its own, which stays.
TILED_PLATFORMS = ("cpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TilingRule:
    """The static choice between `jax.lax.ragged_dot` and the tiled form, and its tiles.

    `tile_m`: rows a tile; `None` picks the power of two at or above the mean rows a group,
    clipped to [`min_tile_m`, `max_tile_m`] (small groups waste little padding, large
    ones run large matmuls). The tiled form runs where its padded work, (M + G * tile_m)
    rows, is at most `max_work_ratio` of the G * M rows the dense-per-group form does.
    `rows_per_step`: rows a scan step multiplies (its tiles' weights are gathered
    together), capped so the gathered weights stay within `max_step_weight_bytes`.
    """

    tile_m: int | None = None
    min_tile_m: int = 16
    max_tile_m: int = 128
    max_work_ratio: float = 0.5
    rows_per_step: int = 2048
    max_step_weight_bytes: int = 1 << 28

    def tile_rows(self, m: int, groups: int) -> int:
        if self.tile_m is not None:
            return self.tile_m
        mean = max(1, m // max(groups, 1))
        return int(np.clip(1 << (mean - 1).bit_length(), self.min_tile_m, self.max_tile_m))

    def prefers_tiled(self, m: int, groups: int) -> bool:
        """True where the padded tiles do at most `max_work_ratio` of the dense work."""
        if groups < 2 or m == 0:
            return False
        return m + groups * self.tile_rows(m, groups) <= self.max_work_ratio * groups * m

    def tiles_per_step(self, num_tiles: int, tile_m: int, weight_bytes: int) -> int:
        by_rows = max(1, self.rows_per_step // tile_m)
        by_memory = max(1, self.max_step_weight_bytes // max(weight_bytes, 1))
        return max(1, min(num_tiles, by_rows, by_memory))


DEFAULT_RULE = TilingRule()


def row_tiles(group_sizes: jax.Array, m: int, tile_m: int) -> tuple[jax.Array, ...]:
    """`(group, first_row, rows)` of each of the ceil(m / tile_m) + G tiles.

    Group ends are clipped to `m` (as `jax.lax.ragged_dot` ends groups at row M) and
    made non-decreasing; unused tiles have 0 rows and group 0.
    """
    groups = group_sizes.shape[0]
    ends = jax.lax.cummax(jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m))
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    counts = -(-(ends - starts) // tile_m)
    tile_ends = jnp.cumsum(counts)
    num_tiles = -(-m // tile_m) + groups
    index = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, index, side="right"), groups - 1)
    local = index - (tile_ends[group] - counts[group])
    first = starts[group] + local * tile_m
    rows = jnp.clip(ends[group] - first, 0, tile_m)
    rows = jnp.where(index < tile_ends[-1], rows, 0)
    return group.astype(jnp.int32), first, rows


def _output_dtype(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dimension_numbers: Any,
                  preferred_element_type: Any) -> np.dtype:
    out = jax.eval_shape(
        lambda a, b, s: jax.lax.ragged_dot_general(
            a, b, s, dimension_numbers, preferred_element_type=preferred_element_type),
        lhs, rhs, group_sizes)
    return np.dtype(out.dtype)


def _accumulation_dtype(out_dtype: np.dtype) -> np.dtype:
    if jnp.issubdtype(out_dtype, jnp.floating):
        return np.dtype(jnp.promote_types(out_dtype, jnp.float32))
    return out_dtype


def tiled_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, variant: str,
                     dimension_numbers: Any, precision: Any, preferred_element_type: Any,
                     rule: TilingRule = DEFAULT_RULE) -> jax.Array:
    """The family's `variant` (see `base.py`) as tiled batched matmuls."""
    m = lhs.shape[0]
    groups = group_sizes.shape[0]
    out_dtype = _output_dtype(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type)
    acc_dtype = _accumulation_dtype(out_dtype)
    if variant == "drhs":
        out_shape = (groups, lhs.shape[1], rhs.shape[1])
    else:
        out_shape = (m, rhs.shape[1] if variant == "dlhs" else rhs.shape[2])
    if m == 0 or groups == 0:
        return jnp.zeros(out_shape, out_dtype)
    tile_m = rule.tile_rows(m, groups)
    group, first, rows = row_tiles(group_sizes, m, tile_m)
    num_tiles = group.shape[0]
    weight_bytes = (math.prod(out_shape[1:]) if variant == "drhs" else
                    math.prod(rhs.shape[1:])) * max(rhs.dtype.itemsize, acc_dtype.itemsize)
    step = rule.tiles_per_step(num_tiles, tile_m, weight_bytes)
    steps = -(-num_tiles // step)
    pad = steps * step - num_tiles
    group = jnp.pad(group, (0, pad))
    first = jnp.pad(first, (0, pad))
    rows = jnp.pad(rows, (0, pad))
    offsets = jnp.arange(tile_m, dtype=jnp.int32)
    # Row index of every tile slot; slots past a tile's rows point past the end (M).
    index = jnp.where(offsets < rows[:, None], first[:, None] + offsets, m)
    index = index.reshape(steps, step, tile_m)
    group = group.reshape(steps, step)

    def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
        return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)

    dot = dict(precision=precision, preferred_element_type=acc_dtype)
    if variant == "drhs":
        def drhs_step(acc: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            idx, grp = xs
            a, b = gather_rows(lhs, idx), gather_rows(rhs, idx)  # (step, tile, K), (.., N)
            part = jax.lax.dot_general(a, b, (((1,), (1,)), ((0,), (0,))), **dot)
            return acc.at[grp].add(part), None

        acc, _ = jax.lax.scan(drhs_step, jnp.zeros(out_shape, acc_dtype), (index, group))
        return acc.astype(out_dtype)

    contract = 2 if variant == "dlhs" else 1  # the rhs axis the rows' columns meet

    def rows_step(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        idx, grp = xs
        a, w = gather_rows(lhs, idx), rhs[grp]  # (step, tile, ...), (step, K, N)
        return None, jax.lax.dot_general(a, w, (((2,), (contract,)), ((0,), (0,))), **dot)

    _, tiles = jax.lax.scan(rows_step, None, (index, group))
    tiles = tiles.reshape(-1, out_shape[1]).astype(out_dtype)
    return jnp.zeros(out_shape, out_dtype).at[index.reshape(-1)].set(tiles, mode="drop")
