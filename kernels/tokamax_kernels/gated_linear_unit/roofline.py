"""The GLU's work and the calls a grouped GLU is predicted as, kept apart from `base.py`
and the kernels so their source hash (which autotuning caches key on) does not change
with the prediction rules."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit, GatedLinearUnitVjp
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu import PallasMosaicGpuGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import PallasMosaicTpuGatedLinearUnit
from tokamax_kernels.ragged_dot import (
    PallasMosaicGpuRaggedDot,
    PallasMosaicTpuRaggedDot,
    RaggedDot,
)
from tokamax_pass.core import BoundArguments, Op, Work
from tokamax_pass.core.roofline import (
    nbytes,
    register_family_work,
    register_performed_work,
    register_prediction_calls,
)


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


# The ragged dot whose GEMM each grouped implementation runs: XLA's ragged dot with the
# activation after it, or a kernel's with the GLU in its epilogue.
_GROUPED_GEMM: dict[type, Callable[[Any], Op]] = {
    GatedLinearUnit: lambda op: RaggedDot(),
    PallasMosaicGpuGatedLinearUnit: lambda op: PallasMosaicGpuRaggedDot(),
    PallasMosaicTpuGatedLinearUnit: lambda op: PallasMosaicTpuRaggedDot(interpret=op.interpret),
}


def grouped_gemm_call(ragged_dot: Op, ba: BoundArguments) -> BoundArguments:
    """`ragged_dot`'s call, on shapes, of a grouped GLU call's `x` against every weight
    column as one (G, K, 2N) array: the GEMM whose speed sets the call's."""
    arguments = ba.arguments
    x, weights, group_sizes = arguments["x"], arguments["weights"], arguments["group_sizes"]
    w = weights[0] if isinstance(weights, tuple) else weights
    g, k, n = w.shape[0], w.shape[1], w.shape[-1]
    return ragged_dot.bind(jax.ShapeDtypeStruct(x.shape, x.dtype),
                           jax.ShapeDtypeStruct((g, k, 2 * n), w.dtype),
                           jax.ShapeDtypeStruct(group_sizes.shape, group_sizes.dtype),
                           precision=arguments["precision"]).replace(vmap=ba.vmap)


def forward_prediction_calls(ba: BoundArguments) -> list[BoundArguments] | None:
    """A grouped call runs at the speed of its implementation's ragged dot of `x` against
    every weight column, (G, K, 2N) (the family's calibration points are dense calls); a
    dense call is predicted from those points."""
    if "group_sizes" not in ba.arguments:
        return None
    ragged_dot = next(_GROUPED_GEMM[cls] for cls in type(ba.op).__mro__ if cls in _GROUPED_GEMM)
    return [grouped_gemm_call(ragged_dot(ba.op), ba)]


def vjp_prediction_calls(ba: BoundArguments) -> list[BoundArguments] | None:
    """A grouped call's gradient: the gradient of the ragged dot of `x` against every
    weight column, (G, K, 2N) (the dlhs and drhs it runs, by the VJP's `ragged_dot_op`),
    predicted from the `ragged_dot` family's gradient points."""
    op = ba.op
    if "group_sizes" not in ba.arguments or not isinstance(op, GatedLinearUnitVjp):
        return None
    forward = grouped_gemm_call(op.ragged_dot_op(), ba)
    lhs, rhs = forward.arguments["lhs"], forward.arguments["rhs"]
    out = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    return [forward.op.vjp_op().bind(None, out, out, **forward.arguments).replace(
        vmap=ba.vmap)]


register_family_work(GatedLinearUnit, forward_work, vjp_work)
register_performed_work(GatedLinearUnit, xla_work)
register_prediction_calls(GatedLinearUnit, forward_prediction_calls)
register_prediction_calls(GatedLinearUnitVjp, vjp_prediction_calls)
