"""`PallasMosaicTpuRaggedDot`: the ragged dot (forward, dlhs, drhs) as Pallas Mosaic TPU kernels.

The kernels are in `_mosaic_tpu_kernels.py`; this module checks what they
take, and picks their tiles per TPU generation (`tokamax_kernels._mosaic_tpu`). The
gradient is `RaggedDotVjp`, which calls this op again for the dlhs and drhs. Under
`jax.vmap` the mapped axes fold into the kernels' entries (`entry_folded`): one launch
whose work list covers every entry's groups.
Nothing here has been timed on a TPU: the heuristics follow the generations' public
VMEM and MXU sizes, and `implementation=None` uses these kernels only where a
measurement on a TPU shows them faster than `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels import _mosaic_tpu
from tokamax_kernels._mosaic_tpu import MosaicTpuKernel, lane_block
from tokamax_kernels.ragged_dot._mosaic_tpu_kernels import (
    entry_folded,
    ragged_dot_drhs,
    ragged_dot_rows,
)
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp
from tokamax_pass.core import BoundArguments, Op, Target

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANES = 128  # a vector register is 8 x 128 32-bit words: lane blocks are multiples of 128
_ROW_ALIGN = 16  # row blocks: 8 sublanes, 16 for bf16 (two rows per 32-bit word)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of the TPU ragged dot.

    forward/dlhs: `block_m` output rows, `block_n` output columns, `block_k` contraction
    step. drhs: `block_m` grouped rows per step (the contraction), `block_k` x `block_n`
    the (K, N) output tile. A block at least as large as its axis covers the whole axis.
    """

    block_m: int
    block_k: int
    block_n: int

    def __post_init__(self) -> None:
        if self.block_m <= 0 or self.block_m % _ROW_ALIGN:
            raise ValueError(f"Config.block_m must be a positive multiple of {_ROW_ALIGN}, "
                             f"got {self.block_m}")
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if value <= 0 or value % _LANES:
                raise ValueError(f"Config.{name} must be a positive multiple of {_LANES}, "
                                 f"got {value}")


def _problem(lhs: Any, rhs: Any, variant: str) -> tuple[int, int, int]:
    """`(rows, contraction, columns)`: the axes `block_m`, `block_k`, `block_n` tile.

    forward/dlhs: M, the contracted axis, the output columns. drhs: M (contracted),
    K and N (the output tile).
    """
    return lhs.shape[0], lhs.shape[1], rhs.shape[2 if variant == "forward" else 1]


def _rows(x: jax.Array) -> jax.Array:
    """(E, M, C) entries -> their (E * M, C) rows."""
    return x.reshape(-1, x.shape[-1])


