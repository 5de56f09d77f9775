"""How a gated linear unit partitions: over the rows of `x` (all axes but the last);
the weights are replicated (a sharded K or N is gathered).

A grouped call (`group_sizes`) splits its rows the same way: each device turns the
global group sizes into its row block's own (as a ragged dot does), and its
residuals, the pre-activations, are split with the rows.
"""

from __future__ import annotations

from typing import Any

from tokamax_kernels.ragged_dot.sharding import local_group_sizes
from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule, Shard


def _local_rows(arguments: dict[str, Any], shard: Shard) -> dict[str, Any]:
    if shard.count("x0") == 1:
        return arguments
    rows = arguments["x"].shape[0]
    sizes = local_group_sizes(arguments["group_sizes"], shard.index("x0") * rows, rows)
    return {**arguments, "group_sizes": sizes}


def partition_rule(ba: BoundArguments) -> PartitionRule:
    x = ba.arguments["x"]
    rows = tuple(f"x{d}" for d in range(x.ndim - 1))
    if "group_sizes" not in ba.arguments:
        return PartitionRule(
            arguments={"x": Dims((*rows, None))}, out=Dims((*rows, None)), order=rows,
        )
    row_major = Dims(("x0", None))
    residuals = (row_major, row_major) if isinstance(ba.arguments["weights"], tuple) else row_major
    return PartitionRule(
        arguments={"x": row_major, "group_sizes": Dims((None,))}, out=row_major,
        residuals=residuals, order=("x0",), localize=_local_rows,
    )
