"""Ragged dot (grouped matmul, as in mixture-of-experts layers), and the MoE routing
around it (`moe_dispatch`, `moe_combine`)."""

from tokamax_kernels.ragged_dot import roofline as _roofline  # noqa: F401 - registration
from tokamax_kernels.ragged_dot.api import ragged_dot
from tokamax_kernels.ragged_dot.base import RaggedDot, RaggedDotVjp
from tokamax_kernels.ragged_dot.general import ragged_dot_general
from tokamax_kernels.ragged_dot.group_sizes import RaggedDotGroupSizes
from tokamax_kernels.ragged_dot.group_sizes import (
    generate_group_sizes as generate_ragged_dot_group_sizes,
)
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot
from tokamax_kernels.ragged_dot.quantization import QuantizedArray
from tokamax_kernels.ragged_dot.routing import MoeRouting, moe_combine, moe_dispatch

__all__ = [
    "MoeRouting",
    "PallasMosaicGpuRaggedDot",
    "PallasMosaicTpuRaggedDot",
    "PallasTritonRaggedDot",
    "QuantizedArray",
    "RaggedDot",
    "RaggedDotGroupSizes",
    "RaggedDotVjp",
    "generate_ragged_dot_group_sizes",
    "moe_combine",
    "moe_dispatch",
    "ragged_dot",
    "ragged_dot_general",
]
