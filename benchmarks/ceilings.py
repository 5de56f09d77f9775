"""What 100% means for a workload, measured in the same run: the simplest kernel that
moves the same bytes or does the same FLOPs.

* A copy of the normalized array (a Pallas Triton kernel: read `x`, write `y`, the
  bytes a norm's forward moves) for the norms.
* A dense matmul of the ragged dot's shape (the same FLOPs without the groups), by XLA
  (cuBLAS) and by JAX's Mosaic GPU example `hopper_matmul_mgpu`, for the ragged dot.

Ceilings run forward only and are not checked against the workload's reference: they
compute something else on purpose.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Elements one copy program moves: large enough to keep the memory system busy.
_COPY_BLOCK_ELEMENTS = 8192


def _copy_kernel(x_ref: Any, y_ref: Any, *, block_rows: int, cols: int) -> None:
    rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
    pltriton.store(y_ref.at[rows, pl.ds(0, cols)], pltriton.load(x_ref.at[rows, pl.ds(0, cols)]))


def triton_copy(x: jax.Array) -> jax.Array:
    """`x` copied by a Pallas Triton kernel over its `(rows, last axis)` view (the last
    axis a power of 2, the rows a multiple of the block; the benchmark shapes are)."""
    cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    block_rows = max(1, _COPY_BLOCK_ELEMENTS // cols)
    if cols & (cols - 1) or rows % block_rows:
        raise ValueError(f"triton_copy needs a power-of-2 last axis and rows divisible by "
                         f"{block_rows}, got {x.shape}")
    y = pl.pallas_call(
        functools.partial(_copy_kernel, block_rows=block_rows, cols=cols),
        grid=(rows // block_rows,),
        out_shape=jax.ShapeDtypeStruct((rows, cols), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=jax.default_backend() == "cpu",
        name="benchmark_copy",
    )(x.reshape(rows, cols))
    return y.reshape(x.shape)


def dense_matmul_xla(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """`lhs @ rhs[0]` by XLA: the ragged dot's FLOPs as one dense matmul."""
    return lhs @ rhs[0]


def dense_matmul_mgpu(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """`lhs @ rhs[0]` by JAX's Hopper Mosaic GPU matmul (a config from its own sweep)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    config = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                             grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                             wg_dimension=hm.MatmulDimension.N)
    return hm.matmul(lhs, rhs[0], None, config)
