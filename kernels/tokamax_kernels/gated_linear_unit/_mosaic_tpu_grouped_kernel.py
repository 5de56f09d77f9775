"""The Pallas Mosaic TPU kernel of the grouped gated linear unit (MoE expert GEMMs).

out[r] = activation(x[r] @ w_gate[g(r)]) * (x[r] @ w_up[g(r)])   x (M, K), w_* (G, K, N)

The TPU ragged dot's forward (`ragged_dot/_mosaic_tpu_kernels.py`, whose work list
`row_tiles` this kernel shares) with a gate and an up accumulator per output tile. XLA
first lists the work tiles, one per (group, row block of `block_m` rows) pair a group
touches, in row order, the rows past `sum(group_sizes)` forming a "tail" group. The
grid is (column blocks, work tiles, contraction steps): a step multiplies its row block
of x by the matching (`block_k`, `block_n`) tiles of its group's gate and up weights on
the MXU into two float32 VMEM accumulators; the last contraction step applies the
activation and the product in float32 and writes only the tile's own rows of the output
block. The tiles that share a row block are consecutive, so the block (which stays in
VMEM while its index does not change) collects all of them before it is written back.
Tail rows are written as zeros: their tile never touches the MXU.

With (E, G) `group_sizes` the call runs E entries of M / E rows at once, the weights
(R * G, ...) shared (R = 1) or per entry (R = E), as the ragged dot's `row_tiles` says.

With `residuals` (a differentiated call) the epilogue also writes the gate and up
pre-activations in x's dtype, the residuals the family's gradient reads, as two (M, N)
arrays. The column axis alone is "parallel": work tiles share output blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_kernels._mosaic_tpu import compiler_params
from tokamax_kernels.gated_linear_unit._mosaic_tpu_kernel import (  # one definition for both
    _dot,
    vmem_bytes,
)
from tokamax_kernels.ragged_dot._mosaic_tpu_kernels import row_tiles


def _grouped_kernel(tiles_ref, x_ref, gate_ref, up_ref, out_ref, *rest,
                    activation: Callable[[Any], Any], num_groups: int, steps: int) -> None:
    *residual_refs, gate_acc, up_acc = rest
    t, kk = pl.program_id(1), pl.program_id(2)
    group, lo, hi = tiles_ref[0, t], tiles_ref[2, t], tiles_ref[3, t]

    @pl.when(kk == 0)
    def _zero():
        gate_acc[...] = jnp.zeros_like(gate_acc)
        up_acc[...] = jnp.zeros_like(up_acc)

    @pl.when((group < num_groups) & (hi > lo))  # the tail group's accumulators stay zero
    def _accumulate():
        x = x_ref[...]
        gate_acc[...] += _dot(x, gate_ref[...])
        up_acc[...] += _dot(x, up_ref[...])

    @pl.when(kk == steps - 1)
    def _store():
        rows = jax.lax.broadcasted_iota(jnp.int32, gate_acc.shape, 0)
        mine = (rows >= lo) & (rows < hi)
        gate, up = gate_acc[...], up_acc[...]
        # Explicit zeros for the tail: activation(0) * 0 need not be 0 for every activation.
        out = jnp.where(group < num_groups, activation(gate) * up, 0.0)
        values = (out, gate, up)[:1 + len(residual_refs)]
        for ref, value in zip((out_ref, *residual_refs), values, strict=True):
            ref[...] = jnp.where(mine, value.astype(ref.dtype), ref[...])


def grouped_vmem_bytes(block_m: int, block_n: int, block_k: int, itemsize: int,
                       residuals: bool) -> int:
    """VMEM of one grid step: the dense kernel's (`vmem_bytes`), plus the double-buffered
    gate and up residual tiles of a differentiated call."""
    extra = 2 * 2 * block_m * block_n * itemsize if residuals else 0
    return vmem_bytes(block_m, block_n, block_k, itemsize) + extra


def grouped_glu_forward(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                        group_sizes: jax.Array, *, up_offset: int,
                        activation: Callable[[Any], Any], residuals: bool, block_m: int,
                        block_n: int, block_k: int, interpret: Any) -> tuple[jax.Array, ...]:
    """`(out,)`, or `(out, gate, up)` with `residuals`, each (M, N) in x's dtype.

    `w_gate` and `w_up` are (G, K, N) arrays, or both the (G, K, 2N) view of fused
    weights with `up_offset` = N (the column where the up half starts; 0 for a pair).
    `block_k` divides K and `block_n` divides N (the caller checks); `group_sizes` is
    int32, (G,) or (E, G) (entries, above)."""
    m, k = x.shape
    g = w_gate.shape[0]
    n = w_gate.shape[2] - up_offset
    steps = k // block_k
    up_blocks = up_offset // block_n
    sizes = jnp.atleast_2d(group_sizes)
    tiles = row_tiles(sizes, m // sizes.shape[0], block_m, g // sizes.shape[1])

    def weight_spec(offset: int) -> pl.BlockSpec:
        # The tail group (G) reads group G - 1's tile: the block does not move, no DMA.
        return pl.BlockSpec((None, block_k, block_n), lambda j, t, kk, tl: (
            jnp.minimum(tl[0, t], g - 1), kk, j + offset))

    row_spec = pl.BlockSpec((block_m, block_n), lambda j, t, kk, tl: (tl[1, t], j))
    outputs = 3 if residuals else 1
    itemsize = jnp.dtype(x.dtype).itemsize
    kernel = functools.partial(_grouped_kernel, activation=activation, num_groups=g,
                               steps=steps)
    return tuple(pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n // block_n, tiles.shape[1], steps),
            in_specs=[pl.BlockSpec((block_m, block_k), lambda j, t, kk, tl: (tl[1, t], kk)),
                      weight_spec(0), weight_spec(up_blocks)],
            out_specs=[row_spec] * outputs,
            scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)] * 2,
        ),
        out_shape=[jax.ShapeDtypeStruct((m, n), x.dtype)] * outputs,
        compiler_params=compiler_params(
            ("parallel", "arbitrary", "arbitrary"),
            grouped_vmem_bytes(block_m, block_n, block_k, itemsize, residuals)),
        interpret=interpret,
        name="tokamax_grouped_glu_forward",
    )(tiles, x, w_gate, w_up))
