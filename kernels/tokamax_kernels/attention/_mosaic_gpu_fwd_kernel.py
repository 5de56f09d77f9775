"""The Mosaic GPU flash-attention forward kernel for Hopper (FlashAttention-3 style).

One block owns `compute_wgs * block_q` query rows of one (batch, head). Each compute
warpgroup keeps its `block_q` rows of Q in SMEM and an online-softmax accumulator in
registers; the memory warpgroup streams K and V tiles through a ring of `num_stages`
SMEM slots. With two compute warpgroups a "schedule" barrier makes them take turns on
the tensor cores: one issues its `wgmma` while the other runs its softmax. With
`config.group_in_block` the warpgroups take one query head each of a GQA group, on the
same rows, sharing every K/V tile. Persistent (`config.persistent`), one block per SM
runs a sequence of such tiles (`_mosaic_gpu_tile_order`: round robin, or a balanced
schedule where causal masks and windows make their lengths differ), its K/V ring and
barriers carried from tile to tile.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from tokamax_kernels._gpu import sm_count
from tokamax_kernels.attention import _window
from tokamax_kernels.attention._mosaic_gpu_common import (
    COMPUTE_REGISTERS,
    LN2,
    LOG2E,
    MEMORY_REGISTERS,
    OVERLAP_LIMITS,
    MosaicAttentionConfig,
    mask_scores,
    query_block,
    tile_transforms,
)
from tokamax_kernels.attention._mosaic_gpu_tile_order import balanced_schedule, tile_order


def mosaic_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array,
                             kv_lengths: jax.Array | None = None, *, scale: float,
                             causal: bool, config: MosaicAttentionConfig,
                             window: tuple[int, int] | None = None,
                             soft_cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """`(out (B, Sq, H, D), lse (B, H, Sq) float32, natural log)` of softmax(scale q k^T) v.

    Shapes must already be checked: Sq a multiple of `config.rows_per_block`, Sk a
    multiple of `block_kv`, H a multiple of K/V's head count (with `group_in_block`,
    of `compute_wgs` K/V heads' worth: every block's heads share one K/V head). Causal
    is top-left aligned (key <= query). `kv_lengths` (B,) int32 in [0, Sk], when given,
    hides keys at and after it; tiles past it are never loaded. A row that sees no key
    (length 0) comes out undefined: the caller masks it.

    `window` (`_window.bounds`: causal folded in) limits each query to keys
    `i - left .. i + right`: a block loads only the K/V tiles its rows see. `soft_cap`
    replaces the scaled scores by `cap * tanh(scores / cap)` before the mask.
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = q.dtype
    block_q, block_kv, wgs = config.block_q, config.block_kv, config.compute_wgs
    stages = max(1, min(config.num_stages, seq_kv // block_kv))
    num_kv_blocks = seq_kv // block_kv
    rows = config.rows_per_block  # query rows of a block (per head)
    heads_per_block = config.query_heads_per_block
    if group % heads_per_block:
        raise ValueError(f"group_in_block needs query heads per K/V head ({group}) divisible "
                         f"by compute_wgs ({wgs}): set group_in_block=False")
    num_q_blocks = seq_q // rows
    qk_scale = scale * LOG2E  # scores are kept in log2 units: exp2 is one instruction
    if soft_cap is not None:
        # The capped score in log2 units is (cap * log2 e) * tanh(qk * scale / cap): the
        # tanh takes the softmax scale, and the cap's positive factor folds like the scale.
        qk_scale = soft_cap * LOG2E
    fold_scale = qk_scale > 0
    # P converted to 16 bits before its row sum: the order ptxas keeps a 128-row tile in
    # registers with; 64-row tiles run slightly faster summing first (an A/B of the two
    # forms on the H200).
    convert_first = block_q >= 128
    has_lengths = kv_lengths is not None
    if config.softmax_overlap and (window is not None or has_lengths):
        raise NotImplementedError(OVERLAP_LIMITS)

    def num_kv_steps(q_end, kv_len):
        """K/V tiles that rows below `q_end` see (`kv_len`: the key length, or None)."""
        steps = num_kv_blocks
        if causal:
            steps = jnp.minimum(lax.div(q_end + block_kv - 1, block_kv), steps)
        if kv_len is not None:
            steps = jnp.minimum(lax.div(kv_len + block_kv - 1, block_kv), steps)
        return steps

    def static_steps(qi: int) -> int:
        """K/V tiles query block `qi` loads, key lengths aside (a trace-time int)."""
        with jax.ensure_compile_time_eval():
            if window is None:
                return int(num_kv_steps(jnp.int32((qi + 1) * rows), None))
            tiles = _window.kv_tiles(window, jnp.int32(qi * rows), rows, block_kv,
                                     num_kv_blocks)
            return int(tiles.end - tiles.first)

    # Persistent: one block per SM walks the tiles in `order` (`_mosaic_gpu_tile_order`),
    # each block its run of `tile_schedule` where the tiles' lengths differ.
    order = tile_schedule = None
    if config.persistent:
        order = tile_order(batch, heads // heads_per_block, kv_heads, num_q_blocks, seq_kv,
                           head_dim,
                           jnp.dtype(dtype).itemsize,
                           reverse_q=config.longest_first and causal)
        blocks = min(order.num_tiles, sm_count())
        tile_schedule = balanced_schedule(
            order, tuple(static_steps(qi) for qi in range(num_q_blocks)), blocks)

    def body(*refs):
        q_ref, k_ref, v_ref, *refs = refs
        lengths_ref = refs.pop(0) if has_lengths else None
        schedule_ref = refs.pop(0) if tile_schedule is not None else None
        (out_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready,
         k_consumed, v_consumed, schedule, *p_smem) = refs
        p_smem = p_smem[0] if p_smem else None  # overlapped: each warpgroup's last P
        wg = lax.axis_index("wg")

        def owned_tiles():
            """Persistent: (how many tiles this block runs, the coordinates of its n-th)."""
            sm = lax.axis_index("sm")
            if tile_schedule is not None:
                first = schedule_ref[sm]

                def scheduled(n):
                    return order.coordinates(schedule_ref[blocks + 1 + first + n])

                return schedule_ref[sm + 1] - first, scheduled
            return (lax.div(order.num_tiles - sm + blocks - 1, blocks),
                    lambda n: order.coordinates(sm + n * blocks))

        def for_each_tile(run_tile):
            """`run_tile((b, h, qi), ring, n)` on each (batch, head block, query block) tile
            this block owns (head block `h`: query heads `h * heads_per_block` on), `n` its
            place among them. Persistent, `ring` counts the K/V tiles the block streamed
            before this tile (its ring slots and barrier phases carry on from there) and
            `run_tile` returns the count after it; otherwise the block owns one tile and
            `ring` and `n` are None."""
            if order is None:
                run_tile((lax.axis_index("batch"), lax.axis_index("heads"),
                          query_block(num_q_blocks, config.longest_first and causal)),
                         None, None)
                return
            count, tile_at = owned_tiles()
            lax.fori_loop(0, count, lambda n, ring: run_tile(tile_at(n), ring, n),
                          jnp.int32(0))

        def tile_extent(b, qi):
            """(key length or None, the K/V tiles wholly before it, the first and end K/V
            tile any row of query block `qi` of batch element `b` sees)."""
            kv_len = lengths_ref[b] if has_lengths else None
            # K/V tiles wholly before the key length (all of them without lengths).
            full_tiles = lax.div(kv_len, block_kv) if has_lengths else num_kv_blocks
            block_steps = num_kv_steps((qi + 1) * rows, kv_len)
            block_first = 0
            if window is not None:
                block_tiles = _window.kv_tiles(window, qi * rows, rows, block_kv,
                                               num_kv_blocks, kv_len)
                block_first, block_steps = block_tiles.first, block_tiles.end
            return kv_len, full_tiles, block_first, block_steps

        def ring_position(step, block_first, ring):
            """Where K/V tile `step` of a tile starting at `block_first` falls in the
            block's stream (the tile's first K/V tile at `ring`)."""
            position = step if window is None else step - block_first
            return position if ring is None else position + ring

        def ring_end(block_first, block_steps, ring):
            return None if ring is None else ring + (block_steps - block_first)

        def take_turn():
            if wgs > 1:
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(schedule)

        # A positive scale commutes with the max, so it rides in exp2's FMA: one
        # instruction per score instead of a multiply and a subtract.
        def scaled(x):
            return x * qk_scale if fold_scale else x

        def row_max(s, m_i, q_base, step, *, masked, kv_len=None):
            """Scores of K/V tile `step` (soft-capped, scaled unless the scale folds,
            masked), the new row max, and the max that exp2 subtracts."""
            if soft_cap is not None:
                s = jnp.tanh(s * (scale / soft_cap))
            if not fold_scale:
                s = s * qk_scale
            if masked:
                s = mask_scores(s, q_base, step * block_kv, causal=causal, kv_len=kv_len,
                                window=window)
            m_new = jnp.maximum(m_i, scaled(s.max(axis=1)))
            # A window can hide a whole tile from some rows before they see any key:
            # their max stays -inf, and exp2(-inf - -inf) would be NaN. Offset by 0.
            m_off = m_new if window is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
            return s, m_new, m_off

        def overlapped_steps(q_base, my_q, steps, m_i, l_i, slot_of):
            """FlashAttention-3's intra-warpgroup overlap (`config.softmax_overlap`; no
            window, no key lengths, so every warpgroup runs at least tile 0): each step
            issues tile `j`'s Q K^T and tile `j - 1`'s P V together, then runs tile `j`'s
            softmax while the P V is still on the tensor cores; the accumulator is
            rescaled once that lands. Returns (acc, m, l) after all `steps` tiles.

            P goes through SMEM, not registers: a register operand is fenced where its
            `wgmma` is issued, after the Q K^T, and ptxas then serializes every `wgmma`
            of the kernel (C7513; 0.6x on the H200, `softmax_overlap.jsonl`)."""
            my_p = p_smem.at[wg]

            def with_accumulators(s_ref, acc_ref):
                def issue(step, pv_slot):
                    """Start tile `step`'s Q K^T (and the P V of the tile in `pv_slot`),
                    pass the turn, and wait for the scores only."""
                    slot = slot_of(step)
                    plgpu.barrier_wait(k_ready.at[slot])
                    s_ref[...] = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32),
                                                   plgpu.Layout.WGMMA)
                    plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                    if pv_slot is not None:
                        plgpu.barrier_wait(v_ready.at[pv_slot])
                        plgpu.wgmma(acc_ref, my_p, v_smem.at[pv_slot])
                    take_turn()
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if pv_slot is None else 1)
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    return s, slot

                def keep_probabilities(p):
                    """P of this tile into SMEM for the next step's P V."""
                    my_p[...] = p.astype(dtype)
                    plgpu.commit_smem()

                def step_fn(step, carry, *, masked):
                    m_i, l_i, prev_slot = carry
                    s, slot = issue(step, prev_slot)
                    s, m_new, m_off = row_max(s, m_i, q_base, step, masked=masked)
                    alpha = jnp.exp2(m_i - m_off)
                    p = jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_off, s.shape, [0]))
                    l_i = l_i * alpha + p.sum(axis=1)
                    acc = plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)  # tile j - 1's P V
                    plgpu.barrier_arrive(v_consumed.at[prev_slot])
                    acc_ref[...] = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    keep_probabilities(p)
                    take_turn()
                    return m_new, l_i, slot

                s, slot = issue(0, None)
                s, m_new, m_off = row_max(s, m_i, q_base, 0, masked=causal)
                p = jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_off, s.shape, [0]))
                l_new = l_i + p.sum(axis=1)
                keep_probabilities(p)
                take_turn()
                carry = (m_new, l_new, slot)
                unmasked = jnp.minimum(lax.div(q_base, block_kv), steps) if causal else steps
                carry = lax.fori_loop(1, unmasked,
                                      lambda i, c: step_fn(i, c, masked=False), carry)
                if causal:
                    carry = lax.fori_loop(jnp.maximum(unmasked, 1), steps,
                                          lambda i, c: step_fn(i, c, masked=True), carry)
                m_last, l_last, slot = carry
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.wgmma(acc_ref, my_p, v_smem.at[slot])
                acc = acc_ref[...]
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_last, l_last

            return pl.run_scoped(with_accumulators,
                                 plgpu.ACC((block_q, block_kv), jnp.float32),
                                 plgpu.ACC((block_q, head_dim), jnp.float32))

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def my_rows(b, h, qi):
                """(first query row, query head) of my rows of tile (b, h, qi)."""
                if config.group_in_block:  # my own head, the block's rows
                    return qi * rows, h * heads_per_block + wg
                return qi * rows + wg * block_q, h  # my own rows of the block's head

            def my_buffer(n):
                """My Q / output buffer for the block's `n`-th tile: buffers alternate
                with `prefetch_query`."""
                return wg if buffers == 1 else lax.rem(n, buffers) * wgs + wg

            def load_query(b, h, qi, buffer):
                q_base, head = my_rows(b, h, qi)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, block_q), head],
                                        q_smem.at[buffer], q_ready.at[buffer])

            if config.prefetch_query:
                count, tile_at = owned_tiles()

                @pl.when(count > 0)
                def _():
                    load_query(*tile_at(0), my_buffer(0))

            def compute_tile(coordinates, ring, n):
                b, h, qi = coordinates
                kv_len, full_tiles, block_first, block_steps = tile_extent(b, qi)
                q_base, h = my_rows(b, h, qi)
                buffer = my_buffer(n)
                my_q = q_smem.at[buffer]  # Q, then the output tile on its way out
                if not config.prefetch_query:
                    if ring is not None:  # the last tile's output has left my_q
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    load_query(b, coordinates[1], qi, buffer)
                plgpu.barrier_wait(q_ready.at[buffer])
                steps = num_kv_steps(q_base + block_q, kv_len)

                def prefetch():
                    """The next tile's Q into my other buffer, once the store of the
                    output that buffer held (two tiles back) has read it."""
                    if not config.prefetch_query:
                        return

                    @pl.when(n + 1 < count)
                    def _():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        load_query(*tile_at(n + 1), my_buffer(n + 1))

                # The K/V steps I compute: the next Q loads during the first of them.
                if window is not None:
                    tiles = _window.kv_tiles(window, q_base, block_q, block_kv, num_kv_blocks,
                                             kv_len)
                    first_step, end_step = tiles.first, tiles.end
                else:
                    first_step, end_step = 0, steps

                def slot_of(step):
                    return lax.rem(ring_position(step, block_first, ring), stages)

                def kv_step(step, carry, *, masked):
                    acc, m_i, l_i = carry
                    slot = slot_of(step)
                    plgpu.barrier_wait(k_ready.at[slot])

                    def qk_product(acc_ref):
                        plgpu.wgmma(acc_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                        take_turn()  # let the other warpgroup's wgmma go while ours runs
                        return acc_ref[...]

                    s = pl.run_scoped(qk_product, plgpu.ACC((block_q, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    s, m_new, m_off = row_max(s, m_i, q_base, step, masked=masked,
                                              kv_len=kv_len)

                    def probabilities():
                        return jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_off, s.shape, [0]))

                    if convert_first:
                        alpha = jnp.exp2(m_i - m_off)
                        p = probabilities()
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        l_i = l_i * alpha
                        p16 = p.astype(dtype)
                        l_i = l_i + p.sum(axis=1)
                    else:
                        p = probabilities()
                        alpha = jnp.exp2(m_i - m_off)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        l_i = l_i * alpha + p.sum(axis=1)
                        p16 = p.astype(dtype)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    if wgs > 1:
                        plgpu.barrier_arrive(schedule)
                    plgpu.barrier_wait(v_ready.at[slot])
                    if wgs > 1:
                        plgpu.barrier_wait(schedule)

                    def pv_product(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_consumed.at[slot])
                    pl.when(step == first_step)(prefetch)
                    return acc, m_new, l_i

                def drain_step(step, _):
                    """A tile this warpgroup does not need (causal, window): release it in turn."""
                    slot = slot_of(step)
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_arrive(v_consumed.at[slot])
                    take_turn()
                    take_turn()

                vector = plgpu.Layout.WGMMA.reduce(1)
                m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), vector)
                l_i = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), vector)
                acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32),
                                        plgpu.Layout.WGMMA)
                carry = (acc, m_i, l_i)
                if wgs > 1:
                    pl.when(wg == 1)(take_turn)

                def masked_step(i, c):
                    return kv_step(i, c, masked=True)

                if config.softmax_overlap:
                    prefetch()
                    carry = overlapped_steps(q_base, my_q, steps, m_i, l_i, slot_of)
                    if causal:
                        lax.fori_loop(steps, block_steps, drain_step, None)
                elif window is not None:
                    lax.fori_loop(block_first, tiles.first, drain_step, None)
                    carry = lax.fori_loop(tiles.first, tiles.full_first, masked_step, carry)
                    carry = lax.fori_loop(tiles.full_first, tiles.full_end,
                                          lambda i, c: kv_step(i, c, masked=False), carry)
                    carry = lax.fori_loop(tiles.full_end, tiles.end, masked_step, carry)
                    lax.fori_loop(tiles.end, block_steps, drain_step, None)
                else:
                    # Tiles before `unmasked` need no mask; the rest cross the diagonal or the
                    # length.
                    unmasked = jnp.minimum(full_tiles, steps) if has_lengths else steps
                    if causal:
                        unmasked = jnp.minimum(lax.div(q_base, block_kv), unmasked)
                    carry = lax.fori_loop(0, unmasked, lambda i, c: kv_step(i, c, masked=False),
                                          carry)
                    if causal or has_lengths:
                        carry = lax.fori_loop(unmasked, steps, masked_step, carry)
                    if causal:
                        lax.fori_loop(steps, block_steps, drain_step, None)
                if not config.softmax_overlap:  # a tile I compute no step of
                    pl.when(end_step <= first_step)(prefetch)
                if wgs > 1:
                    pl.when(wg == 0)(take_turn)
                acc, m_i, l_i = carry
                acc = acc * lax.broadcast_in_dim(1.0 / l_i, acc.shape, [0])
                my_q[...] = acc.astype(dtype)
                lse_smem.at[buffer][...] = (m_i + jnp.log2(l_i)) * LN2
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_q, out_ref.at[b, pl.ds(q_base, block_q), h])
                plgpu.copy_smem_to_gmem(lse_smem.at[buffer],
                                        lse_ref.at[b, h, pl.ds(q_base, block_q)])
                return ring_end(block_first, block_steps, ring)

            for_each_tile(compute_tile)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def memory_tile(coordinates, ring, n):
                del n
                b, h, qi = coordinates
                kv_len, _, block_first, block_steps = tile_extent(b, qi)
                kv_h = lax.div(h * heads_per_block, group)

                @pl.loop(block_first, block_steps)
                def _(step):
                    position = ring_position(step, block_first, ring)
                    slot = lax.rem(position, stages)
                    rows = (b, pl.ds(step * block_kv, block_kv), kv_h)

                    @pl.when(position >= stages)
                    def _():
                        plgpu.barrier_wait(k_consumed.at[slot])

                    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])

                    @pl.when(position >= stages)
                    def _():
                        plgpu.barrier_wait(v_consumed.at[slot])

                    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

                return ring_end(block_first, block_steps, ring)

            for_each_tile(memory_tile)

    transforms = tile_transforms(dtype)
    buffers = config.query_buffers
    scratch: list[Any] = [
        plgpu.SMEM((buffers * wgs, block_q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((buffers * wgs, block_q), jnp.float32),
        plgpu.Barrier(num_barriers=buffers * wgs),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        plgpu.Barrier(num_arrivals=wgs),
    ]
    if config.softmax_overlap:
        scratch.append(plgpu.SMEM((wgs, block_q, block_kv), dtype, transforms=transforms))
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32))
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(heads // heads_per_block, num_q_blocks, batch) if order is None else (blocks,),
        grid_names=("heads", "q", "batch") if order is None else ("sm",),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, *([kv_lengths] if has_lengths else []),
      *([jnp.asarray(tile_schedule)] if tile_schedule is not None else []))
