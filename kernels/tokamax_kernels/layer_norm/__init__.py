"""Layer norm and RMSNorm."""

from tokamax_kernels.layer_norm.api import layer_norm
from tokamax_kernels.layer_norm.base import LayerNorm

__all__ = ["LayerNorm", "layer_norm"]
