"""Linear softmax cross entropy: the LM head and its loss, without the logits in memory."""

from tokamax_kernels.linear_softmax_cross_entropy_loss import (  # noqa: F401 - registration
    roofline as _roofline,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss._mosaic_gpu_common import (
    MosaicGpuLossConfig,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.api import linear_softmax_cross_entropy_loss
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    LinearSoftmaxCrossEntropyLoss,
    LinearSoftmaxCrossEntropyLossVjp,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_gpu import (
    PallasMosaicGpuLinearSoftmaxCrossEntropyLoss,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_gpu_vjp import (
    PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_tpu import (
    MosaicTpuLossConfig,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.xla_chunked import (
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLossConfig,
)

__all__ = [
    "LinearSoftmaxCrossEntropyLoss",
    "LinearSoftmaxCrossEntropyLossVjp",
    "MosaicGpuLossConfig",
    "MosaicTpuLossConfig",
    "PallasMosaicGpuLinearSoftmaxCrossEntropyLoss",
    "PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp",
    "PallasMosaicTpuLinearSoftmaxCrossEntropyLoss",
    "PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp",
    "XlaChunkedLinearSoftmaxCrossEntropyLoss",
    "XlaChunkedLinearSoftmaxCrossEntropyLossVjp",
    "XlaChunkedLossConfig",
    "linear_softmax_cross_entropy_loss",
]
