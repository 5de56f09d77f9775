"""The norms' work, kept apart from `base.py` so the kernels' source hash (which
autotuning caches key on) does not change with the prediction rules."""

from __future__ import annotations

import math

from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_pass.core import BoundArguments, Work
from tokamax_pass.core.roofline import nbytes, register_family_work


def forward_work(ba: BoundArguments) -> Work:
    """x read and the output written once (with a residual: it read and the sum written
    too), the parameters read; a few FLOPs an element."""
    a = ba.arguments
    streams = 4 if a.get("residual") is not None else 2
    params = nbytes(a["scale"]) + nbytes(a["offset"])
    return Work(8.0 * math.prod(a["x"].shape), streams * nbytes(a["x"]) + params)


def vjp_work(ba: BoundArguments) -> Work:
    """x and the output's cotangent read, x's cotangent written (with a residual: the
    sum's cotangent read too); the parameters read and their cotangents written."""
    a = ba.arguments
    streams = 4 if a.get("residual") is not None else 3
    params = 2 * (nbytes(a["scale"]) + nbytes(a["offset"]))
    return Work(12.0 * math.prod(a["x"].shape), streams * nbytes(a["x"]) + params)


def features(ba: BoundArguments) -> tuple[float, ...]:
    """The row width (log2): XLA's row reductions and a row-per-program kernel reach
    different shares of the memory rate on narrow and wide rows at equal bytes."""
    return (math.log2(max(1, ba.arguments["x"].shape[-1])),)


register_family_work(LayerNorm, forward_work, vjp_work, features)
