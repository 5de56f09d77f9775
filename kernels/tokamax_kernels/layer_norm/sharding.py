"""How a layer norm partitions: every axis but the normalized one, with no communication."""

from __future__ import annotations

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule


def partition_rule(ba: BoundArguments) -> PartitionRule:
    """`x`'s dims other than `axis` are independent rows; scale and offset are replicated."""
    x, axis = ba.arguments["x"], ba.arguments["axis"]
    factors = tuple(None if d == axis else f"x{d}" for d in range(x.ndim))
    rows = Dims(tuple(f for d, f in enumerate(factors) if d != axis))
    return PartitionRule(
        arguments={"x": Dims(factors)}, out=Dims(factors), residuals=(rows, rows),
        order=tuple(f for f in factors if f is not None),
    )
