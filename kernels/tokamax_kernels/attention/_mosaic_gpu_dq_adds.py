"""The one-pass Mosaic attention backward's dq (`mosaic_attention_fused_bwd`): the dk/dv
kernel multiplies each tile's dS by its keys, and a warp of the memory warpgroup
TMA-reduce-adds each float32 share into dq in global memory, in a fixed order through
semaphores ("ordered") or as the adds land ("atomic"). What a block needs for that: its
SMEM, the hand-over between the compute warpgroups and the issuing warp, the adds and
the turn-taking.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax_kernels.attention import _window
from tokamax_kernels.attention._mosaic_gpu_common import tile_transforms

# The memory warpgroup's warps: one streams the query tiles in, one issues the dq adds.
LOAD_WARP = 0
DQ_WARP = 1


def first_kv_block(window: tuple[int, int] | None, block_q: int, block_rows: int,
                    num_kv_blocks: int):
    """`tile -> the first key block that adds into query tile `tile`'s dq` (0 without a
    window: causal masks only later blocks out)."""
    if window is None:
        return lambda tile: 0
    return lambda tile: _window.kv_tiles(window, tile * block_q, block_q, block_rows,
                                         num_kv_blocks).first


class DqAdds:
    """A fused dk/dv kernel's dq, FlashAttention-3's way: each step, every compute
    warpgroup multiplies dS by keys, stores the float32 product in SMEM and goes on with
    its next tile, and the memory warpgroup's `DQ_WARP` TMA-adds the products into dq's
    tile in global memory, so no compute warpgroup waits for an add to land or for its
    turn. A warpgroup waits only before storing its next product, until the warp has
    read the last one (`dq_free`); the warp waits for every warpgroup's product
    (`dq_full`). Split by columns, the warpgroups share their dS^T tiles through SMEM
    (meeting at a barrier) and each takes a column slice of the keys of all of them;
    split by rows, each multiplies its own dS by its own keys, full width (twice the
    adds, no barrier).

    Ordered, a global semaphore per (batch, head, query tile) counts the key blocks
    whose adds have landed: the block `r` places in the tile's order (`r`-th block that
    sees the tile) adds once `r` have, and signals its own as soon as the warp has seen
    them land. Split by rows the two warpgroups' products add into the same elements,
    so the warp lets the first land before it issues the second.
    """

    def __init__(self, dq_ref, scratch, *, wg, wgs: int, by_rows: bool, b, h, ki,
                 heads: int, block_q: int, scale: float, ordered: bool, num_q_tiles: int,
                 first_block):
        self.ds_smem, self.dq_smem, self.dq_full, self.dq_free, *barriers = scratch
        # By columns: every warpgroup's dS is in SMEM / every one is done with the keys.
        self.shared: Any
        self.keys_read: Any
        self.shared, self.keys_read = barriers if barriers else (None, None)
        self.dq_ref, self.wg, self.wgs, self.by_rows = dq_ref, wg, wgs, by_rows
        self.width = dq_ref.shape[-1] // (1 if by_rows else wgs)
        self.b, self.h, self.ki, self.heads = b, h, ki, heads
        self.block_q, self.scale, self.ordered = block_q, scale, ordered
        self.num_q_tiles, self.first_block = num_q_tiles, first_block
        self.sems = None
        if ordered:  # zeroed for every call (Mosaic GPU zero-fills global scratch)
            batch = dq_ref.shape[0]
            self.sems = pl.get_global(plgpu.SemaphoreType.REGULAR(
                (batch * heads * num_q_tiles,)))

    @staticmethod
    def scratch(wgs: int, block_kv: int, block_q: int, head_dim: int, by_rows: bool,
                dtype) -> list:
        """dS tiles (split by columns: two steps' worth, as a warpgroup may still read
        the last step's while the other writes this one's), each warpgroup's float32 dq
        product, the hand-over barriers (products written / read by the warp) and (by
        columns) the barriers the warpgroups meet at once their dS is in and once they
        are done reading each other's keys."""
        # JAX declares both transforms abstract (`transform_array`), yet builds them itself.
        f32_transforms = (plgpu.TilingTransform((8, 32)),  # type: ignore[abstract]
                          plgpu.SwizzleTransform(128))  # type: ignore[abstract]
        width = head_dim if by_rows else head_dim // wgs
        return [plgpu.SMEM((1 if by_rows else 2, wgs, block_kv, block_q), dtype,
                           transforms=tile_transforms(dtype)),
                plgpu.SMEM((wgs, block_q, width), jnp.float32, transforms=f32_transforms),
                plgpu.Barrier(num_arrivals=wgs), plgpu.Barrier(),
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
        return self.sems.at[(self.b * self.heads + self.h) * self.num_q_tiles + tile]

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

    def hand_over(self, dq_part: jax.Array, step) -> None:
        """Stores `scale * dq_part` (this warpgroup's product of step `step`) for the
        warp to add, once the warp has read the last one."""
        @pl.when(step > 0)
        def _():
            plgpu.barrier_wait(self.dq_free)

        self.dq_smem.at[self.wg][...] = dq_part * self.scale
        plgpu.commit_smem()
        plgpu.barrier_arrive(self.dq_full)

    def finish(self) -> None:
        """By columns: waits until no warpgroup reads this one's keys (its dk goes over
        them next)."""
        if self.keys_read is not None:
            plgpu.barrier_arrive(self.keys_read)
            plgpu.barrier_wait(self.keys_read)

    def issue(self, steps, tile_of) -> None:
        """`DQ_WARP`'s loop: adds the products of steps `0 .. steps - 1` (step `s` into
        query tile `tile_of(s)`), each once every warpgroup has handed its over, and
        frees the products' SMEM as soon as the adds have read it. Ordered, it then
        waits for the adds to land and signals them at once: the warp has nothing else
        to do, and the next key block's turn at the tile comes that much sooner."""
        @pl.loop(0, steps)
        def _(step):
            tile = tile_of(step)
            plgpu.barrier_wait(self.dq_full)
            if self.ordered:
                turn = self.ki - self.first_block(tile)
                plgpu.semaphore_wait(self._sem(tile), turn, decrement=False,
                                     memory_scope="gpu")
            rows = pl.ds(tile * self.block_q, self.block_q)
            for w in range(self.wgs):
                if self.ordered and self.by_rows and w:
                    plgpu.wait_smem_to_gmem(0)  # the same elements: one add at a time
                cols = pl.ds(0 if self.by_rows else w * self.width, self.width)
                plgpu.copy_smem_to_gmem(self.dq_smem.at[w],
                                        self.dq_ref.at[self.b, rows, self.h, cols],
                                        reduction_op="add")
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(self.dq_free)
            if self.ordered:
                plgpu.wait_smem_to_gmem(0)  # landed in global memory
                plgpu.semaphore_signal(self._sem(tile), 1, memory_scope="gpu")

        plgpu.wait_smem_to_gmem(0)
