"""How a ragged dot partitions: over the rows (M) of `lhs`, and over the groups (G) of `rhs`
(expert parallelism), with no gather of either.

Rows: each device takes a block of rows and turns the global `group_sizes` into its
block's own (each group clipped to the block's row range, found from the device's
position on the row axes). The `drhs` variant (x^T @ dy per group) sums over rows,
so its block results are `psum`med.

Groups (the experts' weights `rhs` (G, K, N) sharded over G, only where its sharding
asks for it): each device holds the weights of G/E consecutive groups and computes
only the rows of those groups: the rows are rolled so that its first group starts at
row 0, the group sizes become its groups' own (rows of other groups fall past their
sum and give zeros), and the result is rolled back; the partial results are `psum`med
over the expert axes. In the gradient, `drhs` stays on each device's own groups and
`dlhs` is `psum`med the same way. A sharded K or N dim is gathered. Inside
`jax.shard_map`, `expert_parallel.expert_parallel_ragged_dot` does the same on
per-device blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.core import BoundArguments
from tokamax_pass.core.partition_rules import Dims, PartitionRule, Shard

_ROW_ARGUMENTS = ("lhs", "out", "dout")  # row-major arrays of a call (or of its VJP call)


def local_group_sizes(group_sizes: Any, first_row: Any, rows: int) -> Any:
    """Rows of each group inside `[first_row, first_row + rows)`: the block's group sizes."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    last_row = first_row + rows
    clipped = jnp.clip(ends, first_row, last_row) - jnp.clip(starts, first_row, last_row)
    return clipped.astype(group_sizes.dtype)


def expert_block(group_sizes: Any, first_group: Any, groups: int) -> tuple[Any, Any]:
    """`(offset, sizes)`: the first row of groups `[first_group, first_group + groups)` and
    their sizes (the rows before them are those of the earlier groups)."""
    before = jnp.arange(group_sizes.shape[0]) < first_group
    offset = jnp.sum(jnp.where(before, group_sizes, 0))
    return offset, jax.lax.dynamic_slice_in_dim(group_sizes, first_group, groups)


def _experts(arguments: dict[str, Any], shard: Shard) -> tuple[Any, Any]:
    """This device's `(offset, sizes)` in its row block (group sizes already localized)."""
    groups = arguments["group_sizes"].shape[0] // shard.count("g")
    return expert_block(arguments["group_sizes"], shard.index("g") * groups, groups)


def _rows_localized(arguments: dict[str, Any], shard: Shard) -> dict[str, Any]:
    if shard.count("m") == 1:
        return arguments
    rows = arguments["lhs"].shape[0]
    sizes = local_group_sizes(arguments["group_sizes"], shard.index("m") * rows, rows)
    return {**arguments, "group_sizes": sizes}


def _localize(arguments: dict[str, Any], shard: Shard) -> dict[str, Any]:
    arguments = _rows_localized(arguments, shard)
    if shard.count("g") == 1:
        return arguments
    offset, sizes = _experts(arguments, shard)
    rolled = {name: jnp.roll(arguments[name], -offset, axis=0) for name in _ROW_ARGUMENTS
              if arguments.get(name) is not None}
    return {**arguments, **rolled, "group_sizes": sizes}


def _restore(outputs: Any, arguments: dict[str, Any], shard: Shard) -> Any:
    """Rolls the row results of a device's groups back into place."""
    if shard.count("g") == 1:
        return outputs
    offset, _ = _experts(_rows_localized(arguments, shard), shard)
    if isinstance(outputs, dict):  # a VJP call: only the lhs gradient is row-major
        return {**outputs, "lhs": jnp.roll(outputs["lhs"], offset, axis=0)}
    if isinstance(outputs, tuple):  # (out, residuals)
        return (jnp.roll(outputs[0], offset, axis=0), *outputs[1:])
    return jnp.roll(outputs, offset, axis=0)


def partition_rule(ba: BoundArguments) -> PartitionRule:
    rows = Dims(("m", None))
    if ba.arguments["variant"] == "drhs":
        rhs, out = rows, Dims((None, None, None), summed=("m",))
    else:
        rhs, out = Dims(("g", None, None)), Dims(("m", None), summed=("g",))
    return PartitionRule(
        arguments={"lhs": rows, "rhs": rhs, "group_sizes": Dims((None,))},
        out=out, order=("m",), localize=_localize, restore=_restore,
    )
