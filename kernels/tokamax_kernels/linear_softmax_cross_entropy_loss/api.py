"""`linear_softmax_cross_entropy_loss`: the public function and its implementations."""

from __future__ import annotations

from typing import Any

from tokamax_kernels import _dispatch
from tokamax_kernels import _validation as v
from tokamax_kernels.linear_softmax_cross_entropy_loss import loss_options
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import (
    REDUCTIONS,
    LinearSoftmaxCrossEntropyLoss,
)
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
    logits_soft_cap: float | None = None, label_smoothing: float = 0.0, z_loss: float = 0.0,
    precision: Any = None, implementation: Implementation = None,
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
      label_smoothing: eps in [0, 1]: the targets are `(1 - eps) * onehot + eps / V`
        (optax.smooth_labels), so a token's loss is `lse - (1 - eps) * logit[label] -
        eps * mean(logits)`. Not supported with `logits_soft_cap`
        (`NotImplementedError`): the mean of capped logits needs all of them.
      z_loss: z >= 0 adds `z * lse**2` to each counted token's loss (PaLM's auxiliary
        z-loss, Liger-Kernel's `lse_square_scale`), lse the log-sum-exp of its
        (soft-capped) logits. Both options leave ignored tokens without loss or
        gradient, are computed around the chosen implementation from one gathered
        column of `weights` per token (and, for label smoothing, the mean column),
        never from the (tokens, V) logits, and at 0.0 (default) leave the program as it
        is without them. With z-loss the implementation returns per-token losses
        (a pinned `XlaChunkedLossConfig(gradients="forward")` does not support that).
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
    options = dict(label_smoothing=loss_options.canonical_label_smoothing(label_smoothing),
                   z_loss=loss_options.canonical_z_loss(z_loss))

    def run_family(impl: Implementation) -> Any:
        x_, weights_ = v.numpy_floats_as_jax((x, weights))
        if not any(options.values()):
            return FAMILY(impl, x_, labels, weights_, **keywords)
        _check_options(reduction, logits_soft_cap, options["label_smoothing"])

        def run(family_reduction: str) -> Any:
            return FAMILY(impl, x_, labels, weights_, **{**keywords,
                                                         "reduction": family_reduction})

        return loss_options.with_options(
            run, x_, labels, weights_, reduction=reduction, logits_soft_cap=logits_soft_cap,
            precision=precision, label_smoothing=options["label_smoothing"],
            z_loss=options["z_loss"])

    return _dispatch.call(
        implementation, run_family,
        lambda f: f(x, labels, weights, **_dispatch.given_keywords({**keywords, **options}, dict(
            reduction="sum", logits_soft_cap=None, precision=None, label_smoothing=0.0,
            z_loss=0.0))),
        op="linear_softmax_cross_entropy_loss")


def _check_options(reduction: Any, logits_soft_cap: Any, label_smoothing: float) -> None:
    """The checks `with_options` needs before it calls the family: the reduction it
    applies itself, and the combination it cannot compute."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"linear_softmax_cross_entropy_loss: reduction must be one of "
                         f"{REDUCTIONS}, got {reduction!r}")
    loss_options.check_supported(label_smoothing, logits_soft_cap)
