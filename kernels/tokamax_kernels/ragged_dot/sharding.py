"""How a ragged dot partitions: over the rows (M) of `lhs`, with no communication.

Each device takes a block of rows and turns the global `group_sizes` into its
block's own (each group clipped to the block's row range, found from the device's
position on the row axes). The weights (`rhs`, (G, K, N)) are replicated; the
`drhs` variant (x^T @ dy per group) sums over rows, so its block results are
`psum`med. A sharded K, N or G dim is gathered.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.sharding import Dims, PartitionRule, Shard


def local_group_sizes(group_sizes: Any, first_row: Any, rows: int) -> Any:
    """Rows of each group inside `[first_row, first_row + rows)`: the block's group sizes."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    last_row = first_row + rows
    clipped = jnp.clip(ends, first_row, last_row) - jnp.clip(starts, first_row, last_row)
    return clipped.astype(group_sizes.dtype)


def _localize(arguments: dict[str, Any], shard: Shard) -> dict[str, Any]:
    if shard.count("m") == 1:
        return arguments
    rows = arguments["lhs"].shape[0]
    sizes = local_group_sizes(arguments["group_sizes"], shard.index("m") * rows, rows)
    return {**arguments, "group_sizes": sizes}


def partition_rule(ba: BoundArguments) -> PartitionRule:
    rows = Dims(("m", None))
    if ba.arguments["variant"] == "drhs":
        rhs, out = rows, Dims((None, None, None), summed=("m",))
    else:
        rhs, out = Dims((None, None, None)), rows
    return PartitionRule(
        arguments={"lhs": rows, "rhs": rhs, "group_sizes": Dims((None,))},
        out=out, order=("m",), localize=_localize,
    )
