"""The GLU's work, kept apart from `base.py` so the kernels' source hash (which
autotuning caches key on) does not change with the prediction rules."""

from __future__ import annotations

import math

import jax

from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_pass.core import BoundArguments, Work
from tokamax_pass.core.roofline import nbytes, register_family_work, register_performed_work


def forward_work(ba: BoundArguments) -> Work:
    """The gate and up products (4 M K N FLOPs), x and the weights read and the (M, N)
    output written once; dense or grouped."""
    x, weights = ba.arguments["x"], ba.arguments["weights"]
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = (weights[0] if isinstance(weights, tuple) else weights).shape[-1]
    out = jax.ShapeDtypeStruct((rows, n), x.dtype)
    weight_bytes = (sum(nbytes(w) for w in weights) if isinstance(weights, tuple)
                    else nbytes(weights))
    return Work(4.0 * rows * k * n, nbytes(x) + weight_bytes + nbytes(out))


def vjp_work(ba: BoundArguments) -> Work:
    """The four gradient products (x's and each weight's); the operands, the output's
    cotangent and the gate and up activations read, the cotangents written once. (A
    grouped call's gradient is ragged dots: `GatedLinearUnitVjp.evidence_calls`.)"""
    forward = forward_work(ba)
    return Work(2 * forward.flops, 2 * forward.bytes + nbytes(ba.arguments["x"]))


def xla_work(ba: BoundArguments) -> Work:
    """A grouped call in XLA runs `jax.lax.ragged_dot`: a dense product per group (as
    `ragged_dot.roofline.xla_ragged_dot_work` where it runs `jax.lax.ragged_dot`); a
    dense call does the ideal work."""
    work = forward_work(ba)
    if "group_sizes" not in ba.arguments:
        return work
    return Work(work.flops * max(1, ba.arguments["group_sizes"].shape[0]), work.bytes)


register_family_work(GatedLinearUnit, forward_work, vjp_work)
register_performed_work(GatedLinearUnit, xla_work)
