"""How a layer norm partitions: every axis but the normalized one, with no communication."""

from __future__ import annotations

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule


def partition_rule(ba: BoundArguments) -> PartitionRule:
    """`x`'s dims other than `axis` are independent rows; scale and offset are replicated.
    A `residual` (and the sum `s` the call then also returns) splits like `x`."""
    x, axis = ba.arguments["x"], ba.arguments["axis"]
    factors = Dims(tuple(None if d == axis else f"x{d}" for d in range(x.ndim)))
    rows = Dims(tuple(f for d, f in enumerate(factors.factors) if d != axis))
    with_residual = ba.arguments.get("residual") is not None
    return PartitionRule(
        arguments={"x": factors, "residual": factors} if with_residual else {"x": factors},
        out=(factors, factors) if with_residual else factors, residuals=(rows, rows),
        order=tuple(f for f in factors.factors if f is not None),
    )
