"""A ragged dot in plain XLA whose work follows the rows, not groups times rows.

XLA's GPU `jax.lax.ragged_dot` multiplies every row by every group's matrix and
masks, so its work grows with the number of groups. Here the rows, already
consecutive by group, are cut into row tiles of `tile_m` rows that start at each
group's first row (a group of s rows takes ceil(s / tile_m) tiles, the last one
padded), so the work is about (M + G * tile_m) * K * N whatever the group sizes
(traced sizes included: the tile count, ceil(M / tile_m) + G, is static; `TilingRule`
picks tile_m and whether to tile at all from the shapes). A
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
class Problem:
    """A call's static sizes: M rows in G groups, each row meeting a (K, N) matrix of
    `itemsize`-byte elements (forward and dlhs: `rhs[g]`; drhs: its output block)."""

    m: int
    groups: int
    k: int
    n: int
    itemsize: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TilingRule:
    """The static choice between `jax.lax.ragged_dot` and the tiled form, and its tiles.

    Both forms are predicted by a roofline from the shapes alone (group sizes are not
    known). `jax.lax.ragged_dot`: 2 * G * M * K * N FLOPs, overlapped with one read of the
    G matrices. The tiled form with tiles of T rows: a gather that reads and writes its
    tiles' matrices, (M / T + G) * K * N elements, then matmuls of 2 * (M + G * T) * K * N
    FLOPs overlapped with one more read of them. Large tiles pad more rows; small ones
    gather the matrices more often.

    `tile_m`: rows a tile; `None` takes the `tile_choices` entry of least predicted time
    (none above the power of two at or above M). The tiled form runs where its predicted
    time is at most `max_time_ratio` of `jax.lax.ragged_dot`'s. `flops_per_s` and
    `bytes_per_s`: the dense bf16 matmul rate and the memory bandwidth of an H200; only
    their ratio and the two forms' ratio of times matter to the choice.
    `rows_per_step`: rows a scan step multiplies (its tiles' matrices are gathered
    together), capped so the gathered matrices stay within `max_step_weight_bytes`.
    """

    tile_m: int | None = None
    tile_choices: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    max_time_ratio: float = 0.8
    flops_per_s: float = 776e12
    bytes_per_s: float = 4.29e12
    rows_per_step: int = 2048
    max_step_weight_bytes: int = 1 << 28

    def lax_seconds(self, p: Problem) -> float:
        compute = 2 * p.groups * p.m * p.k * p.n / self.flops_per_s
        return max(compute, p.groups * p.k * p.n * p.itemsize / self.bytes_per_s)

    def tiled_seconds(self, p: Problem, tile_m: int) -> float:
        tiles = -(-p.m // tile_m) + p.groups
        compute = 2 * tiles * tile_m * p.k * p.n / self.flops_per_s
        read = tiles * p.k * p.n * p.itemsize / self.bytes_per_s
        return 2 * read + max(compute, read)

    def tile_rows(self, p: Problem) -> int:
        if self.tile_m is not None:
            return self.tile_m
        cap = 1 << max(p.m - 1, 0).bit_length()
        choices = [t for t in self.tile_choices if t <= cap] or [min(self.tile_choices)]
        return min(choices, key=lambda t: (self.tiled_seconds(p, t), t))

    def prefers_tiled(self, p: Problem) -> bool:
        """True where the tiled form is predicted at most `max_time_ratio` of lax's time."""
        if p.groups < 2 or p.m == 0:
            return False
        tiled = self.tiled_seconds(p, self.tile_rows(p))
        return tiled <= self.max_time_ratio * self.lax_seconds(p)

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


def problem(lhs: Any, rhs: Any, group_sizes: Any, variant: str) -> Problem:
    """The `Problem` of a call of the family's `variant` (see `base.py`)."""
    k, n = (lhs.shape[1], rhs.shape[1]) if variant == "drhs" else rhs.shape[1:]
    return Problem(m=lhs.shape[0], groups=group_sizes.shape[0], k=k, n=n,
                   itemsize=np.dtype(rhs.dtype).itemsize)


def tiled_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, variant: str,
                     dimension_numbers: Any, precision: Any, preferred_element_type: Any,
                     rule: TilingRule = DEFAULT_RULE) -> jax.Array:
    """The family's `variant` (see `base.py`) as tiled batched matmuls."""
    m = lhs.shape[0]
    groups = group_sizes.shape[0]
    out_dtype = _output_dtype(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type)
    acc_dtype = _accumulation_dtype(out_dtype)
    if variant == "drhs":
        out_shape: tuple[int, ...] = (groups, lhs.shape[1], rhs.shape[1])
    else:
        out_shape = (m, rhs.shape[1] if variant == "dlhs" else rhs.shape[2])
    if m == 0 or groups == 0:
        return jnp.zeros(out_shape, out_dtype)
    tile_m = rule.tile_rows(problem(lhs, rhs, group_sizes, variant))
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
    tiles = tiles.reshape(math.prod(tiles.shape[:-1]), out_shape[1]).astype(out_dtype)
    return jnp.zeros(out_shape, out_dtype).at[index.reshape(-1)].set(tiles, mode="drop")
