"""Ragged dot (grouped matmul, as in mixture-of-experts layers)."""

from tokamax_kernels.ragged_dot.api import ragged_dot
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp

__all__ = ["RaggedDot", "RaggedDotVjp", "ragged_dot"]
