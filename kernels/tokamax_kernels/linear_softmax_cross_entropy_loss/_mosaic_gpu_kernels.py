"""Mosaic GPU (Hopper) kernels of the LM-head loss: logits tiles that never reach memory.

Both kernels share one main loop. A block owns `block_tokens` rows of x (two compute
warpgroups, half the rows each) and walks a range of vocabulary blocks; for each it runs
a K-loop over H: the memory warpgroup streams (rows, block_h) tiles of x and
(block_h, block_vocab) tiles of the weights through a ring of `num_stages` SMEM slots
with TMA, and each compute warpgroup accumulates its (rows / 2, block_vocab) logits tile
in float32 registers with `wgmma`. What happens to a finished tile is the kernel's:

- `forward_stats`: rounded to the inputs' dtype (as `x @ weights` rounds), soft-capped,
  then an online max / sum-exp and the label's logit per row: (lse, label logit) per
  token. The vocabulary may be split over blocks (`vocab_splits`): each split gives
  its partial (lse, label logit), which the caller merges.
- `dlogits_chunk`: `(exp(logits - lse) - onehot) * g`, soft-cap derivative included,
  cast to the inputs' dtype and stored: a (tokens, chunk) slab for the backward's GEMMs.

Sizes the blocks do not divide are not padded: the last block starts early (`size -
block`) and repeats rows or columns of the block before it. Repeated rows are computed
and stored twice with the same values; repeated columns are masked where they would be
counted twice (the forward's statistics) and recomputed identically where they are
stored (dlogits). The caller guarantees tokens >= block_tokens and a multiple of 8, and
a vocabulary (or chunk) >= block_vocab and a multiple of 64: Mosaic GPU tiles the whole
x and weights arrays as the swizzled TMA tiles are tiled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

# Register budget of the memory warpgroup; the compute warpgroups take the rest.
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = 232
NUM_COMPUTE_WGS = 2
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The static tiling of one kernel launch."""

    block_tokens: int
    block_vocab: int
    block_h: int
    num_stages: int

    @property
    def rows(self) -> int:
        """Rows of x per compute warpgroup."""
        return self.block_tokens // NUM_COMPUTE_WGS


def _transforms(minor_elems: int, dtype: Any) -> tuple[Any, ...]:
    """SMEM tiling + swizzle that TMA and `wgmma` expect for 16-bit tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    # JAX declares both transforms abstract (`transform_array`), yet builds them itself.
    return (plgpu.TilingTransform((8, swizzle // itemsize)),  # type: ignore[abstract]
            plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]


def _block_start(i: Any, block: int, size: int) -> Any:
    """Where block `i` starts: `i * block`, or `size - block` for a last block past the end."""
    return jnp.minimum(i * block, size - block)


def _row_vector(ref: Any) -> jax.Array:
    """A (rows,) SMEM vector in the layout of a `wgmma` tile's rows."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def _columns(shape: tuple[int, int], first: Any) -> jax.Array:
    """(rows, cols) int32 column indices of a `wgmma` tile whose first column is `first`."""
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + first


def _by_row(vector: jax.Array, shape: tuple[int, int]) -> jax.Array:
    return lax.broadcast_in_dim(vector, shape, [0])


def _logits(acc: jax.Array, dtype: Any, cap: float | None) -> tuple[jax.Array, Any]:
    """`(logits, tanh)`: the float32 accumulator rounded to the inputs' dtype, then
    soft-capped; `tanh` is the soft cap's tanh (None without a cap)."""
    logits = acc.astype(dtype).astype(jnp.float32)
    if cap is None:
        return logits, None
    t = jnp.tanh(logits * (1.0 / cap))
    return cap * t, t


