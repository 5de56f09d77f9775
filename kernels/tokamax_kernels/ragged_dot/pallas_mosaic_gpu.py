"""`PallasMosaicGpuRaggedDot`: the ragged dot (forward, dlhs, drhs) as Hopper Mosaic GPU kernels.

The forward and dlhs group their output rows (`_mosaic_gpu_rows_kernel.py`); the drhs
contracts over the grouped rows (`_mosaic_gpu_drhs_kernel.py`). All three are
persistent, warp-specialized TMA + `wgmma` kernels accumulating in float32. The
gradient is `RaggedDotVjp`, which calls this op again for the dlhs and drhs.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels.ragged_dot import _mosaic_gpu_common as common
from tokamax_kernels.ragged_dot._mosaic_gpu_drhs_kernel import ragged_dot_drhs
from tokamax_kernels.ragged_dot._mosaic_gpu_rows_kernel import ROW_ALIGN, ragged_dot_rows
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp, few_rows_per_group
from tokamax_pass.core import BoundArguments, Op, Target

Config = common.Config

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Smallest tiles a kernel can run: contraction step, output rows, output columns per CTA.
_MIN_TILE_K, _MIN_TILE_M, _MIN_CTA_N = 64, 64, 2 * 64


def _problem(lhs: Any, rhs: Any, variant: str) -> tuple[int, int, int]:
    """`(rows, contraction, columns)` of the kernel's output tiling for a variant.

    Rows: the output rows tiled by `tile_m` (M for forward/dlhs, K for drhs);
    contraction: the length walked in `tile_k` steps (ragged M for drhs);
    columns: the output columns tiled by `2 * tile_n`.
    """
    if variant == "forward":
        return lhs.shape[0], lhs.shape[1], rhs.shape[2]
    if variant == "dlhs":
        return lhs.shape[0], lhs.shape[1], rhs.shape[1]
    return lhs.shape[1], lhs.shape[0], rhs.shape[1]


def _fits(config: Config, rows: int, contraction: int, columns: int, variant: str,
          itemsize: int) -> bool:
    if columns % config.cta_n or config.smem_bytes(itemsize) > common.SMEM_BUDGET_BYTES:
        return False
    if variant == "drhs":
        return rows % config.tile_m == 0
    return contraction % config.tile_k == 0 and rows >= config.tile_m


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuRaggedDot(RaggedDot):
    """Ragged dot on Hopper GPUs by Pallas Mosaic GPU kernels (bf16/f16, f32 accumulation)."""

    config_cls: ClassVar[type] = Config
    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    slow_lowering: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        if target is not None and not target.is_hopper:
            raise NotImplementedError(
                f"Mosaic GPU ragged dot needs a Hopper GPU (H100/H200), not {target.device_kind!r}")
        args = ba.arguments
        lhs, rhs, variant = args["lhs"], args["rhs"], args["variant"]
        if ba.vmap:
            raise NotImplementedError("Mosaic GPU ragged dot does not support jax.vmap")
        dtype = jnp.dtype(lhs.dtype)
        if dtype not in _DTYPES or jnp.dtype(rhs.dtype) != dtype:
            raise NotImplementedError(
                f"Mosaic GPU ragged dot needs bf16 or f16 lhs and rhs of one dtype, got "
                f"{lhs.dtype} and {rhs.dtype}")
        out_dtype = args["preferred_element_type"]
        if out_dtype is not None and jnp.dtype(out_dtype) != dtype:
            raise NotImplementedError(
                f"Mosaic GPU ragged dot writes {dtype}; preferred_element_type={out_dtype} is not "
                "supported")
        rows, contraction, columns = _problem(lhs, rhs, variant)
        if 0 in (rows, contraction, columns):
            # An empty contraction set up no pipeline barriers: Pallas failed to lower it.
            raise NotImplementedError(
                f"Mosaic GPU ragged dot needs non-empty operands, got {variant} rows {rows}, "
                f"contraction {contraction}, columns {columns}")
        if args["group_sizes"].shape[0] == 0:  # lowers, but no kernel was run without groups
            raise NotImplementedError(
                "Mosaic GPU ragged dot needs at least one group; implementation='xla' (or "
                "None) computes zero groups")
        if lhs.shape[0] % ROW_ALIGN:
            raise NotImplementedError(
                f"{variant}: M ({lhs.shape[0]}) must be a multiple of {ROW_ALIGN} (the TMA "
                "tiling of swizzled row tiles)")
        if columns % _MIN_CTA_N:
            raise NotImplementedError(
                f"{variant}: output columns ({columns}) must be a multiple of {_MIN_CTA_N}")
        if variant == "drhs":
            if rows % _MIN_TILE_M:
                raise NotImplementedError(f"drhs: K ({rows}) must be a multiple of {_MIN_TILE_M}")
        else:
            if contraction % _MIN_TILE_K:
                raise NotImplementedError(
                    f"{variant}: the contraction ({contraction}) must be a multiple of "
                    f"{_MIN_TILE_K}")
            if rows < _MIN_TILE_M:
                raise NotImplementedError(f"{variant}: M ({rows}) must be at least {_MIN_TILE_M}")
        if self.config is not None and not _fits(self.config, rows, contraction, columns,
                                                 variant, dtype.itemsize):
            raise NotImplementedError(f"{self.config} does not fit {variant} {rows}x{columns}")

    def _fwd(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, precision: Any,
             preferred_element_type: Any, variant: str, config: Config,
             return_residuals: bool) -> tuple[jax.Array, None]:
        del precision, preferred_element_type  # bf16/f16 operands, f32 accumulation
        if variant == "drhs":
            return ragged_dot_drhs(lhs, rhs, group_sizes, config=config), None
        return ragged_dot_rows(lhs, rhs, group_sizes, config=config,
                               transpose_rhs=variant == "dlhs"), None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """H200 choices: 128 x 256 CTA tiles, 64-deep steps, as many stages as SMEM holds.

        Few rows a group (`few_rows_per_group`, a decode step): 64-row tiles, the smallest
        `wgmma` takes (less padding where a group fills a fraction of a tile), and up to 6
        stages in the SMEM they free (more weight tiles in flight); the small-rows probe
        (`benchmarks/probes/ragged_dot_small_rows.py`) times it against the others."""
        args = ba.arguments
        variant = args["variant"]
        rows, contraction, columns = _problem(args["lhs"], args["rhs"], variant)
        itemsize = jnp.dtype(args["lhs"].dtype).itemsize
        tile_m = 128 if (rows % 128 == 0 if variant == "drhs" else rows >= 128) else 64
        tile_n = 128 if columns % 256 == 0 else 64
        depths: tuple[int, ...] = (4, 3, 2)
        if few_rows_per_group(ba):
            tile_m, depths = 64, (6, 5, 4, 3, 2)
        for stages in depths:
            config = Config(tile_m=tile_m, tile_n=tile_n, tile_k=64, num_stages=stages,
                            epi_n=64, grid_minor_dim=1, grid_tile_width=8)
            if _fits(config, rows, contraction, columns, variant, itemsize):
                return config
        raise NotImplementedError(f"no Mosaic GPU ragged dot config fits {variant} {ba!r}")

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        args = ba.arguments
        variant = args["variant"]
        rows, contraction, columns = _problem(args["lhs"], args["rhs"], variant)
        itemsize = jnp.dtype(args["lhs"].dtype).itemsize
        space = itertools.product((64, 128), (64, 128), (64, 128), (2, 3, 4, 5, 6), (64,),
                                  (0, 1), (1, 4, 8, 16))
        configs = set()
        for tm, tn, tk, stages, epi, minor, width in space:
            config = Config(tile_m=tm, tile_n=tn, tile_k=tk, num_stages=stages, epi_n=epi,
                            grid_minor_dim=minor, grid_tile_width=width)
            if _fits(config, rows, contraction, columns, variant, itemsize):
                configs.add(config)
        return configs

    def _default_vjp(self) -> Op:
        return RaggedDotVjp(inner=self.replace(config=None, vjp=None))
