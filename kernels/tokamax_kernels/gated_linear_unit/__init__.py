"""Gated linear unit (SwiGLU and friends), dense or grouped (MoE expert GEMMs)."""

from tokamax_kernels.gated_linear_unit import roofline as _roofline  # noqa: F401 - registration
from tokamax_kernels.gated_linear_unit.api import gated_linear_unit
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit, GatedLinearUnitVjp
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu import PallasMosaicGpuGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu_vjp import (
    PallasMosaicGpuGatedLinearUnitVjp,
)
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import PallasMosaicTpuGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp

__all__ = [
    "GatedLinearUnit", "GatedLinearUnitVjp", "PallasMosaicGpuGatedLinearUnit",
    "PallasMosaicGpuGatedLinearUnitVjp", "PallasMosaicTpuGatedLinearUnit",
    "PallasTritonGatedLinearUnit", "PallasTritonGatedLinearUnitVjp", "gated_linear_unit",
]
