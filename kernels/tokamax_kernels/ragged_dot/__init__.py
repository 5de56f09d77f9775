"""Ragged dot (grouped matmul, as in mixture-of-experts layers)."""

from tokamax_kernels.ragged_dot.api import ragged_dot
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot

__all__ = [
    "PallasMosaicGpuRaggedDot", "PallasMosaicTpuRaggedDot", "PallasTritonRaggedDot", "RaggedDot",
    "RaggedDotVjp", "ragged_dot",
]
