"""The ideal work of an op call and the time a device's ceilings allow for it.

`Work` is what an op call must do at least: floating-point operations and bytes moved
to and from device memory. `Ceilings` are a device's measured rates; the roofline time
is the larger of the compute time and the memory time.

Families register their work rules here (`register_family_work`, from a module of their
own beside `base.py`, so that the source hash autotuning caches key on stays that of
the kernels), and an implementation that does work of another kind registers what it
really does (`register_performed_work`); `Op.roofline` and `Op.performed_work` read them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

# Dtypes whose products run at the 16-bit matmul rate; float32 runs at its own.
_HALF_DTYPES = frozenset({"bfloat16", "float16"})


@dataclasses.dataclass(frozen=True)
class Work:
    """Floating-point operations and device-memory bytes of one op call."""

    flops: float
    bytes: float

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """A device's measured rates: dense matmul TFLOP/s in bf16 and f32, HBM TB/s."""

    bf16_tflops: float
    f32_tflops: float
    hbm_tbps: float

    def roofline_seconds(self, work: Work, dtype: str) -> float | None:
        """The roofline time of `work` in `dtype`; `None` for a dtype with no ceiling."""
        if dtype in _HALF_DTYPES:
            tflops = self.bf16_tflops
        elif dtype == "float32":
            tflops = self.f32_tflops
        else:
            return None
        return max(work.flops / (tflops * 1e12), work.bytes / (self.hbm_tbps * 1e12))


def nbytes(array: Any) -> float:
    """Bytes of an array (or `jax.ShapeDtypeStruct`); 0 for `None`."""
    if array is None:
        return 0.0
    shape = getattr(array, "shape", ())
    return float(math.prod(shape) * np.dtype(array.dtype).itemsize)


# Work of a call, from its `BoundArguments` (typed loosely: `core.op` imports this module).
WorkRule = Callable[[Any], Work]
# What else than its work sets how fast a call runs (attention's head dim, a norm's row
# width): numbers in log2 units, from the forward call's `BoundArguments`.
FeatureRule = Callable[[Any], tuple[float, ...]]


@dataclasses.dataclass(frozen=True)
class FamilyWork:
    """A family's ideal work: of a forward call, and of its gradient (from the forward
    call's arguments; `None` where the family's VJP ops make nested op calls instead);
    and the call's shape features, which calibration points are matched on besides
    their work (`core.prediction`)."""

    forward: WorkRule
    vjp: WorkRule | None = None
    features: FeatureRule | None = None


FAMILY_WORK: dict[type, FamilyWork] = {}
PERFORMED_WORK: dict[type, WorkRule] = {}


def register_family_work(family: type, forward: WorkRule, vjp: WorkRule | None = None,
                         features: FeatureRule | None = None) -> None:
    """Declares the ideal work of `family`'s calls (every implementation shares it) and,
    optionally, the shape features its implementations' speed depends on beyond it."""
    FAMILY_WORK[family] = FamilyWork(forward, vjp, features)


def register_performed_work(implementation: type, rule: WorkRule) -> None:
    """Declares the work `implementation` (that class only, not its subclasses) really
    does where it differs in kind from its family's ideal work."""
    PERFORMED_WORK[implementation] = rule


# The calls a call is predicted as, from its `BoundArguments` (typed loosely, as above).
PredictionCallsRule = Callable[[Any], "list[Any] | None"]
PREDICTION_CALLS: dict[type, PredictionCallsRule] = {}


def register_prediction_calls(op_class: type, rule: PredictionCallsRule) -> None:
    """Declares that a call of `op_class` (or a subclass) runs at the speed of the op
    calls `rule` returns for it, rather than of its own family's calibration points (a
    grouped GLU runs at the speed of its ragged dot); `rule` returns `None` for calls
    predicted from their own op's points."""
    PREDICTION_CALLS[op_class] = rule


def prediction_calls(ba: Any) -> list[Any] | None:
    """The calls `ba` is predicted as the sum of (`register_prediction_calls`, the rule
    of the nearest class in its op's hierarchy), or `None`."""
    for cls in type(ba.op).__mro__:
        rule = PREDICTION_CALLS.get(cls)
        if rule is not None:
            return rule(ba)
    return None