def _vocab_loop_kernel(
    x: jax.Array, weights: jax.Array, row_inputs: list[jax.Array], *, tiles: Tiles,
    vocab_blocks: int, vocab_splits: int, out_type: Any, scratch: list[Any],
    compute: Callable[..., None],
) -> Any:
    """A kernel over (token block, vocabulary split) whose compute warpgroups call
    `compute(refs, extra, wg, t0, v_begin, v_count, column0, tile_logits)`: `refs` are the
    kernel's operands and outputs, `extra` the refs of `scratch`, `t0` the block's first
    token, `column0(v)` vocabulary block v's first column, and `tile_logits(v)` runs the
    K-loop of block `v` (in order: the memory warpgroup streams blocks `v_begin ...
    v_begin + v_count - 1`) and returns this warpgroup's float32 accumulator.
    `row_inputs` are per-token vectors (or scalars) `compute` reads itself."""
    tokens, hidden = x.shape
    vocab = weights.shape[1]
    bt, bv, bh, stages = tiles.block_tokens, tiles.block_vocab, tiles.block_h, tiles.num_stages
    k_steps = hidden // bh
    per_split = pl.cdiv(vocab_blocks, vocab_splits)
    token_blocks = pl.cdiv(tokens, bt)
    dtype = x.dtype
    n_in = 2 + len(row_inputs)

    def body(*refs):
        x_ref, w_ref = refs[:2]
        (x_smem, w_smem, x_ready, w_ready, consumed, *extra) = refs[n_in + _num_outputs(out_type):]
        ti, split = lax.axis_index("tokens"), lax.axis_index("split")
        wg = lax.axis_index("wg")
        t0 = _block_start(ti, bt, tokens)
        v_begin = split * per_split
        v_count = jnp.minimum(per_split, vocab_blocks - v_begin)

        def column0(v):
            return _block_start(v, bv, vocab)

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            my_rows = pl.ds(wg * tiles.rows, tiles.rows)

            def tile_logits(v):
                base = (v - v_begin) * k_steps

                def product(acc_ref):
                    def k_step(k, _):
                        slot = lax.rem(base + k, stages)
                        plgpu.barrier_wait(x_ready.at[slot])
                        plgpu.barrier_wait(w_ready.at[slot])
                        plgpu.wgmma(acc_ref, x_smem.at[slot, my_rows], w_smem.at[slot])
                        # Keep one wgmma in flight; the one before it is done with its slot.
                        plgpu.wgmma_wait(1)

                        @pl.when(k > 0)
                        def _():
                            plgpu.barrier_arrive(consumed.at[lax.rem(base + k - 1, stages)])

                    lax.fori_loop(0, k_steps, k_step, None)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[lax.rem(base + k_steps - 1, stages)])
                    return acc_ref[...]

                return pl.run_scoped(product, plgpu.ACC((tiles.rows, bv), jnp.float32))

            compute(refs, extra, wg, t0, v_begin, v_count, column0, tile_logits)

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            rows = pl.ds(t0, bt)

            @pl.loop(0, v_count * k_steps)
            def _(step):
                slot = lax.rem(step, stages)
                v = v_begin + lax.div(step, k_steps)
                k = lax.rem(step, k_steps)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(x_ref.at[rows, pl.ds(k * bh, bh)], x_smem.at[slot],
                                        x_ready.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k * bh, bh), pl.ds(column0(v), bv)],
                                        w_smem.at[slot], w_ready.at[slot])

    ring: list[Any] = [
        plgpu.SMEM((stages, bt, bh), dtype, transforms=_transforms(bh, dtype)),
        plgpu.SMEM((stages, bh, bv), dtype, transforms=_transforms(bv, dtype)),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=stages),
    ]
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=ring + scratch,
        grid=(token_blocks, vocab_splits),
        grid_names=("tokens", "split"),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(x, weights, *row_inputs)


def _num_outputs(out_type: Any) -> int:
    return len(jax.tree.leaves(out_type))


def _load_rows(src_gmem: Any, dst_smem: Any, barrier: Any) -> None:
    """Copies a (rows,) slice of a per-token vector into SMEM and waits for it."""
    plgpu.copy_gmem_to_smem(src_gmem, dst_smem, barrier)
    plgpu.barrier_wait(barrier)


def forward_stats(x: jax.Array, labels: jax.Array, weights: jax.Array, *,
                  cap: float | None, tiles: Tiles, vocab_splits: int
                  ) -> tuple[jax.Array, jax.Array]:
    """`(lse, label_logit)`, each (vocab_splits, tokens) float32: per split of the
    vocabulary blocks, the natural-log logsumexp of each token's soft-capped logits and
    its label's logit (0 where the label is outside the split). Merge with a logsumexp
    and a sum over the splits. x (T, H), labels (T,) int32, weights (H, V)."""
    tokens = x.shape[0]
    vocab = weights.shape[1]
    bv, rows = tiles.block_vocab, tiles.rows
    vocab_blocks = pl.cdiv(vocab, bv)
    dtype = x.dtype

    def compute(refs, extra, wg, t0, v_begin, v_count, column0, tile_logits):
        labels_ref, lse_ref, label_ref = refs[2], refs[3], refs[4]
        labels_smem, stats_smem, loaded = extra
        split = lax.axis_index("split")
        row0 = t0 + wg * rows
        _load_rows(labels_ref.at[pl.ds(row0, rows)], labels_smem.at[wg], loaded.at[wg])
        my_labels = _row_vector(labels_smem.at[wg])
        shape = (rows, bv)

        def vocab_block(i, carry):
            m_i, l_i, label_logit = carry
            v = v_begin + i
            logits, _ = _logits(tile_logits(v), dtype, cap)
            columns = _columns(shape, column0(v))
            fresh = columns >= v * bv  # a column the block before this one did not cover
            hit = fresh & (columns == _by_row(my_labels, shape))
            label_logit = label_logit + jnp.where(hit, logits, 0.0).sum(axis=1)
            scaled = jnp.where(fresh, logits * LOG2E, -jnp.inf)  # log2 units: exp2
            m_new = jnp.maximum(m_i, scaled.max(axis=1))
            p = jnp.exp2(scaled - _by_row(m_new, shape))
            l_i = l_i * jnp.exp2(m_i - m_new) + p.sum(axis=1)
            return m_new, l_i, label_logit

        vector = plgpu.Layout.WGMMA.reduce(1)
        init = (plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), vector),
                plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), vector),
                plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), vector))
        m_i, l_i, label_logit = lax.fori_loop(0, v_count, vocab_block, init)
        stats_smem.at[0, wg][...] = (m_i + jnp.log2(l_i)) * LN2
        stats_smem.at[1, wg][...] = label_logit
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stats_smem.at[0, wg], lse_ref.at[split, pl.ds(row0, rows)])
        plgpu.copy_smem_to_gmem(stats_smem.at[1, wg], label_ref.at[split, pl.ds(row0, rows)])
        plgpu.wait_smem_to_gmem(0)

    stats = jax.ShapeDtypeStruct((vocab_splits, tokens), jnp.float32)
    scratch = [plgpu.SMEM((NUM_COMPUTE_WGS, rows), jnp.int32),
               plgpu.SMEM((2, NUM_COMPUTE_WGS, rows), jnp.float32),
               plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS)]
    return _vocab_loop_kernel(
        x, weights, [labels], tiles=tiles, vocab_blocks=vocab_blocks,
        vocab_splits=vocab_splits, out_type=(stats, stats), scratch=scratch, compute=compute)


