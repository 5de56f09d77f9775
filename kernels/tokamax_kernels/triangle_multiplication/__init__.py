"""AlphaFold's triangle multiplicative update over a pair representation."""

from tokamax_kernels.triangle_multiplication.api import triangle_multiplication

__all__ = ["triangle_multiplication"]
