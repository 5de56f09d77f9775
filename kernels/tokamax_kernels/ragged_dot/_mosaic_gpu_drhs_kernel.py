"""Mosaic GPU kernel for the ragged dot that *contracts* over the grouped rows: the drhs.

drhs: out[g] = lhs[rows of g].T @ dout[rows of g]     lhs (M, K), dout (M, N) -> (G, K, N)

Each work item owns one output tile (group, K tile, N tile) and walks that group's
rows in steps of `tile_k`, accumulating in float32; nothing is split across CTAs and
no atomics are used, so the result is deterministic and as accurate as a dense
bf16 matmul with f32 accumulation. Steps start at a `tile_k`-aligned row, so the
first and last step of a group may hold rows of its neighbours: each compute
warpgroup zeroes those rows of its own half of the `dout` tile in SMEM before its
`wgmma`. An empty group runs one fully masked step and stores zeros.
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


def _group_bounds(group_sizes_gmem, num_groups: int, group):
    """`(start, end)` rows of `group` (a traced index), by an unrolled prefix sum."""
    end = start_of = end_of = jnp.int32(0)
    for i in range(num_groups):
        start, end = end, end + group_sizes_gmem[i]
        start_of = lax.select(group == i, start, start_of)
        end_of = lax.select(group == i, end, end_of)
    return start_of, end_of


def ragged_dot_drhs(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *,
                    config: common.Config) -> jax.Array:
    """`(G, K, N)`: for each group g, `lhs[rows of g].T @ dout[rows of g]`."""
    cfg = config
    m, k = lhs.shape
    n = dout.shape[1]
    g = group_sizes.shape[0]
    dtype = lhs.dtype
    if k % cfg.tile_m or n % cfg.cta_n:
        raise ValueError(f"shape lhs {lhs.shape} dout {dout.shape} does not fit {cfg}")
    grid_k = k // cfg.tile_m
    grid_n = n // cfg.cta_n
    lhs_spec = plgpu.BlockSpec((cfg.tile_k, cfg.tile_m), lambda j: (j, 0),
                               transforms=common.swizzled(cfg.tile_m, dtype))
    dout_spec = plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda j: (j, 0),
                                transforms=common.swizzled(cfg.cta_n, dtype))
    out_transforms = common.swizzled(cfg.epi_n, dtype)

    def pipeline(body, compute_context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=common.MEMORY_REGISTERS,
            in_specs=[lhs_spec, dout_spec], wg_axis="wg",
            num_compute_wgs=common.NUM_COMPUTE_WGS, max_concurrent_steps=cfg.num_stages,
            compute_context=compute_context)

    def kernel(sizes_gmem, lhs_gmem, dout_gmem, out_gmem):
        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore, cfg.num_stages).get_allocations(
                lhs_gmem.at[:, pl.ds(0, cfg.tile_m)], dout_gmem.at[:, pl.ds(0, cfg.cta_n)]),
            out_smem=plgpu.SMEM((common.NUM_COMPUTE_WGS, cfg.tile_m, cfg.epi_n), dtype,
                                transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((g, grid_k * grid_n), collective_axes="sm")
            def _item(info: plgpu.NDLoopInfo):
                gi = info.index[0]
                ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n),
                                            cfg.grid_minor_dim, cfg.grid_tile_width)
                start, end = _group_bounds(sizes_gmem, g, gi)
                first_row = pl.multiple_of(lax.div(start, jnp.int32(cfg.tile_k)) * cfg.tile_k,
                                           cfg.tile_k)
                steps = jnp.maximum(pl.cdiv(end - first_row, cfg.tile_k), 1)
                wg_cols = pl.ds(wg * cfg.tile_n, cfg.tile_n)

                def mma(idx, lhs_smem, dout_smem, acc_ref):
                    row0 = first_row + idx[0] * cfg.tile_k
                    lo, hi = start - row0, end - row0
                    mine = dout_smem.at[:, wg_cols]

                    @pl.when((lo > 0) | (hi < cfg.tile_k))
                    def _():
                        rows = plgpu.layout_cast(
                            lax.broadcasted_iota(jnp.int32, (cfg.tile_k, cfg.tile_n), 0),
                            plgpu.Layout.WGMMA)
                        values = mine[...]
                        mine[...] = jnp.where((rows >= lo) & (rows < hi), values,
                                              jnp.zeros_like(values))
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, lhs_smem.T, mine)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def compute_context(run):
                    @functools.partial(
                        pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                    def _acc(acc_ref):
                        run(acc_ref)
                        acc = acc_ref[...].astype(dtype)
                        out_tile = out_gmem.at[gi, pl.ds(ki * cfg.tile_m, cfg.tile_m)]
                        for j in range(cfg.tile_n // cfg.epi_n):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            out_smem[wg] = acc[:, j * cfg.epi_n:(j + 1) * cfg.epi_n]
                            plgpu.commit_smem()
                            col0 = ni * cfg.cta_n + wg * cfg.tile_n + j * cfg.epi_n
                            plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                                    out_tile.at[:, pl.ds(col0, cfg.epi_n)])

                pipeline(mma, compute_context, steps)(
                    lhs_gmem.at[pl.ds(first_row, m), pl.ds(ki * cfg.tile_m, cfg.tile_m)],
                    dout_gmem.at[pl.ds(first_row, m), pl.ds(ni * cfg.cta_n, cfg.cta_n)],
                    allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((g, k, n), dtype),
        grid=(_gpu.sm_count(),),
        grid_names=("sm",),
        num_threads=common.NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=common.compiler_params(),
    )
    return call(group_sizes.astype(jnp.int32), lhs, dout)