def dlogits_chunk(x: jax.Array, labels: jax.Array, lse: jax.Array, g: jax.Array,
                  weights_chunk: jax.Array, first_class: jax.Array, first_fresh: jax.Array,
                  *, cap: float | None, tiles: Tiles, vocab_splits: int) -> jax.Array:
    """(T, C) dlogits of the chunk `weights_chunk` (H, C) of the vocabulary, in x's dtype.

    `first_class`: the class id of the chunk's column 0 (int32 scalar); columns before
    `first_fresh` (an earlier chunk's) come out zero. lse, g: (T,) float32, labels (T,)
    int32."""
    tokens = x.shape[0]
    chunk = weights_chunk.shape[1]
    bv, rows = tiles.block_vocab, tiles.rows
    vocab_blocks = pl.cdiv(chunk, bv)
    dtype = x.dtype

    def compute(refs, extra, wg, t0, v_begin, v_count, column0, tile_logits):
        labels_ref, lse_ref, g_ref, scalars_ref, out_ref = refs[2:7]
        labels_smem, lse_smem, g_smem, out_smem, loaded = extra
        row0 = t0 + wg * rows
        _load_rows(labels_ref.at[pl.ds(row0, rows)], labels_smem.at[wg], loaded.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[pl.ds(row0, rows)], lse_smem.at[wg],
                                loaded.at[NUM_COMPUTE_WGS + wg])
        plgpu.copy_gmem_to_smem(g_ref.at[pl.ds(row0, rows)], g_smem.at[wg],
                                loaded.at[2 * NUM_COMPUTE_WGS + wg])
        plgpu.barrier_wait(loaded.at[NUM_COMPUTE_WGS + wg])
        plgpu.barrier_wait(loaded.at[2 * NUM_COMPUTE_WGS + wg])
        shape = (rows, bv)
        # Class ids of the chunk relative to its first column: labels outside it never hit.
        my_labels = _by_row(_row_vector(labels_smem.at[wg]) - scalars_ref[0], shape)
        my_lse = _by_row(_row_vector(lse_smem.at[wg]) * LOG2E, shape)
        my_g = _by_row(_row_vector(g_smem.at[wg]), shape)
        first_fresh_col = scalars_ref[1]

        @pl.loop(0, v_count)
        def _(i):
            v = v_begin + i
            logits, t = _logits(tile_logits(v), dtype, cap)
            columns = _columns(shape, column0(v))
            probs = jnp.exp2(logits * LOG2E - my_lse)
            d = (probs - jnp.where(columns == my_labels, 1.0, 0.0)) * my_g
            if t is not None:
                d = d * (1.0 - t * t)
            d = jnp.where(columns >= first_fresh_col, d, 0.0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile has left
            out_smem.at[wg][...] = d.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                    out_ref.at[pl.ds(row0, rows), pl.ds(column0(v), bv)])

        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((NUM_COMPUTE_WGS, rows), jnp.int32),
               plgpu.SMEM((NUM_COMPUTE_WGS, rows), jnp.float32),
               plgpu.SMEM((NUM_COMPUTE_WGS, rows), jnp.float32),
               plgpu.SMEM((NUM_COMPUTE_WGS, rows, bv), dtype, transforms=_transforms(bv, dtype)),
               plgpu.Barrier(num_barriers=3 * NUM_COMPUTE_WGS)]
    scalars = jnp.stack([first_class, first_fresh]).astype(jnp.int32)
    return _vocab_loop_kernel(
        x, weights_chunk, [labels, lse, g, scalars], tiles=tiles, vocab_blocks=vocab_blocks,
        vocab_splits=vocab_splits, out_type=jax.ShapeDtypeStruct((tokens, chunk), dtype),
        scratch=scratch, compute=compute)
