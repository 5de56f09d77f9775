"""Dot-product attention (multi-head, GQA/MQA, cross attention, masks, soft cap)."""

from tokamax_kernels.attention import roofline as _roofline  # noqa: F401 - registration
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_kernels.attention.api import DotProductAttentionImplementation, dot_product_attention
from tokamax_kernels.attention.base import (
    DotProductAttention,
    DotProductAttentionVjp,
    XlaDotProductAttentionVjp,
)
from tokamax_kernels.attention.cudnn import CudnnDotProductAttention, CudnnDotProductAttentionVjp
from tokamax_kernels.attention.pallas_mosaic_gpu import PallasMosaicGpuFlashAttention
from tokamax_kernels.attention.pallas_mosaic_gpu_vjp import PallasMosaicGpuFlashAttentionVjp
from tokamax_kernels.attention.pallas_mosaic_tpu import (
    PallasMosaicTpuAttention,
    PallasMosaicTpuFlashAttention,
)
from tokamax_kernels.attention.pallas_mosaic_tpu_vjp import PallasMosaicTpuFlashAttentionVjp
from tokamax_kernels.attention.pallas_triton import (
    PallasTritonFlashAttention,
    PallasTritonFlashAttentionConfig,
)
from tokamax_kernels.attention.pallas_triton_vjp import (
    PallasTritonFlashAttentionVjp,
    PallasTritonFlashAttentionVjpConfig,
)
from tokamax_kernels.attention.xla_chunked import (
    XlaChunkedConfig,
    XlaChunkedDotProductAttention,
    XlaChunkedDotProductAttentionVjp,
)

__all__ = [
    "CudnnDotProductAttention",
    "CudnnDotProductAttentionVjp",
    "DotProductAttention",
    "DotProductAttentionImplementation",
    "DotProductAttentionVjp",
    "MosaicAttentionConfig",
    "MosaicAttentionVjpConfig",
    "PallasMosaicGpuFlashAttention",
    "PallasMosaicGpuFlashAttentionVjp",
    "PallasMosaicTpuAttention",
    "PallasMosaicTpuFlashAttention",
    "PallasMosaicTpuFlashAttentionVjp",
    "PallasTritonFlashAttention",
    "PallasTritonFlashAttentionConfig",
    "PallasTritonFlashAttentionVjp",
    "PallasTritonFlashAttentionVjpConfig",
    "XlaChunkedConfig",
    "XlaChunkedDotProductAttention",
    "XlaChunkedDotProductAttentionVjp",
    "XlaDotProductAttentionVjp",
    "dot_product_attention",
]
