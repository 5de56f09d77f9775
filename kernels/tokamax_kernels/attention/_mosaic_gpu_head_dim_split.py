"""Head-dim halves for the Mosaic GPU attention backward kernels at head dim 256.

A `wgmma` accumulator has at least 64 rows a warpgroup: dk and dv of 64 key rows at d256
are 2 x 64 x 256 float32 over 128 threads, 256 registers a thread before the score tiles,
over the hardware's 255. Split in halves of 128 columns they take 128 (+64 for the two
64 x 64 score tiles), each half recomputing the full-width scores (`q k^T` and `do v^T`
need every column):

* dk/dv always splits: two compute warpgroups share the block's 64 key rows and one K/V
  copy in SMEM, each accumulating `dv[:, half] += p^T do[:, half]` and
  `dk[:, half] += ds^T q[:, half]`. SMEM: K, V 64 KiB + a 2-slot Q/dO ring 128 KiB.
* dq splits with two compute warpgroups (sharing 64 query rows likewise); one warpgroup
  holds the whole 64 x 256 (192 registers with the score tiles); two with rows of their
  own would need 256 KiB of SMEM.

The split costs score recomputation: the dk/dv kernel does 1.5x the `wgmma` work of an
unsplit one, the split dq kernel 5/3x. The warpgroups meet at a barrier
(`written_barrier`, `wait_for_both`) before writing their halves over the shared tiles
(the other may still read them), and again before the TMA stores, which need the whole,
contiguous tile (`store`). Without a split every helper is the identity or the plain
store, so the d<=128 kernels trace as before.
"""

from __future__ import annotations

import functools

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def columns(ref, half, width: int):
    """`ref`'s columns that a split warpgroup owns (`half` of them, `width` wide), or all
    of `ref` without a split (`half` None)."""
    return ref if half is None else ref.at[:, pl.ds(half * width, width)]


def own_tile(ref, wg, split: bool):
    """The warpgroup's own row tile of `ref`, or the one tile (no leading axis) that split
    warpgroups share (a constant index would not survive `pl.run_state`'s lowering)."""
    return ref if split else ref.at[wg]


def written_barrier(split: bool) -> list:
    """The barrier that two warpgroups sharing their rows' tiles meet at (none without)."""
    return [plgpu.Barrier(num_arrivals=2)] if split else []


def wait_for_both(written: list) -> None:
    """Both warpgroups got here (no-op without a split)."""
    for barrier in written:
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)


def store(written: list, wg, copies: list) -> None:
    """TMA stores `(smem, gmem)` of a block's results, written and fenced: split
    warpgroups first wait for each other's halves, then take one store each (warpgroup
    `i` the `i`-th)."""
    wait_for_both(written)
    for i, (smem, gmem) in enumerate(copies):
        if written:
            pl.when(wg == i)(functools.partial(plgpu.copy_smem_to_gmem, smem, gmem))
        else:
            plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)
