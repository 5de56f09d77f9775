"""Predicted op times: the roofline time of the work a call does, over the device's
measured ceilings, divided by the efficiency the implementation reached near the call.

The work comes from the op (`performed_work`: the family's ideal work, `Op.roofline`,
unless the implementation does work of another kind; a VJP op's from its family's
gradient rule or its nested calls). The efficiency comes from the
device's calibration (`core.calibration`): the measured points of this op and dtype
nearest the call in log space (FLOPs, bytes and the family's shape features, such as
attention's head dim, which set a kernel's speed beyond its work), interpolated; where
none is near, the nearest few all the same. A call whose speed is that of other calls
(`roofline.register_prediction_calls`) is predicted as their sum. No calibration for the
device kind, no work, or no point of the op: no prediction.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import statistics
from collections.abc import Sequence

import numpy as np

from tokamax_pass.core import calibration as calibration_lib
from tokamax_pass.core import roofline as roofline_lib
from tokamax_pass.core import spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.hooks import HOOKS
from tokamax_pass.core.op import Op, family_class
from tokamax_pass.core.roofline import Work

# Points within this distance (log2 units of FLOPs and bytes: 1.0 is a factor of 2 in
# one of them) of a call are its neighbours; the nearest few are interpolated.
NEIGHBOUR_RADIUS = 1.0
NEIGHBOURS = 4
# How much farther a step in a shape feature (log2 units, as the work's) puts a point than
# the same step in FLOPs or bytes: a feature changes how a kernel runs (attention's head
# dim sets its tiles and register use), not only how much it does, so a point of the
# call's own head dim or row width is a better guide than one of another at a closer
# size. docs/selection.md gives the fit's measure of it.
FEATURE_WEIGHT = 3.0
# Arguments of a VJP call that are not the forward's (`core.vjp.RESERVED_NAMES`; that
# module imports the selection, which imports this one).
NOT_FORWARD = frozenset({"residuals", "out", "dout", "shared_inputs", "dresiduals"})


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted time and how it was reached: interpolated from points near the call
    (`near`), or the op's median efficiency."""

    seconds: float
    efficiency: float
    near: bool


def wrapped_ops(op: Op) -> list[Op]:
    """The ops `op` runs inside it (a `RaggedDotVjp`'s `inner`, an `AutodiffVjp`'s
    `forward`), its config and VJP aside."""
    return [getattr(op, f.name) for f in dataclasses.fields(op)
            if f.name not in ("config", "vjp") and isinstance(getattr(op, f.name), Op)]


def op_name(op: Op) -> str:
    """The name calibration points carry for `op`: its class, with the ops it wraps
    (`RaggedDotVjp(PallasTritonRaggedDot)`), configs aside."""
    inner = wrapped_ops(op)
    name = type(op).__name__
    return f"{name}({','.join(op_name(o) for o in inner)})" if inner else name


def kernel_implementation(op: Op) -> str:
    """The implementation that does `op`'s work: that of the one op it wraps (a ragged
    dot's VJP is XLA code around two ragged dots of its `inner` kernel), else its own."""
    inner = wrapped_ops(op)
    return kernel_implementation(inner[0]) if len(inner) == 1 else op.implementation


