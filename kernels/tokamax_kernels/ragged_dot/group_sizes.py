"""Group sizes with a representative distribution, as upstream Tokamax's
`RaggedDotGroupSizes` and `generate_ragged_dot_group_sizes`.

A ragged dot's speed depends on how its rows spread over the groups, which is only known
at run time. `RaggedDotGroupSizes` carries the run-time sizes (`value`) together with a
representative spread: an abstract `value` (a `jax.ShapeDtypeStruct`, as a benchmark or
tuning describes its inputs) takes the representative sizes as its values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def generate_group_sizes(*, m: int, num_groups: int, p: Sequence[float] | None = None,
                         seed: int = 0) -> tuple[int, ...]:
    """`m` rows spread over `num_groups` groups at random: group `i` expects `p[i] * m`
    rows (uniform `p` by default). Skewed spreads tune kernels more realistically than
    evenly split ones."""
    if not isinstance(m, int) or m < 0:
        raise ValueError(f"generate_ragged_dot_group_sizes: m must be an int >= 0, got {m!r}")
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"generate_ragged_dot_group_sizes: num_groups must be an int >= 1, "
                         f"got {num_groups!r}")
    probabilities = np.full(num_groups, 1 / num_groups) if p is None else np.asarray(p, float)
    if probabilities.shape != (num_groups,):
        raise ValueError(f"generate_ragged_dot_group_sizes: p must have num_groups="
                         f"{num_groups} entries, got {len(probabilities)}")
    counts = np.random.default_rng(seed).multinomial(m, probabilities)
    return tuple(int(c) for c in counts)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, init=False)
class RaggedDotGroupSizes:
    """Group sizes (`value`, shape `(num_groups,)`, integers) with a representative
    spread: a sequence of sizes, or their total (then spread evenly at random by
    `generate_group_sizes`). A pytree: `value` is its leaf."""

    value: Any
    repr_value_or_total_size: tuple[int, ...] | int

    def __init__(self, value: Any, repr_value_or_total_size: Sequence[int] | int) -> None:
        if not np.issubdtype(value.dtype, np.integer):
            raise ValueError(f"RaggedDotGroupSizes: group sizes must be integers, got "
                             f"{value.dtype}")
        if len(value.shape) != 1:
            raise ValueError(f"RaggedDotGroupSizes: group sizes must have shape "
                             f"(num_groups,), got {tuple(value.shape)}")
        (num_groups,) = value.shape
        representative = repr_value_or_total_size
        if not isinstance(representative, int):
            representative = tuple(int(s) for s in representative)
            if len(representative) != num_groups:
                raise ValueError(f"RaggedDotGroupSizes: {len(representative)} representative "
                                 f"sizes for {num_groups} groups")
        if isinstance(value, jax.ShapeDtypeStruct):
            sizes = (generate_group_sizes(m=representative, num_groups=num_groups)
                     if isinstance(representative, int) else representative)
            value = np.asarray(sizes, value.dtype)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "repr_value_or_total_size", representative)

    def tree_flatten(self) -> tuple[tuple[Any], tuple[int, ...] | int]:
        return (self.value,), self.repr_value_or_total_size

    @classmethod
    def tree_unflatten(cls, representative: tuple[int, ...] | int,
                       children: tuple[Any]) -> RaggedDotGroupSizes:
        # Not through `__init__`: transformations unflatten with placeholder leaves.
        new = object.__new__(cls)
        object.__setattr__(new, "value", children[0])
        object.__setattr__(new, "repr_value_or_total_size", representative)
        return new

    @property
    def representative_value(self) -> tuple[int, ...]:
        representative = self.repr_value_or_total_size
        if isinstance(representative, int):
            return generate_group_sizes(m=representative, num_groups=self.value.shape[0])
        return representative