def _vmem_bytes(config: Config, rows: int, contraction: int, columns: int, variant: str,
                itemsize: int) -> int:
    """VMEM of the double-buffered input blocks, the output block and the accumulator."""
    bm = min(config.block_m, -(-rows // _ROW_ALIGN) * _ROW_ALIGN)
    bk, bn = lane_block(config.block_k, contraction), lane_block(config.block_n, columns)
    if variant == "drhs":
        return 2 * bm * (bk + bn) * itemsize + bk * bn * (2 * itemsize + 4)
    return 2 * (bm * bk + bk * bn) * itemsize + bm * bn * (2 * itemsize + 4)


def _fits(config: Config, rows: int, contraction: int, columns: int, variant: str,
          itemsize: int, budget: int) -> bool:
    """Whether the config runs this problem: the forward/dlhs contraction is walked in
    whole blocks, and the blocks fit the VMEM budget."""
    bk = lane_block(config.block_k, contraction)
    if variant != "drhs" and contraction % bk:
        return False
    return _vmem_bytes(config, rows, contraction, columns, variant, itemsize) <= budget


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuRaggedDot(MosaicTpuKernel, RaggedDot):
    """Ragged dot on TPUs by Pallas Mosaic TPU kernels (bf16/f32, float32 accumulation).

    `interpret=True` runs the kernels in the Pallas interpreter (any platform; tests).
    """

    config_cls: ClassVar[type] = Config

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        args = ba.arguments
        lhs, rhs, variant = args["lhs"], args["rhs"], args["variant"]
        dtype = jnp.dtype(lhs.dtype)
        if dtype not in _DTYPES or jnp.dtype(rhs.dtype) != dtype:
            raise NotImplementedError(
                f"the Mosaic TPU ragged dot needs bf16 or f32 lhs and rhs of one dtype, got "
                f"{lhs.dtype} and {rhs.dtype}")
        out = args["preferred_element_type"]
        if out is not None and jnp.dtype(out) not in _DTYPES:
            raise NotImplementedError(f"preferred_element_type={out} is not bf16 or f32")
        if 0 in lhs.shape or 0 in rhs.shape or args["group_sizes"].shape[0] == 0:
            raise NotImplementedError("the Mosaic TPU ragged dot needs non-empty operands")
        rows, contraction, columns = _problem(lhs, rhs, variant)
        if self.config is not None and not _fits(
                self.config, rows, contraction, columns, variant, dtype.itemsize,
                _mosaic_tpu.current_generation().vmem_budget()):
            raise NotImplementedError(
                f"{self.config} does not fit {variant} ({rows}, {contraction}, {columns}): the "
                "contraction must be a multiple of block_k and the blocks must fit VMEM")

    def _fwd(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, precision: Any,
             preferred_element_type: Any, variant: str, config: Config,
             return_residuals: bool) -> tuple[jax.Array, None]:
        del precision  # bf16 products are exact in f32; f32 inputs run at full precision
        out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
        rows, contraction, columns = _problem(lhs, rhs, variant)
        blocks = dict(block_m=min(config.block_m, -(-rows // _ROW_ALIGN) * _ROW_ALIGN),
                      block_k=lane_block(config.block_k, contraction),
                      block_n=lane_block(config.block_n, columns),
                      interpret=self.pallas_interpret())
        group_sizes = group_sizes.astype(jnp.int32)
        if variant == "drhs":
            def drhs(lhs: jax.Array, dout: jax.Array, sizes: jax.Array) -> tuple[jax.Array]:
                out = ragged_dot_drhs(_rows(lhs), _rows(dout), sizes, out_dtype=out_dtype,
                                      **blocks)
                return (out.reshape(sizes.shape[0], -1, *out.shape[1:]),)

            (out,) = entry_folded(drhs, 0)(lhs[None], rhs[None], group_sizes[None])
            return out[0], None

        def by_rows(lhs: jax.Array, sizes: jax.Array, rhs: jax.Array) -> tuple[jax.Array]:
            out = ragged_dot_rows(_rows(lhs), rhs.reshape(-1, *rhs.shape[2:]), sizes,
                                  transpose_rhs=variant == "dlhs", out_dtype=out_dtype,
                                  **blocks)
            return (out.reshape(sizes.shape[0], -1, out.shape[1]),)

        (out,) = entry_folded(by_rows, 1)(lhs[None], group_sizes[None], rhs[None])
        return out[0], None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """Tiles two MXUs wide (256 on v4/v5, 512 on v6e: each weight tile feeds the MXU
        twice per row block), 256 rows (a row block straddling a group boundary is
        computed once per group, so taller blocks waste more), and the deepest
        contraction step of 512/256/128 that divides the contraction and fits VMEM.
        drhs: a (2 MXU)^2 output tile over 256-row steps (its blocks are small)."""
        args = ba.arguments
        variant = args["variant"]
        rows, contraction, columns = _problem(args["lhs"], args["rhs"], variant)
        itemsize = jnp.dtype(args["lhs"].dtype).itemsize
        gen = _mosaic_tpu.current_generation()
        wide = 2 * gen.mxu
        if variant == "drhs":  # the contraction is M, walked in block_m steps: any M fits
            return Config(block_m=256, block_k=wide, block_n=wide)
        for block_k in (512, 256, 128):
            config = Config(block_m=256, block_k=block_k, block_n=wide)
            if _fits(config, rows, contraction, columns, variant, itemsize, gen.vmem_budget()):
                return config
        raise NotImplementedError(
            f"{variant}: no TPU ragged dot tiling fits the contraction {contraction} (it must "
            f"be a multiple of {_LANES} or at most {_LANES})")

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        args = ba.arguments
        variant = args["variant"]
        rows, contraction, columns = _problem(args["lhs"], args["rhs"], variant)
        itemsize = jnp.dtype(args["lhs"].dtype).itemsize
        budget = _mosaic_tpu.current_generation().vmem_budget()
        space = itertools.product((128, 256, 512), (128, 256, 512, 1024), (128, 256, 512))
        return {config for config in (Config(bm, bk, bn) for bm, bk, bn in space)
                if _fits(config, rows, contraction, columns, variant, itemsize, budget)}

    def _default_vjp(self) -> Op:
        return RaggedDotVjp(inner=self.replace(config=None, vjp=None))
