"""Upstream Tokamax's `tokamax.ops.gpu`: GPU kernel classes and their configs under
upstream's names, for the kernels this library has.

The classes are this library's: their fields and configs differ from upstream's
(docs/compatibility.md). A config whose upstream namesake orders its fields differently
is keyword-only here, so a positional call raises instead of meaning something else.
"""

from tokamax_kernels.attention.pallas_mosaic_gpu import (
    MosaicAttentionConfig as PallasMosaicFlashAttentionConfig,
)
from tokamax_kernels.attention.pallas_mosaic_gpu import (
    PallasMosaicGpuFlashAttention as PallasMosaicFlashAttention,
)
from tokamax_kernels.attention.pallas_triton import (
    PallasTritonFlashAttention,
    PallasTritonFlashAttentionConfig,
)
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu import (
    Config as PallasMosaicGatedLinearUnitConfig,
)
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu import (
    PallasMosaicGpuGatedLinearUnit as PallasMosaicGatedLinearUnit,
)
from tokamax_kernels.gated_linear_unit.pallas_triton import (
    Config as PallasTritonGatedLinearUnitConfig,
)
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_kernels.layer_norm.pallas_triton import Config as NormalizationConfig
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm as Normalization
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import Config as PallasMosaicRaggedDotConfig
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import (
    PallasMosaicGpuRaggedDot as PallasMosaicRaggedDot,
)
from tokamax_kernels.ragged_dot.pallas_triton import Config as PallasTritonRaggedDotConfig
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot

__all__ = [
    "Normalization",
    "NormalizationConfig",
    "PallasMosaicFlashAttention",
    "PallasMosaicFlashAttentionConfig",
    "PallasMosaicGatedLinearUnit",
    "PallasMosaicGatedLinearUnitConfig",
    "PallasMosaicRaggedDot",
    "PallasMosaicRaggedDotConfig",
    "PallasTritonFlashAttention",
    "PallasTritonFlashAttentionConfig",
    "PallasTritonGatedLinearUnit",
    "PallasTritonGatedLinearUnitConfig",
    "PallasTritonRaggedDot",
    "PallasTritonRaggedDotConfig",
]
