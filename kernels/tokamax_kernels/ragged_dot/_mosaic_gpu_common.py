"""Shared pieces of the Mosaic GPU ragged-dot kernels: the config, the SM count, SMEM layouts.

Both kernels (`_mosaic_gpu_rows_kernel.py` for forward/dlhs, `_mosaic_gpu_drhs_kernel.py`)
are persistent, warp specialized Hopper kernels: one memory warpgroup streams tiles
into SMEM with TMA, two compute warpgroups each own half of a CTA's output tile and
accumulate it in float32 with `wgmma`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

# SMEM a Hopper CTA may use (227 KiB), less room for the pipeline's barriers.
SMEM_BUDGET_BYTES = 227 * 1024 - 2048
NUM_COMPUTE_WGS = 2
# Registers kept by the memory warpgroup (it only issues TMA copies).
MEMORY_REGISTERS = 40


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Tiling of a Mosaic GPU ragged dot.

    Attributes:
      tile_m: output rows per CTA (a multiple of 64; both warpgroups share them).
      tile_n: output columns per compute warpgroup; a CTA covers `2 * tile_n`.
      tile_k: contraction length per pipeline step (for drhs: ragged rows per step).
      num_stages: SMEM pipeline depth (tiles in flight).
      epi_n: columns per epilogue store (divides `tile_n`): smaller saves SMEM.
      grid_minor_dim: 0 walks output tiles along rows first, 1 along columns first.
      grid_tile_width: width of the snake band over the output tiles (L2 reuse).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    num_stages: int = 4
    epi_n: int = 64
    grid_minor_dim: int = 1
    grid_tile_width: int = 8

    def __post_init__(self):
        if self.tile_m % 64 or self.tile_m <= 0:
            raise ValueError(f"tile_m={self.tile_m} must be a positive multiple of 64")
        if self.tile_n % 64 or self.tile_n <= 0:
            raise ValueError(f"tile_n={self.tile_n} must be a positive multiple of 64")
        if self.tile_k % 16 or self.tile_k <= 0:
            raise ValueError(f"tile_k={self.tile_k} must be a positive multiple of 16")
        if self.epi_n <= 0 or self.tile_n % self.epi_n or self.epi_n % 8:
            raise ValueError(f"epi_n={self.epi_n} must divide tile_n={self.tile_n}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be at least 2")
        if self.grid_minor_dim not in (0, 1):
            raise ValueError(f"grid_minor_dim={self.grid_minor_dim} must be 0 or 1")
        if self.grid_tile_width < 1:
            raise ValueError(f"grid_tile_width={self.grid_tile_width} must be >= 1")

    @property
    def cta_n(self) -> int:
        return NUM_COMPUTE_WGS * self.tile_n

    def smem_bytes(self, itemsize: int) -> int:
        """SMEM of the pipeline stages plus the epilogue buffers."""
        stage = (self.tile_m * self.tile_k + self.tile_k * self.cta_n) * itemsize
        epilogue = NUM_COMPUTE_WGS * self.tile_m * self.epi_n * itemsize
        return self.num_stages * stage + epilogue


def swizzled(minor_elems: int, dtype) -> tuple:
    """TMA/wgmma-friendly SMEM transforms for tiles whose minor dimension is `minor_elems`."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    # JAX declares both transforms abstract (`transform_array`), yet builds them itself.
    return (plgpu.TilingTransform((8, swizzle // itemsize)),  # type: ignore[abstract]
            plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]


def compiler_params() -> plgpu.CompilerParams:
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
