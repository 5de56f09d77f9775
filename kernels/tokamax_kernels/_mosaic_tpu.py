"""What the Pallas Mosaic TPU kernels share: the implementation mixin and TPU generations.

Generation figures are public specifications, not measurements (nothing here has run
on a TPU): VMEM per TensorCore and MXU shape from JAX's own chip table
(`jax._src.tpu_info.get_tpu_info_for_chip`, jax 0.11.2); peak bf16 matmul rate and
HBM bandwidth per chip from Google Cloud's TPU system-architecture pages
(cloud.google.com/tpu/docs/v4, v5e, v5p, v6e). Kernels size their tiles from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Literal

from jax.experimental.pallas import tpu as pltpu

from tokamax_pass.core import Target, current_target


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """Public figures of one TPU generation (per chip, VMEM per TensorCore)."""

    name: str
    device_kinds: tuple[str, ...]
    vmem_bytes: int
    mxu: int  # the systolic array is mxu x mxu: tiles are multiples of it
    bf16_tflops: float
    hbm_gb_per_s: float

    def vmem_budget(self) -> int:
        """Bytes of VMEM a kernel's blocks may use: half, leaving room for double
        buffering done by the compiler and for its internal scratch."""
        return self.vmem_bytes // 2


_MIB = 1024 * 1024
GENERATIONS = (
    TpuGeneration("v4", ("TPU v4",), 16 * _MIB, 128, 275.0, 1228.0),
    TpuGeneration("v5e", ("TPU v5 lite", "TPU v5e"), 128 * _MIB, 128, 197.0, 819.0),
    TpuGeneration("v5p", ("TPU v5p", "TPU v5"), 64 * _MIB, 128, 459.0, 2765.0),
    TpuGeneration("v6e", ("TPU v6 lite", "TPU v6e"), 128 * _MIB, 256, 918.0, 1640.0),
)
# Cost of one grid step beyond its traffic and FLOPs, in seconds (Pallas TPU's documented
# order of magnitude): roofline models add it per step, so they do not pick needlessly
# small blocks.
STEP_SECONDS = 0.35e-6
# Unknown or absent device kind (interpret mode on a CPU): the smallest VMEM and MXU of
# the table, so a heuristic config fits every generation.
_FALLBACK = GENERATIONS[0]


def generation(device_kind: str | None) -> TpuGeneration:
    """The generation of a device kind (`"TPU v6 lite"`); v4's figures when unknown."""
    for gen in GENERATIONS:
        if device_kind in gen.device_kinds:
            return gen
    return _FALLBACK


def current_generation() -> TpuGeneration:
    """The generation the program is built for (see `tokamax_pass.core.current_target`)."""
    target = current_target()
    return generation(target.device_kind if target.platform == "tpu" else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuKernel:
    """Mixin of the Pallas Mosaic TPU implementations (listed before the family class).

    They lower for TPUs (also from a machine without one: `jax.export` for `"tpu"`), or
    run on any platform in the Pallas TPU interpreter with `interpret=True`.
    """

    interpret: bool = False

    implementation: ClassVar[str] = "mosaic_tpu"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"tpu"})

    def check_supported_target(self, target: Target) -> None:
        if not self.interpret:
            super().check_supported_target(target)  # type: ignore[misc]

    def pallas_interpret(self) -> bool:
        """`pallas_call(interpret=...)`: Pallas's interpreter, which runs TPU grid specs
        (scalar prefetch, VMEM scratch) on any backend and fills outputs, scratch and
        padding with NaN, so a kernel that reads what it never wrote fails its tests.

        Not the TPU interpreter (`pltpu.InterpretParams`): it runs kernels through
        ordered `io_callback`s, whose effect tokens a `tokamax_call` lowering does not
        thread. Tests run the kernel functions alone under it as well: it also models
        when TPU output blocks are written back.
        """
        return self.interpret


# A grid axis's semantics, as `pltpu.CompilerParams` names them.
GridSemantics = Literal["parallel", "core_parallel", "subcore_parallel", "arbitrary"]


def compiler_params(semantics: Sequence[GridSemantics],
                    vmem_bytes: int) -> pltpu.CompilerParams:
    """Mosaic parameters: grid axis semantics and a VMEM limit with 25% headroom."""
    return pltpu.CompilerParams(dimension_semantics=tuple(semantics),
                                vmem_limit_bytes=int(vmem_bytes * 1.25) + _MIB)


def lane_block(block: int, size: int) -> int:
    """A block along a lane (last) axis: the whole axis when the block covers it (Mosaic
    takes any full axis), else the block, a multiple of 128."""
    return size if block >= size else block
