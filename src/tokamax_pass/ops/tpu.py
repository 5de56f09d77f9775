"""Upstream Tokamax's `tokamax.ops.tpu`: TPU kernel classes and their configs under
upstream's names, for the kernels this library has (flash attention, ragged dot, the
cross-entropy loss); upstream's other TPU kernels, `V2RaggedDot` among them, are absent.

The classes are this library's: their fields and configs differ from upstream's
(docs/compatibility.md). A config whose upstream namesake orders its fields differently
is keyword-only here, so a positional call raises instead of meaning something else.
"""

from tokamax_kernels.attention.pallas_mosaic_tpu import Config as FlashAttentionConfig
from tokamax_kernels.attention.pallas_mosaic_tpu import (
    PallasMosaicTpuFlashAttention as FlashAttention,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_tpu import (
    MosaicTpuLossConfig as LinearSoftmaxCrossEntropyLossConfig,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_tpu import (
    PallasMosaicTpuLinearSoftmaxCrossEntropyLoss as LinearSoftmaxCrossEntropyLoss,
)
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import Config as RaggedDotConfig
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot as RaggedDot

__all__ = [
    "FlashAttention",
    "FlashAttentionConfig",
    "LinearSoftmaxCrossEntropyLoss",
    "LinearSoftmaxCrossEntropyLossConfig",
    "RaggedDot",
    "RaggedDotConfig",
]
