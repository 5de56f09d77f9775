"""Gated linear unit (SwiGLU and friends)."""

from tokamax_kernels.gated_linear_unit.api import gated_linear_unit
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp

__all__ = [
    "GatedLinearUnit", "PallasTritonGatedLinearUnit", "PallasTritonGatedLinearUnitVjp",
    "gated_linear_unit",
]
