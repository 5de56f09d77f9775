"""The Mosaic GPU flash-attention backward kernels for Hopper: dq, then dk and dv.

Both recompute the probabilities from the forward's log-sum-exp `lse` and use
`delta = rowsum(out * dout)`. Neither uses atomics, so reruns are bitwise identical:

* dq: a block owns `compute_wgs * block_q` query rows of one head; K/V tiles stream in.
  `mosaic_attention_dq_and_delta` also sums delta from its rows of `out` and `dout`
  before its first tile and writes it out for dk/dv, in place of a separate pass.
* dk/dv: a block owns `compute_wgs * block_kv` key rows and one query head (GQA/MQA
  shares of a K/V head are summed outside); Q, dO, lse, delta tiles stream in. With
  `group_in_block` a block owns the rows of one K/V head instead and walks the query
  tiles of each query head of its group in turn, adding them up in registers.
Causal blocks skip the tiles above the diagonal (the memory warpgroup never loads them).
Each step of both issues the scores' and dP's `wgmma`s together and runs the softmax while
dP's runs (FlashAttention-3's order; the one pass below keeps the scores alone first).

Head dim 256 (`splits_head_dim`) splits the accumulated columns in halves of 128 between
two warpgroups sharing their rows (`_mosaic_gpu_head_dim_split.py`): always in the dk/dv
kernel (dk + dv whole would take 256 registers a thread, over the hardware's 255), and in
the dq kernel with `compute_wgs=2` (one warpgroup holds its 64 x 256 whole).

One pass (`mosaic_attention_fused_bwd`, a config choice, head dims up to 128): the dk/dv
kernel also computes dq; the compute warpgroups hand each tile's float32 share to a warp
of the memory warpgroup, which adds it into global memory with TMA reduce-adds
(`_mosaic_gpu_dq_adds.py`) while another warp streams the query tiles in: in a fixed
order through semaphores ("ordered", bitwise reruns) or as they land ("atomic", not
reproducible). Fused, a block walks its query tiles last to first.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax_kernels.attention import _window
from tokamax_kernels.attention._mosaic_gpu_common import (
    COMPUTE_REGISTERS,
    LOG2E,
    MEMORY_REGISTERS,
    MosaicAttentionVjpConfig,
    mask_scores,
    query_block,
    splits_head_dim,
    tile_transforms,
)
from tokamax_kernels.attention._mosaic_gpu_dq_adds import (
    DQ_WARP,
    LOAD_WARP,
    DqAdds,
    first_kv_block,
)
from tokamax_kernels.attention._mosaic_gpu_head_dim_split import (
    columns,
    own_tile,
    store,
    wait_for_both,
    written_barrier,
)

_WGMMA = plgpu.Layout.WGMMA
_PARAMS = plgpu.CompilerParams(approx_math=True)


def _acc(shape: tuple[int, int]) -> jax.Array:
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), _WGMMA)


def _scores_in_log2(s: jax.Array, qk_scale: float, scale: float, soft_cap: float | None
                    ) -> tuple[jax.Array, jax.Array | None]:
    """Raw `q . k` scores as the (soft-capped) logits in log2 units, and the cap's
    `tanh(scale * s / cap)` (None without a cap) for the derivative."""
    if soft_cap is None:
        return s * qk_scale, None
    capped = jnp.tanh(s * (scale / soft_cap))
    return capped * (soft_cap * LOG2E), capped


def mosaic_attention_dq(q, k, v, dout, lse, delta, kv_lengths=None, *, scale: float,
                        causal: bool, config: MosaicAttentionVjpConfig,
                        window: tuple[int, int] | None = None,
                        soft_cap: float | None = None) -> jax.Array:
    """dq (B, Sq, H, D) in q's dtype; `kv_lengths` (B,) int32, `window`, `soft_cap` as in
    the forward (a block streams only the K/V tiles its rows see). At d256 two compute
    warpgroups split the head dim of shared rows; one holds it whole."""
    return _dq_kernel(q, k, v, dout, lse, delta, kv_lengths, scale=scale, causal=causal,
                      config=config, window=window, soft_cap=soft_cap, delta_in_kernel=False)


def computes_delta(head_dim: int) -> bool:
    """Whether `mosaic_attention_dq_and_delta` takes this head dim: up to 128. At d256
    two warpgroups split a row's columns, and one warpgroup's 64 x 256 row tile of `out`
    does not fit beside its Q, dO and two K/V stages (224 KiB)."""
    return not splits_head_dim(head_dim)


def mosaic_attention_dq_and_delta(q, k, v, dout, out, lse, kv_lengths=None, *, scale: float,
                                  causal: bool, config: MosaicAttentionVjpConfig,
                                  window: tuple[int, int] | None = None,
                                  soft_cap: float | None = None
                                  ) -> tuple[jax.Array, jax.Array]:
    """`(dq, delta)`: `mosaic_attention_dq` with the row term `delta = rowsum(out * dout)`
    ((B, H, Sq) float32) computed by the dq kernel itself from the rows of `out` and
    `dout` it holds, and written out for the dk/dv kernel: no separate pass over `out`
    and `dout` (`attention_delta`). Each row sums in the order the compiled kernel fixes,
    so reruns stay bitwise equal. Needs `computes_delta(head_dim)`."""
    if not computes_delta(q.shape[3]):
        raise ValueError(f"the dq kernel computes delta at head dims up to 128, got "
                         f"{q.shape[3]}: use mosaic_attention_dq with attention_delta's "
                         f"delta")
    return _dq_kernel(q, k, v, dout, lse, out, kv_lengths, scale=scale, causal=causal,
                      config=config, window=window, soft_cap=soft_cap, delta_in_kernel=True)


def _dq_kernel(q, k, v, dout, lse, row_input, kv_lengths, *, scale: float, causal: bool,
               config: MosaicAttentionVjpConfig, window: tuple[int, int] | None,
               soft_cap: float | None, delta_in_kernel: bool):
    """The dq kernel; `row_input` is `delta`, or with `delta_in_kernel` the forward's
    `out`, from which the kernel computes delta and returns it beside dq."""
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = q.dtype
    block_q, block_kv, wgs = config.block_q_dq, config.block_kv_dq, config.compute_wgs
    split = splits_head_dim(head_dim) and wgs == 2
    width = head_dim // 2 if split else head_dim  # dq columns a warpgroup accumulates
    own = () if split else (wgs,)  # row tiles a block holds: split warpgroups share one
    block_rows = block_q if split else wgs * block_q
    stages = max(1, min(config.num_stages, seq_kv // block_kv))
    qk_scale = scale * LOG2E
    has_lengths = kv_lengths is not None
    num_kv_blocks = seq_kv // block_kv
    num_q_blocks = seq_q // block_rows

    def body(*refs):
        q_ref, k_ref, v_ref, do_ref, lse_ref, row_ref, *refs = refs
        lengths_ref = refs.pop(0) if has_lengths else None
        dq_ref, *refs = refs
        delta_out_ref = refs.pop(0) if delta_in_kernel else None
        o_smem = refs.pop(0) if delta_in_kernel else None
        (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
         row_ready, k_ready, v_ready, consumed, *written) = refs
        b, h = lax.axis_index("batch"), lax.axis_index("heads")
        qi = query_block(num_q_blocks, config.longest_first and causal)
        wg = lax.axis_index("wg")
        kv_len = lengths_ref[b] if has_lengths else None

        def num_steps(q_end):
            """K/V tiles that rows below `q_end` see."""
            steps = seq_kv // block_kv
            if causal:
                steps = jnp.minimum(lax.div(q_end + block_kv - 1, block_kv), steps)
            if has_lengths:
                steps = jnp.minimum(lax.div(kv_len + block_kv - 1, block_kv), steps)
            return steps

        block_steps = num_steps((qi + 1) * block_rows)
        block_first = 0
        if window is not None:  # the tiles any row of the block sees
            block_tiles = _window.kv_tiles(window, qi * block_rows, block_rows,
                                           block_kv, num_kv_blocks, kv_len)
            block_first, block_steps = block_tiles.first, block_tiles.end

        def slot_of(step):
            """The ring slot of K/V tile `step` (the block's first tile takes slot 0)."""
            return lax.rem(step if window is None else step - block_first, stages)

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            q_base = qi * block_rows if split else qi * block_rows + wg * block_q
            half = wg if split else None
            rows = (b, pl.ds(q_base, block_q), h)
            vec = (b, h, pl.ds(q_base, block_q))
            mine = 0 if split else wg  # this warpgroup's row barriers
            my_q, my_do = own_tile(q_smem, wg, split), own_tile(do_smem, wg, split)
            my_lse, my_delta = own_tile(lse_smem, wg, split), own_tile(delta_smem, wg, split)
            my_o = own_tile(o_smem, wg, split) if delta_in_kernel else None

            def load_rows():
                plgpu.copy_gmem_to_smem(q_ref.at[rows], my_q, row_ready.at[4 * mine])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], my_do, row_ready.at[4 * mine + 1])
                plgpu.copy_gmem_to_smem(lse_ref.at[vec], my_lse, row_ready.at[4 * mine + 2])
                if delta_in_kernel:  # this warpgroup's rows of the forward's output
                    plgpu.copy_gmem_to_smem(row_ref.at[rows], my_o, row_ready.at[4 * mine + 3])
                else:
                    plgpu.copy_gmem_to_smem(row_ref.at[vec], my_delta,
                                            row_ready.at[4 * mine + 3])

            if split:  # one copy of the shared rows
                pl.when(wg == 0)(load_rows)
            else:
                load_rows()
            for i in range(4):
                plgpu.barrier_wait(row_ready.at[4 * mine + i])
            lse2 = plgpu.load(my_lse, layout=_WGMMA.reduce(1)) * LOG2E
            if delta_in_kernel:
                o = plgpu.load(my_o, layout=_WGMMA).astype(jnp.float32)
                do = plgpu.load(my_do, layout=_WGMMA).astype(jnp.float32)
                delta_i = jnp.sum(o * do, axis=1)
                my_delta[...] = delta_i
                plgpu.commit_smem()
                # Lands before the block ends: `store` waits for every TMA store.
                plgpu.copy_smem_to_gmem(my_delta, delta_out_ref.at[vec])
            else:
                delta_i = plgpu.load(my_delta, layout=_WGMMA.reduce(1))
            steps = num_steps(q_base + block_q)

            def kv_step(step, dq_acc, *, masked):
                slot = slot_of(step)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])

                def scores_and_ds(s_ref, dp_ref):
                    # dO V^T runs while the softmax of Q K^T does (FlashAttention-3's order).
                    plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, my_do, v_smem.at[slot].transpose((1, 0)))
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                    s, capped = _scores_in_log2(s, qk_scale, scale, soft_cap)
                    if masked:
                        s = mask_scores(s, q_base, step * block_kv, causal=causal,
                                        kv_len=kv_len, window=window)
                    p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [0]))
                    # The soft cap's derivative rides on p: d(capped)/d(scaled) = 1 - tanh^2.
                    p_ds = p if capped is None else p * (1.0 - capped * capped)
                    dp = dp_ref[...]
                    return p_ds * (dp - lax.broadcast_in_dim(delta_i, dp.shape, [0]))

                acc = plgpu.ACC((block_q, block_kv), jnp.float32)
                ds = pl.run_scoped(scores_and_ds, acc, acc)

                def dq_product(acc_ref):
                    plgpu.wgmma(acc_ref, ds.astype(dtype), columns(k_smem.at[slot], half, width))

                dq_acc = pl.run_state(dq_product)(plgpu.ACC.init(dq_acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return dq_acc

            def drain_step(step, _):
                slot = slot_of(step)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])

            def masked_step(i, c):
                return kv_step(i, c, masked=True)

            if window is not None:
                tiles = _window.kv_tiles(window, q_base, block_q, block_kv, num_kv_blocks,
                                         kv_len)
                lax.fori_loop(block_first, tiles.first, drain_step, None)
                dq_acc = lax.fori_loop(tiles.first, tiles.full_first, masked_step,
                                       _acc((block_q, width)))
                dq_acc = lax.fori_loop(tiles.full_first, tiles.full_end,
                                       lambda i, c: kv_step(i, c, masked=False), dq_acc)
                dq_acc = lax.fori_loop(tiles.full_end, tiles.end, masked_step, dq_acc)
                lax.fori_loop(tiles.end, block_steps, drain_step, None)
            else:
                # Tiles before `unmasked` need no mask; the rest cross the diagonal or the
                # length.
                unmasked = (jnp.minimum(lax.div(kv_len, block_kv), steps) if has_lengths
                            else steps)
                if causal:
                    unmasked = jnp.minimum(lax.div(q_base, block_kv), unmasked)
                dq_acc = lax.fori_loop(0, unmasked, lambda i, c: kv_step(i, c, masked=False),
                                       _acc((block_q, width)))
                if causal or has_lengths:
                    dq_acc = lax.fori_loop(unmasked, steps, masked_step, dq_acc)
                if causal:
                    lax.fori_loop(steps, block_steps, drain_step, None)
            wait_for_both(written)  # the other warpgroup is done reading Q
            columns(my_q, half, width)[...] = (dq_acc * scale).astype(dtype)
            plgpu.commit_smem()
            store(written, wg, [(my_q, dq_ref.at[rows])])

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            kv_h = lax.div(h, group)

            @pl.loop(block_first, block_steps)
            def _(step):
                slot = slot_of(step)
                rows = (b, pl.ds(step * block_kv, block_kv), kv_h)

                @pl.when(step >= block_first + stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

    transforms = tile_transforms(dtype)
    scratch = [
        # With delta_in_kernel, each warpgroup's rows of the forward's output.
        *([plgpu.SMEM((*own, block_q, head_dim), dtype, transforms=transforms)]
          if delta_in_kernel else []),
        plgpu.SMEM((*own, block_q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((*own, block_q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((*own, block_q), jnp.float32),
        plgpu.SMEM((*own, block_q), jnp.float32),
        plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=4 * (1 if split else wgs)),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        *written_barrier(split),
    ]
    out_type: jax.ShapeDtypeStruct | tuple[jax.ShapeDtypeStruct, ...]
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    if delta_in_kernel:
        out_type = (out_type, jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32))
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(heads, num_q_blocks, batch),
        grid_names=("heads", "q", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=_PARAMS,
    )(q, k, v, dout, lse, row_input, *([kv_lengths] if has_lengths else []))


def mosaic_attention_dkv(q, k, v, dout, lse, delta, kv_lengths=None, *, scale: float,
                         causal: bool, config: MosaicAttentionVjpConfig,
                         window: tuple[int, int] | None = None,
                         soft_cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(dk, dv), each (B, Sk, Hkv, D) in k's dtype; `window` and `soft_cap` as in the
    forward (a block streams only the query tiles that see its keys).

    The grid runs over query heads: each block writes one query head's share of dk/dv,
    and the GQA/MQA shares of a K/V head are summed in float32 outside the kernel; with
    `config.group_in_block` it runs over K/V heads, each block adding up its group's
    shares in registers (no per-query-head buffer, no sum after, one rounding). With
    `kv_lengths` every tile is masked by the length (keys past it get zero gradients).
    At d256 two compute warpgroups split the head dim of shared key rows, whatever
    `compute_wgs` (which picks the dq kernel's form there).
    """
    dq_acc, (dk, dv) = _dkv_kernel(q, k, v, dout, lse, delta, kv_lengths, scale=scale,
                                   causal=causal, config=config, window=window,
                                   soft_cap=soft_cap, dq_order=None)
    del dq_acc
    return dk, dv


def fused_fits(head_dim: int, compute_wgs: int, dq_split: str) -> bool:
    """Whether the one-pass backward takes this head dim: no head-dim split (d256 holds
    no room for the dq tiles), and split by columns, slices at least 64 wide (a whole
    `wgmma` tile of the swizzled K)."""
    return not splits_head_dim(head_dim) and (
        dq_split == "rows" or head_dim // compute_wgs >= 64)


def mosaic_attention_fused_bwd(q, k, v, dout, lse, delta, kv_lengths=None, *, scale: float,
                               causal: bool, config: MosaicAttentionVjpConfig,
                               window: tuple[int, int] | None = None,
                               soft_cap: float | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in one pass over the tile pairs: the dk/dv kernel also multiplies
    each tile's dS by its keys and adds the float32 share into dq (TMA reduce-add).

    `config.dq_accumulation` "ordered" makes the key blocks of a query tile add in a
    fixed order (a global semaphore per query tile counts the adds done; a block waits
    for its turn), so reruns are bitwise equal; "atomic" lets them land as they come.
    Blocks walk their query tiles last to first, so under a causal mask or a window
    (where a later key block starts at a later tile) the block before a block in turn
    order has already passed each tile: waits are short. The adds, the waits for a
    turn and the signals are a warp's of the memory warpgroup (`DqAdds.issue`), so a
    compute warpgroup waits on none of them.
    """
    if not fused_fits(q.shape[-1], config.compute_wgs, config.dq_split):
        raise NotImplementedError(
            f"one-pass dq needs head_dim <= 128 and, split by columns, head_dim // "
            f"compute_wgs >= 64; got head_dim {q.shape[-1]}, compute_wgs "
            f"{config.compute_wgs}, dq_split {config.dq_split!r}")
    dq_acc, (dk, dv) = _dkv_kernel(q, k, v, dout, lse, delta, kv_lengths, scale=scale,
                                   causal=causal, config=config, window=window,
                                   soft_cap=soft_cap,
                                   dq_order=config.dq_accumulation == "ordered")
    return dq_acc.astype(q.dtype), dk, dv


def _dkv_kernel(q, k, v, dout, lse, delta, kv_lengths, *, scale: float, causal: bool,
                config: MosaicAttentionVjpConfig, window: tuple[int, int] | None,
                soft_cap: float | None, dq_order: bool | None):
    """The dk/dv kernel; with `dq_order` not None also dq's float32 sum (ordered adds
    when True). Returns (dq float32 or None, (dk, dv))."""
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = q.dtype
    block_q, block_kv, wgs = config.block_q_dkv, config.block_kv_dkv, config.compute_wgs
    split = splits_head_dim(head_dim)
    wgs = 2 if split else wgs  # d256: a warpgroup per half, whatever `compute_wgs`
    width = head_dim // 2 if split else head_dim  # dk/dv columns a warpgroup accumulates
    own = () if split else (wgs,)  # key row tiles a block holds: split warpgroups share one
    block_rows = block_kv if split else wgs * block_kv
    num_q_tiles = seq_q // block_q
    num_kv_blocks = seq_kv // block_rows
    stages = max(1, min(config.num_stages, num_q_tiles))
    qk_scale = scale * LOG2E
    has_lengths = kv_lengths is not None
    fused = dq_order is not None
    # A block per K/V head walking its group's query heads (`group == 1`: the same thing).
    in_block = config.group_in_block and group > 1
    # Fused: each warpgroup adds a column slice of dq over all key rows of the block
    # ("columns"), or the full width over its own rows ("rows").
    by_rows = config.dq_split == "rows" or wgs == 1
    dq_width = head_dim if by_rows else head_dim // wgs  # dq columns a warpgroup adds

    def first_tile(kv_base):
        """The first query tile with a row at or after key `kv_base` (0 unless causal)."""
        return jnp.minimum(lax.div(kv_base, block_q), num_q_tiles) if causal else 0

    def body(*refs):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
        lengths_ref = refs.pop(0) if has_lengths else None
        dq_ref = refs.pop(0) if fused else None
        (dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
         kv_ready, q_ready, do_ready, lse_ready, delta_ready, consumed, *extra) = refs
        written = [] if fused else extra
        b, h, ki = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("kv")
        wg = lax.axis_index("wg")
        kv_len = lengths_ref[b] if has_lengths else None
        block_first = first_tile(ki * block_rows)
        block_end = num_q_tiles
        if window is not None:  # the query tiles that see any key of the block
            block_tiles = _window.q_tiles(window, ki * block_rows, block_rows,
                                          block_q, num_q_tiles)
            block_first, block_end = block_tiles.first, block_tiles.end

        dq_adds = DqAdds(dq_ref, extra, wg=wg, wgs=wgs, by_rows=by_rows, b=b, h=h, ki=ki,
                         heads=heads, block_q=block_q, scale=scale, ordered=dq_order,
                         num_q_tiles=num_q_tiles,
                         first_block=first_kv_block(window, block_q, block_rows,
                                                    num_kv_blocks)
                         ) if fused else None

        def position(tile):
            """Where `tile` comes in the block's walk: first to last, or (fused) last
            to first."""
            return tile - block_first if not fused else block_end - 1 - tile

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            kv_base = ki * block_rows if split else ki * block_rows + wg * block_kv
            half = wg if split else None
            kv_rows = (b, pl.ds(kv_base, block_kv), h if in_block else lax.div(h, group))
            mine = 0 if split else wg  # this warpgroup's K/V barriers
            my_k, my_v = own_tile(k_smem, wg, split), own_tile(v_smem, wg, split)

            def load_rows():
                plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], my_k, kv_ready.at[2 * mine])
                plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], my_v, kv_ready.at[2 * mine + 1])

            if split:  # one copy of the shared rows
                pl.when(wg == 0)(load_rows)
            else:
                load_rows()
            plgpu.barrier_wait(kv_ready.at[2 * mine])
            plgpu.barrier_wait(kv_ready.at[2 * mine + 1])
            first = first_tile(kv_base)
            # Query tiles that cross the diagonal of this warpgroup's keys need the mask.
            masked_end = jnp.minimum(lax.div(kv_base + block_kv + block_q - 2, block_q),
                                     num_q_tiles)
            if fused:
                dq_adds.wait_for_keys(kv_ready)

            def q_step(tile, carry, *, masked, offset=None):
                dk_acc, dv_acc = carry
                step = position(tile)
                if offset is not None:  # group in block: the earlier heads' walks
                    step = step + offset
                slot = lax.rem(step, stages)
                plgpu.barrier_wait(q_ready.at[slot])
                plgpu.barrier_wait(do_ready.at[slot])

                def scores_t(s_ref):
                    plgpu.wgmma(s_ref, my_k, q_smem.at[slot].transpose((1, 0)))

                def dp_t_product(dp_ref):
                    plgpu.wgmma(dp_ref, my_v, do_smem.at[slot].transpose((1, 0)))

                def probabilities(s_t):
                    """P^T in `dtype` (for dv) and in float32 times the soft cap's
                    derivative (for dS^T), from the raw scores S^T."""
                    s_t, capped = _scores_in_log2(s_t, qk_scale, scale, soft_cap)
                    if masked or has_lengths:
                        if window is None:
                            s_t = mask_scores(s_t, kv_base, tile * block_q, causal=masked,
                                              kv_len=kv_len, q_on_rows=False)
                        else:
                            s_t = mask_scores(s_t, kv_base, tile * block_q, causal=False,
                                              kv_len=kv_len, q_on_rows=False,
                                              window=window if masked else None)
                    plgpu.barrier_wait(lse_ready.at[slot])
                    lse2 = plgpu.load(lse_smem.at[slot], layout=_WGMMA.reduce(0)) * LOG2E
                    p_t = jnp.exp2(s_t - lax.broadcast_in_dim(lse2, s_t.shape, [1]))
                    p16_t = p_t.astype(dtype)
                    if capped is not None:  # d(capped)/d(scaled) = 1 - tanh^2
                        p_t = p_t * (1.0 - capped * capped)
                    return p16_t, p_t

                def dscores(p_t, dp_t):
                    """dS^T in `dtype`."""
                    plgpu.barrier_wait(delta_ready.at[slot])
                    delta_t = plgpu.load(delta_smem.at[slot], layout=_WGMMA.reduce(0))
                    return (p_t * (dp_t - lax.broadcast_in_dim(delta_t, dp_t.shape, [1]))
                            ).astype(dtype)

                def dv_product(dv_ref_, p16_t):
                    plgpu.wgmma(dv_ref_, p16_t, columns(do_smem.at[slot], half, width))

                def dk_product(dk_ref_, ds16_t):
                    plgpu.wgmma(dk_ref_, ds16_t, columns(q_smem.at[slot], half, width))

                acc = plgpu.ACC((block_kv, block_q), jnp.float32)
                if not fused:
                    def scores_and_ds(s_ref, dp_ref):
                        # V dO^T runs while the softmax of K Q^T does (FlashAttention-3's
                        # order): 2-4% faster forward+backward than the one-pass's below.
                        scores_t(s_ref)
                        dp_t_product(dp_ref)
                        p16_t, p_t = probabilities(
                            plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
                        return p16_t, dscores(p_t, dp_ref[...])

                    p16_t, ds16_t = pl.run_scoped(scores_and_ds, acc, acc)

                    def dv_and_dk(refs):
                        dv_product(refs[0], p16_t)
                        dk_product(refs[1], ds16_t)

                    dv_acc, dk_acc = pl.run_state(dv_and_dk)(
                        (plgpu.ACC.init(dv_acc), plgpu.ACC.init(dk_acc)))
                    plgpu.barrier_arrive(consumed.at[slot])
                    return dk_acc, dv_acc

                # The one pass waits for the scores alone and multiplies dV with dP: the
                # order above ran it 1-6% slower (its dq tile and the warpgroups' dS
                # barrier each step).
                def scores_alone(s_ref):
                    scores_t(s_ref)
                    return s_ref[...]

                p16_t, p_t = probabilities(pl.run_scoped(scores_alone, acc))

                def dv_and_dp(refs):
                    dv_product(refs[0], p16_t)
                    dp_t_product(refs[1])

                dv_acc, dp_t = pl.run_state(dv_and_dp)(
                    (plgpu.ACC.init(dv_acc), plgpu.ACC.init(_acc((block_kv, block_q)))))
                ds16_t = dscores(p_t, dp_t)
                dq_adds.share_ds(ds16_t, step)

                def dk_and_dq(refs):
                    dk_product(refs[0], ds16_t)
                    dq_adds.product(refs[1], k_smem, step)

                dk_acc, dq_part = pl.run_state(dk_and_dq)(
                    (plgpu.ACC.init(dk_acc), plgpu.ACC.init(_acc((block_q, dq_width)))))
                plgpu.barrier_arrive(consumed.at[slot])
                dq_adds.hand_over(dq_part, step)
                return dk_acc, dv_acc

            def masked_step(tile, carry, offset=None):
                return q_step(tile, carry, masked=True, offset=offset)

            def unmasked_step(tile, carry, offset=None):
                return q_step(tile, carry, masked=False, offset=offset)

            def skip_step(tile, carry, offset=None):
                step = position(tile)
                if offset is not None:
                    step = step + offset
                slot = lax.rem(step, stages)
                for ready in (q_ready, do_ready, lse_ready, delta_ready):
                    plgpu.barrier_wait(ready.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            # Runs of tiles `(first, end, step)` in ascending order. Fused, every warpgroup
            # walks all of the block's tiles (its dS feeds every warpgroup's dq columns):
            # tiles it does not see are masked (zero dS), not skipped.
            skip = masked_step if fused else skip_step
            if window is not None:
                tiles = _window.q_tiles(window, kv_base, block_kv, block_q, num_q_tiles)
                runs = [(block_first, tiles.first, skip),
                        (tiles.first, tiles.full_first, masked_step),
                        (tiles.full_first, tiles.full_end, unmasked_step),
                        (tiles.full_end, tiles.end, masked_step),
                        (tiles.end, block_end, skip)]
            elif causal:
                runs = [(block_first, first, skip), (first, masked_end, masked_step),
                        (masked_end, num_q_tiles, unmasked_step)]
            else:
                runs = [(0, num_q_tiles, unmasked_step)]
            carry = (_acc((block_kv, width)), _acc((block_kv, width)))
            if fused:
                for lo, hi, step_fn in reversed(runs):  # last tile first
                    carry = lax.fori_loop(
                        0, hi - lo, lambda j, c, lo=lo, hi=hi, f=step_fn: f(hi - 1 - j, c),
                        carry)
                dk_acc, dv_acc = carry
                dq_adds.finish()  # no warpgroup reads our keys any more
            elif in_block:
                walk = block_end - block_first  # ring steps per query head

                def head(g, carry):
                    for lo, hi, step_fn in runs:
                        carry = lax.fori_loop(
                            lo, hi, functools.partial(step_fn, offset=g * walk), carry)
                    return carry

                dk_acc, dv_acc = lax.fori_loop(0, group, head, carry)
            else:
                for lo, hi, step_fn in runs:
                    carry = lax.fori_loop(lo, hi, step_fn, carry)
                dk_acc, dv_acc = carry
            wait_for_both(written)  # the other warpgroup is done reading K and V
            columns(my_k, half, width)[...] = (dk_acc * scale).astype(dtype)
            columns(my_v, half, width)[...] = dv_acc.astype(dtype)
            plgpu.commit_smem()
            out_rows = (b, pl.ds(kv_base, block_kv), h)
            store(written, wg, [(my_k, dk_ref.at[out_rows]), (my_v, dv_ref.at[out_rows])])

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def load(step, tile_of, q_head):
                """Query tile `tile_of(step)` of head `q_head` into the ring slot of step
                `step` (the tile computed after the slot, as the kernel always has)."""
                slot = lax.rem(step, stages)
                tile = tile_of(step)
                rows = (b, pl.ds(tile * block_q, block_q), q_head)
                vec = (b, q_head, pl.ds(tile * block_q, block_q))

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[slot], lse_ready.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[slot],
                                        delta_ready.at[slot])

            walk = block_end - block_first
            if in_block:  # each query head of the group in turn, one running step count
                @pl.loop(0, group)
                def _(g):
                    @pl.loop(0, walk)
                    def _(j):
                        load(g * walk + j, lambda _: block_first + j, h * group + g)
            elif fused:  # last tile first; a warp of its own issues the dq adds
                def tile_of(step):
                    return block_end - 1 - step

                @plgpu.warp_map
                def _(warp):
                    @pl.when(warp == LOAD_WARP)
                    def _():
                        @pl.loop(0, walk)
                        def _(step):
                            load(step, tile_of, h)

                    @pl.when(warp == DQ_WARP)
                    def _():
                        dq_adds.issue(walk, tile_of)
            else:
                @pl.loop(0, walk)
                def _(step):
                    load(step, lambda step: block_first + step, h)

    transforms = tile_transforms(dtype)
    scratch = [
        plgpu.SMEM((*own, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((*own, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.Barrier(num_barriers=2 * (1 if split else wgs)),
        *(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        *(DqAdds.scratch(wgs, block_kv, block_q, head_dim, by_rows, dtype) if fused
          else written_barrier(split)),
    ]
    out_heads = kv_heads if in_block else heads
    dkv_type = jax.ShapeDtypeStruct((batch, seq_kv, out_heads, head_dim), dtype)
    operands = [q, k, v, dout, lse, delta, *([kv_lengths] if has_lengths else [])]
    dq_acc: Any = None  # a ref while the kernels add into it, then its array
    if fused:  # added into in place: a zeroed float32 buffer the kernel writes through
        dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
        operands.append(dq_acc)
    dk, dv = plgpu.kernel(
        body,
        out_type=(dkv_type, dkv_type),
        scratch_types=scratch,
        grid=(out_heads, num_kv_blocks, batch),
        grid_names=("heads", "kv", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=_PARAMS,
    )(*operands)
    if fused:
        dq_acc = dq_acc[...]
    if group == 1 or in_block:
        return dq_acc, (dk, dv)

    def sum_group(x):
        x = x.reshape(batch, seq_kv, kv_heads, group, head_dim).astype(jnp.float32)
        return x.sum(axis=3).astype(dtype)

    return dq_acc, (sum_group(dk), sum_group(dv))
