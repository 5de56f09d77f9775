"""`linear_softmax_cross_entropy_loss`: the public function and its implementations."""

from __future__ import annotations

from typing import Any

from tokamax_kernels import _dispatch
from tokamax_kernels import _validation as v
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import LinearSoftmaxCrossEntropyLoss
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_gpu import (
    PallasMosaicGpuLinearSoftmaxCrossEntropyLoss,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.pallas_mosaic_tpu import (
    PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.xla_chunked import (
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
)
from tokamax_pass.core import Family, register_family
from tokamax_pass.core.registry import Implementation

# `None` runs `mosaic_gpu`, `mosaic_tpu` or `xla_chunked` only where a measurement at the
# shape (or a neighbour) shows it faster than `xla`; explicitly, `implementation="mosaic"`
# (Hopper or TPU) or `"xla_chunked"` bounds the memory.
FAMILY = register_family(Family(
    name="linear_softmax_cross_entropy_loss",
    implementations={"mosaic_gpu": PallasMosaicGpuLinearSoftmaxCrossEntropyLoss,
                     "mosaic_tpu": PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
                     "xla_chunked": XlaChunkedLinearSoftmaxCrossEntropyLoss,
                     "xla": LinearSoftmaxCrossEntropyLoss},
    automatic=("mosaic_gpu", "mosaic_tpu", "xla_chunked", "xla"),
    # "chunked_xla": upstream Tokamax's name for the chunked XLA implementation.
    aliases={"mosaic": ("mosaic_gpu", "mosaic_tpu"), "chunked_xla": ("xla_chunked",)},
))


def linear_softmax_cross_entropy_loss(
    x: Any, labels: Any, weights: Any, *, reduction: str = "sum",
    logits_soft_cap: float | None = None, precision: Any = None,
    implementation: Implementation = None,
) -> Any:
    """Softmax cross entropy of the logits `x @ weights` against integer `labels`.

    Args:
      x: (..., H) float tokens.
      labels: (...) integer class ids in [0, V); a negative label ignores its token
        (no loss, not counted by "mean"). Concrete labels >= V are a ValueError; traced
        ones give a NaN loss.
      weights: (H, V), x's dtype.
      reduction: "sum" (default), "mean" (over the labels >= 0; 0 when there are none)
        or "none" (float32 per-token losses, labels' shape, 0 where ignored).
      logits_soft_cap: if set, logits -> cap * tanh(logits / cap) (Gemma 2).
      precision: of the GEMMs (`jax.lax.Precision` or its name, or a pair).
      implementation: `None` (plain XLA unless a measurement favours another), "xla"
        (the logits materialized), "xla_chunked" or "chunked_xla" (upstream Tokamax's
        name; tiles of logits only: memory bounded by the tile), "mosaic_gpu" (Hopper:
        the logits tiles stay in registers; the backward holds one vocabulary chunk of
        dlogits), "mosaic_tpu" (Pallas kernels on TPUs), "mosaic" (the platform's Mosaic
        kernel), an `Op` instance, a function, or a sequence of those, tried in order
        until one does not raise `NotImplementedError` (as upstream Tokamax does). A
        function is called as `f(x, labels, weights, **keywords)` with the keywords this
        call was given.

    Returns the float32 loss; differentiable in `x` and `weights`.
    """
    keywords = dict(reduction=reduction, logits_soft_cap=logits_soft_cap, precision=precision)

    def run_family(impl: Implementation) -> Any:
        x_, weights_ = v.numpy_floats_as_jax((x, weights))
        return FAMILY(impl, x_, labels, weights_, **keywords)

    return _dispatch.call(
        implementation, run_family,
        lambda f: f(x, labels, weights, **_dispatch.given_keywords(keywords, dict(
            reduction="sum", logits_soft_cap=None, precision=None))),
        op="linear_softmax_cross_entropy_loss")