def call_dtype(ba: BoundArguments) -> str | None:
    """The dtype a call computes in: its first floating-point forward argument's."""
    for name, value in ba.arguments.items():
        if name in NOT_FORWARD or not spec.is_array(value):
            continue
        dtype = np.dtype(value.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
            return dtype.name
    return None


def performed_work(ba: BoundArguments) -> Work | None:
    """The work the call does as its op performs it (`Op.performed_work`). A VJP op's:
    its nested calls' work added up, for one that makes op calls (`evidence_calls`),
    else its forward family's `vjp_roofline` of the forward arguments."""
    op = ba.op
    if HOOKS.vjp_base is None or not isinstance(op, HOOKS.vjp_base):
        return op.performed_work(ba)
    nested = op.evidence_calls(ba)
    if nested is not None:
        works = [performed_work(call) for call in nested]
        if not works or any(w is None for w in works):
            return None
        return functools.reduce(operator.add, works)
    forward = _forward_call(ba)
    return None if forward is None else forward.op.vjp_roofline(forward)


def _forward_call(ba: BoundArguments) -> BoundArguments | None:
    """The forward call a call belongs to: itself, or a VJP op's forward arguments bound
    to its forward family."""
    op = ba.op
    if HOOKS.vjp_base is None or not isinstance(op, HOOKS.vjp_base):
        return ba
    family = op.forward_family
    forward_op = getattr(op, "forward", None)
    if family is None and isinstance(forward_op, Op):
        family = type(forward_op)
    if family is None:
        return None
    forward = {k: v for k, v in ba.arguments.items() if k not in NOT_FORWARD}
    return BoundArguments(family(), forward, ba.vmap)


def call_features(ba: BoundArguments) -> tuple[float, ...]:
    """The shape features of the call's family (`roofline.register_family_work`), or `()`."""
    forward = _forward_call(ba)
    if forward is None:
        return ()
    rules = roofline_lib.FAMILY_WORK.get(family_class(type(forward.op)))
    if rules is None or rules.features is None:
        return ()
    return tuple(float(f) for f in rules.features(forward))


def call_work(ba: BoundArguments) -> Work | None:
    """The work the call does as its op performs it, `vmap`s included."""
    work = performed_work(ba)
    if work is None:
        return None
    copies = math.prod(level.size for level in ba.vmap)
    return Work(work.flops * copies, work.bytes * copies)


def _position(flops: float, nbytes: float, features: Sequence[float]) -> tuple[float, ...]:
    return (math.log2(max(flops, 1.0)), math.log2(max(nbytes, 1.0)),
            *(FEATURE_WEIGHT * f for f in features))


def efficiency(calibration: calibration_lib.Calibration, name: str, dtype: str,
               work: Work, features: Sequence[float] = ()) -> tuple[float, bool] | None:
    """`(efficiency, near)` of op `name` in `dtype` at `work` and `features`: interpolated
    from the nearest points within `NEIGHBOUR_RADIUS` (`near`), else from the nearest
    few all the same (held-out calls are predicted better so than by the op's median),
    or `None` with no point. Where no point has as many features as the call, points
    are compared on their work only."""
    points = calibration.by_op.get(name, ())
    same_dtype = [p for p in points if p.dtype == dtype]
    if not same_dtype:
        return (statistics.median(p.efficiency for p in points), False) if points else None
    matching = [p for p in same_dtype if len(p.features) == len(features)]
    compared, used = (matching, tuple(features)) if matching else (same_dtype, ())
    x = _position(work.flops, work.bytes, used)
    distances = sorted((math.dist(x, _position(p.flops, p.bytes, p.features[:len(used)])),
                        p.efficiency) for p in compared)
    near = [(d, e) for d, e in distances[:NEIGHBOURS] if d <= NEIGHBOUR_RADIUS]
    found = near or distances[:NEIGHBOURS]
    weights = [1.0 / (d + 0.05) for d, _ in found]
    log_efficiency = sum(w * math.log(e) for w, (_, e) in zip(weights, found, strict=True))
    return math.exp(log_efficiency / sum(weights)), bool(near)


def predict(ba: BoundArguments,
            calibration: calibration_lib.Calibration | None) -> Prediction | None:
    """The predicted time of `ba` on the calibrated device, or `None` (see the module).

    A call whose family registered the calls that set its speed
    (`roofline.register_prediction_calls`: a grouped GLU's ragged dot) is predicted as
    their sum."""
    if calibration is None:
        return None
    calls = roofline_lib.prediction_calls(ba)
    if calls is not None:
        return _predict_sum(calls, calibration)
    return _predict_own(ba, calibration)


def _predict_sum(calls: Sequence[BoundArguments],
                 calibration: calibration_lib.Calibration) -> Prediction | None:
    """The predictions of `calls` added up (`None` unless every one has a prediction);
    the efficiency is that of the whole: the parts' roofline times over their sum."""
    parts = [predict(call, calibration) for call in calls]
    known = [part for part in parts if part is not None]
    if not known or len(known) < len(parts):
        return None
    seconds = sum(part.seconds for part in known)
    ideal = sum(part.seconds * part.efficiency for part in known)
    return Prediction(seconds, ideal / seconds, all(part.near for part in known))


def _predict_own(ba: BoundArguments,
                 calibration: calibration_lib.Calibration) -> Prediction | None:
    """`ba` predicted from the calibration points of its own op (`op_name`)."""
    dtype = call_dtype(ba)
    work = call_work(ba)
    if dtype is None or work is None or (work.flops <= 0 and work.bytes <= 0):
        return None
    roofline = calibration.ceilings.roofline_seconds(work, dtype)
    found = efficiency(calibration, op_name(ba.op), dtype, work, call_features(ba))
    if roofline is None or found is None:
        return None
    value, near = found
    # Efficiencies fitted on larger calls put a tiny one's time below anything measured
    # (a 1 x 256 x 2 x 64 attention, say): every candidate waits at least the
    # device's shortest measured call, so none is predicted faster there.
    seconds = max(roofline / value, calibration.fastest_seconds)
    return Prediction(seconds, roofline / seconds, near)


def predict_all(candidates: Sequence[BoundArguments],
                device_kind: str | None) -> list[Prediction | None] | None:
    """Each candidate's prediction on `device_kind`, or `None` where it has no calibration."""
    calibration = calibration_lib.for_device_kind(device_kind)
    if calibration is None:
        return None
    return [_predict_or_none(ba, calibration) for ba in candidates]


def _predict_or_none(ba: BoundArguments,
                     calibration: calibration_lib.Calibration) -> Prediction | None:
    """`predict`, with a work rule that fails on an unusual call (a user-defined family's,
    say) giving no prediction rather than failing the op call."""
    try:
        return predict(ba, calibration)
    except (ArithmeticError, AttributeError, LookupError, TypeError, ValueError) as e:
        logging.getLogger(__name__).warning(
            "tokamax_pass: no prediction for %s: %s: %s", op_name(ba.op), type(e).__name__, e)
        return None
