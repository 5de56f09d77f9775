"""Layer norm and RMSNorm."""

from tokamax_kernels.layer_norm import roofline as _roofline  # noqa: F401 - registration
from tokamax_kernels.layer_norm.api import layer_norm
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu import PallasMosaicTpuLayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu_vjp import PallasMosaicTpuLayerNormVjp
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp

__all__ = ["LayerNorm", "PallasMosaicTpuLayerNorm", "PallasMosaicTpuLayerNormVjp",
           "PallasTritonLayerNorm", "PallasTritonLayerNormVjp", "layer_norm"]
