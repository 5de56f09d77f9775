"""The one-pass Mosaic attention backward's dq (`mosaic_attention_fused_bwd`): the dk/dv
kernel multiplies each tile's dS by its keys and TMA-reduce-adds the float32 share into
dq in global memory, in a fixed order through semaphores ("ordered") or as the adds
land ("atomic"). What a block needs for that: its SMEM, the adds and the turn-taking.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax_kernels.attention import _window
from tokamax_kernels.attention._mosaic_gpu_common import tile_transforms


def first_kv_block(window: tuple[int, int] | None, block_q: int, block_rows: int,
                    num_kv_blocks: int):
    """`tile -> the first key block that adds into query tile `tile`'s dq` (0 without a
    window: causal masks only later blocks out)."""
    if window is None:
        return lambda tile: 0
    return lambda tile: _window.kv_tiles(window, tile * block_q, block_q, block_rows,
                                         num_kv_blocks).first


class DqAdds:
    """A fused dk/dv kernel's dq: each step, every compute warpgroup multiplies dS by
    keys and TMA-adds the float32 product into dq's tile in global memory. Split by
    columns, the warpgroups share their dS^T tiles through SMEM (meeting at a barrier)
    and each takes a column slice of the keys of all of them; split by rows, each
    multiplies its own dS by its own keys, full width (twice the adds, no barrier).

    Ordered, a global semaphore per (batch, head, query tile, and by columns warpgroup)
    counts the adds that have landed: the add of warpgroup `w` of the key block `r`
    places in the tile's order (`r`-th block that sees the tile) waits until `r`
    (columns: each slice its own order) or `r * wgs + w` (rows: both add into the same
    elements) have, and is signalled once complete (at the warpgroup's next step, or at
    the end).
    """

    def __init__(self, dq_ref, scratch, *, wg, wgs: int, by_rows: bool, b, h, ki,
                 heads: int, block_q: int, scale: float, ordered: bool, num_q_tiles: int,
                 first_block):
        self.ds_smem, self.dq_smem, *barriers = scratch
        # By columns: every warpgroup's dS is in SMEM / every one is done with the keys.
        self.shared, self.keys_read = barriers if barriers else (None, None)
        self.dq_ref, self.wg, self.wgs, self.by_rows = dq_ref, wg, wgs, by_rows
        self.width = dq_ref.shape[-1] // (1 if by_rows else wgs)
        self.b, self.h, self.ki, self.heads = b, h, ki, heads
        self.block_q, self.scale, self.ordered = block_q, scale, ordered
        self.num_q_tiles, self.first_block = num_q_tiles, first_block
        self.sems = None
        # Split by columns, each warpgroup's slice keeps an order of its own.
        self.chains = 1 if by_rows else wgs
        if ordered:  # zeroed for every call (Mosaic GPU zero-fills global scratch)
            batch = dq_ref.shape[0]
            self.sems = pl.get_global(plgpu.SemaphoreType.REGULAR(
                (batch * heads * num_q_tiles * self.chains,)))

    @staticmethod
    def scratch(wgs: int, block_kv: int, block_q: int, head_dim: int, by_rows: bool,
                dtype) -> list:
        """dS tiles (split by columns: two steps' worth, as a warpgroup may still read
        the last step's while the other writes this one's), each warpgroup's float32 dq
        slice, and (by columns) the barriers the warpgroups meet at once their dS is in
        and once they are done reading each other's keys."""
        f32_transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        width = head_dim if by_rows else head_dim // wgs
        return [plgpu.SMEM((1 if by_rows else 2, wgs, block_kv, block_q), dtype,
                           transforms=tile_transforms(dtype)),
                plgpu.SMEM((wgs, block_q, width), jnp.float32, transforms=f32_transforms),
                *([] if by_rows else [plgpu.Barrier(num_arrivals=wgs, num_barriers=2),
                                      plgpu.Barrier(num_arrivals=wgs)])]

    def wait_for_keys(self, kv_ready) -> None:
        """By columns: also waits for the other warpgroups' key tiles (`kv_ready` slot
        `2 w` is warpgroup `w`'s K), which this warpgroup's dq slice reads."""
        if self.by_rows:
            return
        for j in range(1, self.wgs):
            plgpu.barrier_wait(kv_ready.at[2 * lax.rem(self.wg + j, self.wgs)])

    def _sem(self, tile):
        tile_index = (self.b * self.heads + self.h) * self.num_q_tiles + tile
        chain = 0 if self.by_rows else self.wg
        return self.sems.at[tile_index * self.chains + chain]

    def _buf(self, step):
        return 0 * step if self.by_rows else lax.rem(step, 2)

    def share_ds(self, ds16_t: jax.Array, step) -> None:
        """Writes this warpgroup's dS^T tile (keys x queries) for step `step`; split by
        columns, waits until every warpgroup's is written."""
        buf = self._buf(step)
        self.ds_smem.at[buf, self.wg][...] = ds16_t
        plgpu.commit_smem()
        if self.shared is not None:
            plgpu.barrier_arrive(self.shared.at[buf])
            plgpu.barrier_wait(self.shared.at[buf])

    def product(self, acc_ref, k_smem, step) -> None:
        """`acc += dS K[:, columns]`: over every warpgroup's key rows (split by columns,
        this warpgroup's own first; indices stay traced values) or its own (by rows)."""
        buf = self._buf(step)
        for j in range(1 if self.by_rows else self.wgs):
            src = lax.rem(self.wg + j, self.wgs)
            keys = k_smem.at[src]
            if not self.by_rows:
                keys = keys.at[:, pl.ds(self.wg * self.width, self.width)]
            plgpu.wgmma(acc_ref, self.ds_smem.at[buf, src].transpose((1, 0)), keys)

    def add(self, dq_part: jax.Array, tile, last_tile) -> jax.Array:
        """Adds `scale * dq_part` into dq's rows of `tile` (this warpgroup's columns);
        ordered, first signals `last_tile`'s add complete, then waits for this
        warpgroup's turn at `tile`. Returns `tile` (the next call's `last_tile`)."""
        mine = self.dq_smem.at[self.wg]
        if self.ordered:
            plgpu.wait_smem_to_gmem(0)  # the last add has landed in global memory

            @pl.when(last_tile >= 0)
            def _():
                plgpu.semaphore_signal(self._sem(last_tile), 1, memory_scope="gpu")
        else:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add read `mine`
        mine[...] = dq_part * self.scale
        plgpu.commit_smem()
        if self.ordered:
            turn = self.ki - self.first_block(tile)
            if self.by_rows:  # both warpgroups add into the same elements
                turn = turn * self.wgs + self.wg
            plgpu.semaphore_wait(self._sem(tile), turn, decrement=False, memory_scope="gpu")
        rows = pl.ds(tile * self.block_q, self.block_q)
        cols = pl.ds(0 if self.by_rows else self.wg * self.width, self.width)
        plgpu.copy_smem_to_gmem(mine, self.dq_ref.at[self.b, rows, self.h, cols],
                                reduction_op="add")
        return tile

    def finish(self, last_tile) -> None:
        """Ordered: signals the warpgroup's last add once it has landed. By columns:
        waits until no warpgroup reads this one's keys (its dk goes over them next)."""
        if self.ordered:
            plgpu.wait_smem_to_gmem(0)

            @pl.when(last_tile >= 0)
            def _():
                plgpu.semaphore_signal(self._sem(last_tile), 1, memory_scope="gpu")
        if self.keys_read is not None:
            plgpu.barrier_arrive(self.keys_read)
            plgpu.barrier_wait(self.keys_read)
