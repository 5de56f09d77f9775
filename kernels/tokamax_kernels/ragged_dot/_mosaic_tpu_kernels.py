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

Entries (how `jax.vmap` runs, `entry_folded`): `group_sizes` may be (E, G), E problems
of M rows each stacked into E * M rows, group g of entry e at rows from e * M. The work
lists then run over all E * (G + 1) row ranges at once (each entry's rows past its sum
are a tail range of their own), so one launch does every entry. The forward/dlhs
weights hold R * G matrices, R = 1 (every entry reads the same G) or E (entry e reads
`rhs[e * G:(e + 1) * G]`); drhs writes E * G matrices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_kernels._mosaic_tpu import compiler_params


def _bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(E, G) start and end rows of each group of each entry (entry e's M rows from
    e * M), clipped to its entry's rows."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32), axis=1), m)
    starts = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)
    offsets = m * jnp.arange(ends.shape[0], dtype=jnp.int32)[:, None]
    return starts + offsets, ends + offsets


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


def row_tiles(group_sizes: jax.Array, m: int, block_m: int, rhs_entries: int = 1
              ) -> jax.Array:
    """(4, T) int32 work list of the forward/dlhs kernel over `group_sizes` (G,) or (E, G)
    (entries of `m` rows each): the weight matrix (`R * G` marks a tail: no matrix, the
    rows stay zero), the row block, and the range's rows `[lo, hi)` in it; entry e's
    group g reads matrix `(e % rhs_entries) * G + g`. Unused entries at the end repeat
    the last row block with no rows, so they neither move nor change the output block."""
    sizes = jnp.atleast_2d(group_sizes)
    e, g = sizes.shape
    starts, ends = _bounds(sizes, m)
    entry_ends = m * jnp.arange(1, e + 1, dtype=jnp.int32)[:, None]
    starts = jnp.concatenate([starts, ends[:, -1:]], axis=1).reshape(-1)
    ends = jnp.concatenate([ends, entry_ends], axis=1).reshape(-1)
    tail = rhs_entries * g
    matrix = (jnp.arange(e, dtype=jnp.int32)[:, None] % rhs_entries) * g + jnp.arange(g)
    matrix = jnp.concatenate([matrix, jnp.full((e, 1), tail, jnp.int32)], axis=1).reshape(-1)
    rows = e * m
    count = jnp.where(ends > starts, pl.cdiv(ends, block_m) - starts // block_m, 0)
    ranges, block, lo, hi, valid = _tiles(starts, ends, count, rows, block_m)
    last_block = pl.cdiv(rows, block_m) - 1
    return jnp.stack([jnp.where(valid, matrix[ranges], tail),
                      jnp.where(valid, block, last_block),
                      jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)]).astype(jnp.int32)


def group_tiles(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """(6, T) int32 work list of the drhs kernel over `group_sizes` (G,) or (E, G)
    (entries of `m` rows each; entry e's group g is output matrix e * G + g): group, row
    block, rows `[lo, hi)`, and whether the entry is its group's first and last. Every
    group has at least one entry; unused entries at the end extend the last group with
    no rows."""
    sizes = jnp.atleast_2d(group_sizes)
    starts, ends = (x.reshape(-1) for x in _bounds(sizes, m))
    count = jnp.where(ends > starts, pl.cdiv(ends, block_m) - starts // block_m, 1)
    group, block, lo, hi, valid = _tiles(starts, ends, count, sizes.shape[0] * m, block_m)
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
    its last axis): (M, C) rows times their group's matrix, `block_k` dividing C. With
    (E, G) `group_sizes`: E entries of M / E rows, `rhs` (R * G, ...) (see above)."""
    m, c = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    steps = c // block_k
    sizes = jnp.atleast_2d(group_sizes)
    tiles = row_tiles(sizes, m // sizes.shape[0], block_m, g // sizes.shape[1])

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
    """(G, K, N): `lhs[rows of g]^T @ dout[rows of g]` for `lhs` (M, K), `dout` (M, N);
    (E * G, K, N) for (E, G) `group_sizes` (E entries of M / E rows)."""
    (m, k), n = lhs.shape, dout.shape[1]
    sizes = jnp.atleast_2d(group_sizes)
    g = sizes.size
    tiles = group_tiles(sizes, m // sizes.shape[0], block_m)
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


def entry_folded(fn: Callable[..., Any], num_weights: int) -> Callable[..., tuple[Any, ...]]:
    """`fn(*rows, *weights)` of entries (above) with every `jax.vmap` around it folded into
    the entries: `rows` (group sizes among them) are (E, ...), the last `num_weights`
    operands (R, ...) with R 1 or E, and each output is (E, ...).

    Pallas would batch a `pallas_call` itself by one more grid axis, but not over mapped
    scalar-prefetch operands (the work list, from the group sizes): for those it runs one
    kernel per entry in a serial loop. Folded, a vmap of size V is one launch over V * E
    entries whose work list skips each entry's rows past its sum (no padding group's
    GEMMs) and whose weights are read in place when the vmap does not map them (R stays
    1: no copy per entry). An unmapped row operand is broadcast; so are the weights when
    only some of them are mapped, or when they are mapped but shared by E > 1 entries.
    """
    folded = jax.custom_batching.custom_vmap(lambda *args: tuple(fn(*args)))

    @folded.def_vmap
    def _fold(axis_size: int, in_batched: list[bool], *args: jax.Array
              ) -> tuple[tuple[jax.Array, ...], tuple[bool, ...]]:
        def mapped(x: jax.Array, batched: bool) -> jax.Array:
            return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))

        split = len(args) - num_weights
        rows = [mapped(x, b) for x, b in zip(args[:split], in_batched[:split], strict=True)]
        entries = rows[0].shape[1]
        weights, weights_batched = list(args[split:]), any(in_batched[split:])
        if weights_batched:
            weights = [mapped(x, b) for x, b in zip(weights, in_batched[split:], strict=True)]
            weights = [jnp.broadcast_to(x, (axis_size, entries, *x.shape[2:]))
                       for x in weights]
        operands = [x.reshape(-1, *x.shape[2:]) for x in rows]
        operands += [x.reshape(-1, *x.shape[2:]) for x in weights] if weights_batched else weights
        outs = folded(*operands)
        return (tuple(o.reshape(axis_size, entries, *o.shape[1:]) for o in outs),
                (True,) * len(outs))

    return folded
