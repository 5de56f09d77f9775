"""Layer norm and RMSNorm."""

from tokamax_kernels.layer_norm.api import layer_norm
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp

__all__ = ["LayerNorm", "PallasTritonLayerNorm", "PallasTritonLayerNormVjp", "layer_norm"]
