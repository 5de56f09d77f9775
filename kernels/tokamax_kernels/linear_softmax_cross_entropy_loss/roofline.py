"""The loss's work, kept apart from `base.py` so the kernels' source hash (which
autotuning caches key on) does not change with the prediction rules."""

from __future__ import annotations

import math

from tokamax_kernels.linear_softmax_cross_entropy_loss.base import LinearSoftmaxCrossEntropyLoss
from tokamax_pass.core import BoundArguments, Work
from tokamax_pass.core.roofline import nbytes, register_family_work


def forward_work(ba: BoundArguments) -> Work:
    """The logits product (2 T H V FLOPs) with x, the weights and the labels read once;
    the logits never reach memory."""
    a = ba.arguments
    tokens, hidden = math.prod(a["x"].shape[:-1]), a["x"].shape[-1]
    flops = 2.0 * tokens * hidden * a["weights"].shape[-1]
    return Work(flops, nbytes(a["x"]) + nbytes(a["weights"]) + nbytes(a["labels"]))


def vjp_work(ba: BoundArguments) -> Work:
    """The two gradient products (x's and the weights'), their operands read and the
    cotangents written once."""
    forward = forward_work(ba)
    a = ba.arguments
    return Work(2 * forward.flops, forward.bytes + nbytes(a["x"]) + nbytes(a["weights"]))


register_family_work(LinearSoftmaxCrossEntropyLoss, forward_work, vjp_work)
