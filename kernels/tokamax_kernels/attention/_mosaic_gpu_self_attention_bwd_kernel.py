"""The Mosaic GPU backward kernel for self-attention on one array: `attention(x, x, x)`.

When query, key and value are the same array `x`, their gradients add up to one,
`dx = dq + dk + dv`, and the scores are symmetric: the tile `x_j x_i^T` that the
dk/dv pass computes for keys `j` and queries `i` is also the score tile of queries
`j` against keys `i`. A block that owns rows `j` of `x` therefore gets all three
gradient terms of those rows from one pass over the tiles `i`, five `wgmma`s a tile:

  t     = x_j x_i^T                       scores, both ways round
  pt    = exp(t - lse_i)  (P_ij^T)         ds_t = pt * (x_j do_i^T - delta_i)
  p     = exp(t - lse_j)  (P_ji)           ds   = p * (do_j x_i^T - delta_j)
  dx_j += scale (ds_t + ds) x_i + pt do_i  (dk + dq, then dv)

The general backward needs seven (a second pass recomputes the scores for dq), or
five plus float32 atomics for dq. No atomics here: reruns are bitwise identical.
Non-causal attention without lengths only; everything else takes the general kernels.

One exponential per score: `p = pt * 2^(lse_i - c) * 2^(c - lse_j)` (log2 units, `c`
the middle of the head's lse range), two multiplies by per-row factors instead of a
second `exp2` (the faster of the two forms in an A/B on the H200). It is exact
while `pt` does not underflow where `p` matters: a head whose lse spans more than
`FACTORED_LSE_RANGE` takes the second `exp2` instead. `ds` is computed while the
`wgmma` of `x_j do_i^T` runs, and the `dv` and `dk + dq` products share one wait
(each the faster of two orders in an A/B on the H200).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax_kernels.attention._mosaic_gpu_common import (
    COMPUTE_REGISTERS,
    LOG2E,
    MEMORY_REGISTERS,
    MosaicAttentionVjpConfig,
    tile_transforms,
)

_WGMMA = plgpu.Layout.WGMMA
# Largest lse range (log2 units) of a head whose probabilities `p` come from `pt`: `pt`
# flushes to zero below 2^-126, so a lost `p` is below 2^(range - 126) = 2^-62.
FACTORED_LSE_RANGE = 64.0


def _zeros(shape: tuple[int, int]) -> jax.Array:
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), _WGMMA)


def mosaic_self_attention_dx(x: jax.Array, dout: jax.Array, lse: jax.Array,
                               delta: jax.Array, *, scale: float,
                               config: MosaicAttentionVjpConfig) -> jax.Array:
    """dx (B, S, H, D) in x's dtype for `out = attention(x, x, x)`, non-causal.

    `lse` (B, H, S) float32 natural-log row log-sum-exp (finite), `delta` (B, H, S) float32
    `rowsum(out * dout)`. Tiles: `block_kv_dkv` rows of x per compute warpgroup,
    `block_q_dkv` rows per streamed tile (the dk/dv kernel's fields: this kernel
    replaces that one and the dq kernel).
    """
    batch, seq, heads, head_dim = x.shape
    dtype = x.dtype
    block_i, block_j, wgs = config.block_q_dkv, config.block_kv_dkv, config.compute_wgs
    num_tiles = seq // block_i
    stages = max(1, min(config.num_stages, num_tiles))
    qk_scale = scale * LOG2E
    lse2 = lse * LOG2E
    high, low = lse2.max(axis=-1, keepdims=True), lse2.min(axis=-1, keepdims=True)
    middle = (high + low) / 2
    up, down = jnp.exp2(lse2 - middle), jnp.exp2(middle - lse2)
    factored = ((high - low)[..., 0] <= FACTORED_LSE_RANGE).astype(jnp.int32)

    def body(x_ref, do_ref, lse_ref, delta_ref, up_ref, down_ref, factored_ref, dx_ref, x_own,
             do_own, lse_own, delta_own, down_own, x_smem, do_smem, lse_smem, delta_smem,
             up_smem, own_ready, x_ready, do_ready, lse_ready, delta_ready, up_ready, consumed):
        b, h, jb = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
        wg = lax.axis_index("wg")

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            base = jb * (wgs * block_j) + wg * block_j
            rows, vec = (b, pl.ds(base, block_j), h), (b, h, pl.ds(base, block_j))
            my_x, my_do = x_own.at[wg], do_own.at[wg]
            plgpu.copy_gmem_to_smem(x_ref.at[rows], my_x, own_ready.at[5 * wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], my_do, own_ready.at[5 * wg + 1])
            plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_own.at[wg], own_ready.at[5 * wg + 2])
            plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_own.at[wg], own_ready.at[5 * wg + 3])
            plgpu.copy_gmem_to_smem(down_ref.at[vec], down_own.at[wg], own_ready.at[5 * wg + 4])
            for i in range(5):
                plgpu.barrier_wait(own_ready.at[5 * wg + i])
            lse_j = plgpu.load(lse_own.at[wg], layout=_WGMMA.reduce(1)) * LOG2E
            delta_j = plgpu.load(delta_own.at[wg], layout=_WGMMA.reduce(1))
            down_j = plgpu.load(down_own.at[wg], layout=_WGMMA.reduce(1))
            tile_shape = (block_j, block_i)

            def rows_of(vector):
                return lax.broadcast_in_dim(vector, tile_shape, [0])

            def columns_of(vector):
                return lax.broadcast_in_dim(vector, tile_shape, [1])

            def tile_step(step, dx_acc, *, factored):
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(x_ready.at[slot])
                x_i = x_smem.at[slot]

                def scores_and_dp(refs):
                    t_ref, dp_ref = refs
                    plgpu.wgmma(t_ref, my_x, x_i.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, my_do, x_i.transpose((1, 0)))

                t, dp = pl.run_state(scores_and_dp)(
                    (plgpu.ACC.init(_zeros(tile_shape)), plgpu.ACC.init(_zeros(tile_shape))))
                t = t * qk_scale
                plgpu.barrier_wait(lse_ready.at[slot])
                lse_i = plgpu.load(lse_smem.at[slot], layout=_WGMMA.reduce(0)) * LOG2E
                p_t = jnp.exp2(t - columns_of(lse_i))
                # Rows j as queries: their own probabilities and softmax-Jacobian term.
                if factored:
                    plgpu.barrier_wait(up_ready.at[slot])
                    up_i = plgpu.load(up_smem.at[slot], layout=_WGMMA.reduce(0))
                    p = p_t * columns_of(up_i) * rows_of(down_j)
                else:
                    p = jnp.exp2(t - rows_of(lse_j))
                p16_t = p_t.astype(dtype)
                plgpu.barrier_wait(do_ready.at[slot])

                def dp_t_then_ds(dp_t_ref):
                    plgpu.wgmma(dp_t_ref, my_x, do_smem.at[slot].transpose((1, 0)))
                    ds = p * (dp - rows_of(delta_j))  # while the wgmma runs
                    return dp_t_ref[...], ds

                dp_t, ds = pl.run_scoped(dp_t_then_ds, plgpu.ACC(tile_shape, jnp.float32))
                plgpu.barrier_wait(delta_ready.at[slot])
                delta_i = plgpu.load(delta_smem.at[slot], layout=_WGMMA.reduce(0))
                ds_sum = (p_t * (dp_t - columns_of(delta_i)) + ds) * scale

                def dx_product(acc_ref):
                    plgpu.wgmma(acc_ref, p16_t, do_smem.at[slot])
                    plgpu.wgmma(acc_ref, ds_sum.astype(dtype), x_i)

                dx_acc = pl.run_state(dx_product)(plgpu.ACC.init(dx_acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return dx_acc

            def run(factored):
                dx_acc = lax.fori_loop(0, num_tiles, functools.partial(
                    tile_step, factored=factored), _zeros((block_j, head_dim)))
                my_x[...] = dx_acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_x, dx_ref.at[rows])
                plgpu.wait_smem_to_gmem(0)

            is_factored = factored_ref[b, h] != 0
            pl.when(is_factored)(lambda: run(True))
            pl.when(jnp.logical_not(is_factored))(lambda: run(False))

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            @pl.loop(0, num_tiles)
            def _(step):
                slot = lax.rem(step, stages)
                rows = (b, pl.ds(step * block_i, block_i), h)
                vec = (b, h, pl.ds(step * block_i, block_i))

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(x_ref.at[rows], x_smem.at[slot], x_ready.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[slot], lse_ready.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[slot],
                                        delta_ready.at[slot])
                plgpu.copy_gmem_to_smem(up_ref.at[vec], up_smem.at[slot], up_ready.at[slot])

    transforms = tile_transforms(dtype)
    scratch: list[Any] = [
        plgpu.SMEM((wgs, block_j, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((wgs, block_j, head_dim), dtype, transforms=transforms),
        *(plgpu.SMEM((wgs, block_j), jnp.float32) for _ in range(3)),
        plgpu.SMEM((stages, block_i, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_i, head_dim), dtype, transforms=transforms),
        *(plgpu.SMEM((stages, block_i), jnp.float32) for _ in range(3)),
        plgpu.Barrier(num_barriers=5 * wgs),
        *(plgpu.Barrier(num_barriers=stages) for _ in range(5)),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
    ]
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, dtype),
        scratch_types=scratch,
        grid=(heads, seq // (wgs * block_j), batch),
        grid_names=("heads", "rows", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(x, dout, lse, delta, up, down, factored)
