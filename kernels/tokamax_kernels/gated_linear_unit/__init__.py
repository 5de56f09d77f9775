"""Gated linear unit (SwiGLU and friends)."""

from tokamax_kernels.gated_linear_unit.api import gated_linear_unit
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit

__all__ = ["GatedLinearUnit", "gated_linear_unit"]
