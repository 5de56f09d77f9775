"""How a gated linear unit partitions: over the rows of `x` (all axes but the last);
the weights are replicated (a sharded K or N is gathered)."""

from __future__ import annotations

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule


def partition_rule(ba: BoundArguments) -> PartitionRule:
    x = ba.arguments["x"]
    rows = tuple(f"x{d}" for d in range(x.ndim - 1))
    return PartitionRule(
        arguments={"x": Dims((*rows, None))}, out=Dims((*rows, None)), order=rows,
    )
