"""Mosaic GPU kernel for ragged dots whose *rows* are grouped: the forward and the dlhs.

forward: out[r] = lhs[r] @ rhs[g(r)]          lhs (M, K), rhs (G, K, N)  -> (M, N)
dlhs:    out[r] = dout[r] @ rhs[g(r)].T       dout (M, N), rhs (G, K, N) -> (M, K)

Each group's rows are cut into tiles of `tile_m` rows from its first row rounded down to
a multiple of 8 (swizzled TMA tiles start on 8-row boundaries), so a group of at most
`tile_m - 7` rows is one tile and its weights are read once for each column tile; a
tile may hold rows of the neighbouring groups, and stores only its own group's rows.
Work items are (row tile of a group, column tile) pairs, walked by a persistent grid.
Rows are stored with a ladder of TMA copies of 2^i rows (a TMA box has a static
size; any row count is a sum of powers of two), so neighbours never overwrite each other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_kernels import _gpu
from tokamax_kernels.ragged_dot import _mosaic_gpu_common as common

# Row tiles start on multiples of this many rows: the TMA tiling of swizzled row tiles.
ROW_ALIGN = 8


def row_tile_count(m: int, num_groups: int, tile_m: int) -> int:
    """Work items along the rows that cover every group's tiles (and the zero tail): at
    most `ROW_ALIGN - 1` rows of padding before each group, and one partial tile each."""
    return pl.cdiv(m + (num_groups + 1) * (ROW_ALIGN - 1), tile_m) + num_groups + 1


def _row_tile(group_sizes_gmem, num_groups: int, m: int, tile_m: int, index):
    """The `index`-th row tile of a group: group id, first row, and the group's rows in it.

    Returns `(group, row0, lo, hi)`: the tile covers rows `[row0, row0 + tile_m)`, of which
    local offsets `[lo, hi)` are the group's. Rows past the last group form a
    pseudo-group `num_groups` (their output is zeros); an index past every tile gets
    `lo == hi == 0`. Groups are few, so the search is unrolled into selects. Sizes are
    taken as given (non-negative, as the op checks where they are concrete).
    """
    tile = jnp.int32(tile_m)
    end = offset = group = row0 = lo = hi = jnp.int32(0)
    for i in range(num_groups + 1):
        start = end
        end = jnp.int32(m) if i == num_groups else end + group_sizes_gmem[i]
        first = start - lax.rem(start, jnp.int32(ROW_ALIGN))
        count = lax.select(end > start, lax.div(end - first + tile - 1, tile), jnp.int32(0))
        mine = (offset <= index) & (index < offset + count)
        this_row0 = first + (index - offset) * tile
        group = lax.select(mine, jnp.int32(i), group)
        row0 = lax.select(mine, this_row0, row0)
        lo = lax.select(mine, jnp.maximum(start - this_row0, 0), lo)
        hi = lax.select(mine, jnp.minimum(end - this_row0, tile), hi)
        offset = offset + count
    return group, pl.multiple_of(row0, ROW_ALIGN), lo, hi


def _store_rows(src_smem, dst_gmem, lo, hi, max_rows: int):
    """Copies rows `[lo, hi)` of `src_smem` to the same rows of `dst_gmem` (TMA ladder)."""
    size = hi - lo
    start = lo
    rows = 1 << (max_rows.bit_length() - 1)
    while rows >= 1:
        @pl.when((size & rows) != 0)
        def _(rows=rows, start=start):
            plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(start, rows)],
                                    dst_gmem.at[pl.ds(start, rows)])

        start = start + (size & rows)
        rows //= 2


def ragged_dot_rows(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                    config: common.Config, transpose_rhs: bool) -> jax.Array:
    """`lhs (M, C)` times the group's `rhs` matrix: `(C, N)` slices of `rhs (G, C, N)`,
    or with `transpose_rhs` the transposes of the `(N, C)` slices of `rhs (G, N, C)`."""
    cfg = config
    m, c = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    dtype = lhs.dtype
    if c % cfg.tile_k or n % cfg.cta_n or m < cfg.tile_m:
        raise ValueError(f"shape lhs {lhs.shape} rhs {rhs.shape} does not fit {cfg}")
    grid_m = row_tile_count(m, g, cfg.tile_m)
    grid_n = n // cfg.cta_n
    k_steps = c // cfg.tile_k
    lhs_transforms = common.swizzled(cfg.tile_k, dtype)
    if transpose_rhs:
        rhs_spec = plgpu.BlockSpec((cfg.cta_n, cfg.tile_k), lambda k: (0, k),
                                   transforms=common.swizzled(cfg.tile_k, dtype))
    else:
        rhs_spec = plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda k: (k, 0),
                                   transforms=common.swizzled(cfg.cta_n, dtype))
    lhs_spec = plgpu.BlockSpec((cfg.tile_m, cfg.tile_k), lambda k: (0, k),
                               transforms=lhs_transforms)

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=common.MEMORY_REGISTERS,
            in_specs=[lhs_spec, rhs_spec], wg_axis="wg",
            num_compute_wgs=common.NUM_COMPUTE_WGS, max_concurrent_steps=cfg.num_stages,
            compute_context=compute_context)

    def kernel(sizes_gmem, lhs_gmem, rhs_gmem, out_gmem):
        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(
                lhs_gmem.at[pl.ds(0, cfg.tile_m)], rhs_gmem.at[0]),
            out_smem=plgpu.SMEM((common.NUM_COMPUTE_WGS, cfg.tile_m, cfg.epi_n), dtype),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
            def _item(info: plgpu.NDLoopInfo):
                mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n),
                                            cfg.grid_minor_dim, cfg.grid_tile_width)
                group, row0, lo, hi = _row_tile(sizes_gmem, g, m, cfg.tile_m, mi)
                rows = pl.ds(row0, cfg.tile_m)
                cols = pl.ds(ni * cfg.cta_n, cfg.cta_n)
                wg_cols = pl.ds(wg * cfg.tile_n, cfg.tile_n)

                def mma(_, lhs_smem, rhs_smem, acc_ref):
                    b = rhs_smem.at[wg_cols, :].T if transpose_rhs else rhs_smem.at[:, wg_cols]
                    plgpu.wgmma(acc_ref, lhs_smem, b)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                out_rows = out_gmem.at[rows]

                def store(tile):
                    """Stores this warpgroup's (tile_m, tile_n) `tile` (rows lo..hi only)."""
                    for j in range(cfg.tile_n // cfg.epi_n):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[wg] = tile(j * cfg.epi_n, (j + 1) * cfg.epi_n)
                        plgpu.commit_smem()
                        col0 = ni * cfg.cta_n + wg * cfg.tile_n + j * cfg.epi_n
                        _store_rows(out_smem.at[wg], out_rows.at[:, pl.ds(col0, cfg.epi_n)],
                                    lo, hi, cfg.tile_m)

                def compute_context(run):
                    @functools.partial(
                        pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                    def _acc(acc_ref):
                        run(acc_ref)
                        acc = acc_ref[...].astype(dtype)
                        store(lambda a, b: acc[:, a:b])

                tail = group == g
                rhs_g = rhs_gmem.at[jnp.minimum(group, g - 1)]
                rhs_tile = rhs_g.at[cols, :] if transpose_rhs else rhs_g.at[:, cols]

                @pl.when((hi > lo) & ~tail)
                def _():
                    pipeline(mma, compute_context)(
                        lhs_gmem.at[rows], rhs_tile, allocations=allocs)

                @pl.when((hi > lo) & tail & (wg < common.NUM_COMPUTE_WGS))
                def _():
                    store(lambda a, b: jnp.zeros((cfg.tile_m, b - a), dtype))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), dtype),
        grid=(_gpu.sm_count(),),
        grid_names=("sm",),
        num_threads=common.NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=common.compiler_params(),
    )
    return call(group_sizes.astype(jnp.int32), lhs, rhs)
