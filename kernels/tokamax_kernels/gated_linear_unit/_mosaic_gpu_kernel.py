"""The Mosaic GPU (Hopper) kernel of the grouped gated linear unit.

out[r] = activation(x[r] @ w_gate[g(r)]) * (x[r] @ w_up[g(r)])   x (M, K), w_* (G, K, N)

The Mosaic ragged dot's forward (`ragged_dot/_mosaic_gpu_rows_kernel.py`) with two
accumulators per output tile: the memory warpgroup streams an x tile and the matching
gate and up weight tiles (columns `[c, c + cta_n)` of each) into SMEM with TMA; each
compute warpgroup owns `tile_n` of those columns and accumulates `x @ w_gate` and
`x @ w_up` in float32 registers with `wgmma`. The epilogue computes
`activation(gate) * up` in float32 registers and stores only the (M, N) output, with
the ragged dot's row tiles (each group's own, from its first row) and its ladder of TMA
row stores. With `residuals`, it also stores gate and up in the
inputs' dtype (what autodiff of the plain expression keeps), so the backward pass
never recomputes the GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_kernels import _gpu
from tokamax_kernels.ragged_dot import _mosaic_gpu_common as common
from tokamax_kernels.ragged_dot._mosaic_gpu_rows_kernel import (  # one definition for both
    _row_tile,
    _store_rows,
    row_tile_count,
)


def glu_rows(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array, *,
             up_offset: int, n: int, activation: Callable[[Any], Any], config: common.Config,
             residuals: bool) -> tuple[jax.Array, ...]:
    """`(out,)`, or `(out, *residual arrays)` with `residuals`, of the grouped GLU.

    `w_gate` and `w_up` are (G, K, *) arrays holding the gate columns at `[0, n)` and the
    up columns at `[up_offset, up_offset + n)`: for fused weights one (G, K, 2N) array
    passed twice (`up_offset = n`), whose residual is one (M, 2N) array `[gate | up]`;
    for a pair two (G, K, N) arrays (`up_offset = 0`), whose residuals are two (M, N)
    arrays. The caller guarantees K % tile_k == 0, N % cta_n == 0 and M >= tile_m.
    """
    cfg = config
    m, k = x.shape
    g = w_gate.shape[0]
    dtype = x.dtype
    fused = up_offset != 0
    if k % cfg.tile_k or n % cfg.cta_n or m < cfg.tile_m:
        raise ValueError(f"x {x.shape} and N={n} do not fit {cfg}")
    grid_m = row_tile_count(m, g, cfg.tile_m)
    grid_n = n // cfg.cta_n
    w_spec = plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda s: (s, 0),
                             transforms=common.swizzled(cfg.cta_n, dtype))
    x_spec = plgpu.BlockSpec((cfg.tile_m, cfg.tile_k), lambda s: (0, s),
                             transforms=common.swizzled(cfg.tile_k, dtype))

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // cfg.tile_k,), memory_registers=common.MEMORY_REGISTERS,
            in_specs=[x_spec, w_spec, w_spec], wg_axis="wg",
            num_compute_wgs=common.NUM_COMPUTE_WGS, max_concurrent_steps=cfg.num_stages,
            compute_context=compute_context)

    def kernel(sizes_gmem, x_gmem, gate_gmem, up_gmem, out_gmem, *residual_gmem):
        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(
                x_gmem.at[pl.ds(0, cfg.tile_m)], gate_gmem.at[0, :, pl.ds(0, cfg.cta_n)],
                up_gmem.at[0, :, pl.ds(0, cfg.cta_n)]),
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
                col0 = ni * cfg.cta_n + wg * cfg.tile_n  # this warpgroup's first column
                wg_cols = pl.ds(wg * cfg.tile_n, cfg.tile_n)

                def mma(_, x_smem, gate_smem, up_smem, accs):
                    gate_acc, up_acc = accs
                    plgpu.wgmma(gate_acc, x_smem, gate_smem.at[:, wg_cols])
                    plgpu.wgmma(up_acc, x_smem, up_smem.at[:, wg_cols])
                    plgpu.wgmma_wait(0)
                    return accs

                def store(tile, dst_gmem, column):
                    """Stores the (tile_m, tile_n) `tile(a, b)` (its columns a..b) at
                    `dst_gmem[row0 + lo : row0 + hi, column : column + tile_n]`."""
                    dst_rows = dst_gmem.at[pl.ds(row0, cfg.tile_m)]
                    for j in range(cfg.tile_n // cfg.epi_n):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[wg] = tile(j * cfg.epi_n, (j + 1) * cfg.epi_n)
                        plgpu.commit_smem()
                        _store_rows(out_smem.at[wg],
                                    dst_rows.at[:, pl.ds(column + j * cfg.epi_n, cfg.epi_n)],
                                    lo, hi, cfg.tile_m)

                def store_all(out, gate, up):
                    """The output tile, and with residuals the gate and up tiles."""
                    store(out, out_gmem, col0)
                    if residuals and fused:
                        store(gate, residual_gmem[0], col0)
                        store(up, residual_gmem[0], n + col0)
                    elif residuals:
                        store(gate, residual_gmem[0], col0)
                        store(up, residual_gmem[1], col0)

                def compute_context(run):
                    acc = plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32)

                    @functools.partial(pl.run_scoped, gate_ref=acc, up_ref=acc)
                    def _accs(gate_ref, up_ref):
                        run((gate_ref, up_ref))
                        gate, up = gate_ref[...], up_ref[...]
                        out = (activation(gate) * up).astype(dtype)
                        gate, up = gate.astype(dtype), up.astype(dtype)
                        store_all(lambda a, b: out[:, a:b], lambda a, b: gate[:, a:b],
                                  lambda a, b: up[:, a:b])

                tail = group == g
                w = jnp.minimum(group, g - 1)
                cols = pl.ds(ni * cfg.cta_n, cfg.cta_n)
                up_cols = pl.ds(up_offset + ni * cfg.cta_n, cfg.cta_n)

                @pl.when((hi > lo) & ~tail)
                def _():
                    pipeline(mma, compute_context)(
                        x_gmem.at[pl.ds(row0, cfg.tile_m)], gate_gmem.at[w, :, cols],
                        up_gmem.at[w, :, up_cols], allocations=allocs)

                @pl.when((hi > lo) & tail & (wg < common.NUM_COMPUTE_WGS))
                def _():
                    zeros = lambda a, b: jnp.zeros((cfg.tile_m, b - a), dtype)
                    store_all(zeros, zeros, zeros)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_type = [jax.ShapeDtypeStruct((m, n), dtype)]
    if residuals:
        out_type += ([jax.ShapeDtypeStruct((m, 2 * n), dtype)] if fused
                     else [jax.ShapeDtypeStruct((m, n), dtype)] * 2)
    call = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        grid=(_gpu.sm_count(),),
        grid_names=("sm",),
        num_threads=common.NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=common.compiler_params(),
    )
    return call(group_sizes.astype(jnp.int32), x, w_gate, w_up)
