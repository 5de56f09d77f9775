"""The Pallas Mosaic TPU ragged-dot kernels (forward, dlhs, drhs) and their work lists.

TPU kernels run a sequential grid whose blocks Pallas copies between HBM and VMEM;
an output block stays in VMEM while consecutive grid steps map to it and is written
back when the block index changes. Both kernels build on that:

forward / dlhs (`ragged_dot_rows`): XLA first lists the work tiles, one per (group,
row block of `block_m` rows) pair a group touches, in row order, with the rows past
`sum(group_sizes)` as a zero "tail" group. The grid is (column tiles, work tiles,
contraction steps). A tile accumulates its row block times its group's matrix in a
float32 VMEM scratch and, at the last step, writes only its own rows into the output
block; the tiles that share a row block are consecutive, so the block collects all of
them before it is written back.

drhs (`ragged_dot_drhs`): one list entry per (group, row block) again, now at least one
per group (an empty group gets one with no rows, so its output block is written as
zeros). The grid is (K tiles, N tiles, work tiles): a group's tiles are consecutive and
accumulate `x^T @ dy` over its rows (other rows masked to zero) into the group's output
block. Each output tile has one owner and a fixed order: results are deterministic.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_kernels._pallas_tpu import compiler_params


def _bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Start and end rows of each group, clipped to the M rows."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def _tiles(starts: jax.Array, ends: jax.Array, count: jax.Array, m: int,
           block_m: int) -> tuple[jax.Array, ...]:
    """`(group, block, lo, hi, valid)` of each work tile, from the groups' row ranges and
    tile counts; `lo`/`hi` bound the group's rows inside the block (`lo >= hi`: none)."""
    num_blocks = pl.cdiv(m, block_m)
    first = jnp.minimum(starts // block_m, num_blocks - 1)
    last = jnp.cumsum(count)
    t = jnp.arange(num_blocks + starts.shape[0], dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(last, t, side="right"), starts.shape[0] - 1)
    block = first[group] + t - (last[group] - count[group])
    lo = jnp.maximum(starts[group] - block * block_m, 0)
    hi = jnp.minimum(ends[group] - block * block_m, block_m)
    return group.astype(jnp.int32), block, lo, hi, t < last[-1]


def row_tiles(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """(4, T) int32 work list of the forward/dlhs kernel: group (G = the zero tail), row
    block, and the group's rows `[lo, hi)` in it. Unused entries at the end repeat the
    last row block with no rows, so they neither move nor change the output block."""
    g = group_sizes.shape[0]
    starts, ends = _bounds(group_sizes, m)
    starts = jnp.append(starts, ends[-1])
    ends = jnp.append(ends, m)
    count = jnp.where(ends > starts, pl.cdiv(ends, block_m) - starts // block_m, 0)
    group, block, lo, hi, valid = _tiles(starts, ends, count, m, block_m)
    last_block = pl.cdiv(m, block_m) - 1
    return jnp.stack([jnp.where(valid, group, g), jnp.where(valid, block, last_block),
                      jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)]).astype(jnp.int32)


def group_tiles(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """(6, T) int32 work list of the drhs kernel: group, row block, rows `[lo, hi)`, and
    whether the entry is its group's first and last. Every group has at least one entry;
    unused entries at the end extend the last group with no rows."""
    starts, ends = _bounds(group_sizes, m)
    count = jnp.where(ends > starts, pl.cdiv(ends, block_m) - starts // block_m, 1)
    group, block, lo, hi, valid = _tiles(starts, ends, count, m, block_m)
    last_valid = jnp.sum(count) - 1
    block = jnp.where(valid, block, block[last_valid])
    lo, hi = jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)
    changed = group[1:] != group[:-1]
    first = jnp.concatenate([jnp.ones((1,), bool), changed])
    last = jnp.concatenate([changed, jnp.ones((1,), bool)])
    return jnp.stack([group, block, lo, hi, first, last]).astype(jnp.int32)


def _dot(a: jax.Array, b: jax.Array, contracting: tuple[int, int]) -> jax.Array:
    """`a . b` over the given axes in float32; float32 operands at full precision."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contracting[0],), (contracting[1],)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def _rows_kernel(tiles_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, num_groups: int,
                 steps: int, transpose_rhs: bool) -> None:
    t, kk = pl.program_id(1), pl.program_id(2)
    group, lo, hi = tiles_ref[0, t], tiles_ref[2, t], tiles_ref[3, t]

    @pl.when(kk == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((group < num_groups) & (hi > lo))  # the tail group's rows stay zero
    def _accumulate():
        acc_ref[...] += _dot(lhs_ref[...], rhs_ref[...], (1, 1 if transpose_rhs else 0))

    @pl.when(kk == steps - 1)
    def _store():
        rows = jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= lo) & (rows < hi)
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


def ragged_dot_rows(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                    transpose_rhs: bool, out_dtype: Any, block_m: int, block_k: int,
                    block_n: int, interpret: Any) -> jax.Array:
    """forward (`rhs` (G, K, N)) or dlhs (`transpose_rhs`: `rhs` (G, N, K) contracted on
    its last axis): (M, C) rows times their group's matrix, `block_k` dividing C."""
    m, c = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    steps = c // block_k
    tiles = row_tiles(group_sizes, m, block_m)

    def rhs_index(j: Any, t: Any, kk: Any, tiles: Any) -> tuple[Any, ...]:
        group = jnp.minimum(tiles[0, t], g - 1)
        return (group, j, kk) if transpose_rhs else (group, kk, j)

    rhs_block = (None, block_n, block_k) if transpose_rhs else (None, block_k, block_n)
    itemsize = jnp.dtype(lhs.dtype).itemsize
    vmem = (2 * (block_m * block_k + block_k * block_n) * itemsize
            + block_m * block_n * (2 * jnp.dtype(out_dtype).itemsize + 4))
    kernel = functools.partial(_rows_kernel, num_groups=g, steps=steps,
                               transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(n, block_n), tiles.shape[1], steps),
            in_specs=[pl.BlockSpec((block_m, block_k), lambda j, t, kk, tl: (tl[1, t], kk)),
                      pl.BlockSpec(rhs_block, rhs_index)],
            out_specs=pl.BlockSpec((block_m, block_n), lambda j, t, kk, tl: (tl[1, t], j)),
            scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        # Work tiles share output blocks, so only the column axis may split across cores.
        compiler_params=compiler_params(("parallel", "arbitrary", "arbitrary"), vmem),
        interpret=interpret,
        name="tokamax_ragged_dot_dlhs" if transpose_rhs else "tokamax_ragged_dot_forward",
    )(tiles, lhs, rhs)


def _drhs_kernel(tiles_ref, lhs_ref, dout_ref, out_ref, acc_ref) -> None:
    t = pl.program_id(2)
    lo, hi = tiles_ref[2, t], tiles_ref[3, t]

    @pl.when(tiles_ref[4, t] == 1)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(hi > lo)
    def _accumulate():
        # Rows of other groups (and past M, where the block reads padding) count as zero.
        rows = jax.lax.broadcasted_iota(jnp.int32, (lhs_ref.shape[0], 1), 0)
        mine = (rows >= lo) & (rows < hi)
        # x^T as an explicit transpose of a float32 tile, a form Mosaic lowers on every
        # generation (32-bit transposes), then back to the input dtype for the MXU.
        x = jnp.where(mine, lhs_ref[...].astype(jnp.float32), 0.0).T.astype(lhs_ref.dtype)
        dy = jnp.where(mine, dout_ref[...], jnp.zeros((), dout_ref.dtype))
        acc_ref[...] += _dot(x, dy, (1, 0))

    @pl.when(tiles_ref[5, t] == 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def ragged_dot_drhs(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, out_dtype: Any,
                    block_m: int, block_k: int, block_n: int, interpret: Any) -> jax.Array:
    """(G, K, N): `lhs[rows of g]^T @ dout[rows of g]` for `lhs` (M, K), `dout` (M, N)."""
    (m, k), n, g = lhs.shape, dout.shape[1], group_sizes.shape[0]
    tiles = group_tiles(group_sizes, m, block_m)
    itemsize = jnp.dtype(lhs.dtype).itemsize
    vmem = (2 * block_m * (block_k + block_n) * itemsize
            + block_k * block_n * (2 * jnp.dtype(out_dtype).itemsize + 4))
    return pl.pallas_call(
        _drhs_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(k, block_k), pl.cdiv(n, block_n), tiles.shape[1]),
            in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, t, tl: (tl[1, t], i)),
                      pl.BlockSpec((block_m, block_n), lambda i, j, t, tl: (tl[1, t], j))],
            out_specs=pl.BlockSpec((None, block_k, block_n),
                                   lambda i, j, t, tl: (tl[0, t], i, j)),
            scratch_shapes=[pltpu.VMEM((block_k, block_n), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        compiler_params=compiler_params(("parallel", "parallel", "arbitrary"), vmem),
        interpret=interpret,
        name="tokamax_ragged_dot_drhs",
    )(tiles, lhs, dout)
