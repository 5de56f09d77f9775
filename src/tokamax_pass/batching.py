"""`BatchedShapeDtype`: an abstract array that also records the `jax.vmap`s around it.

Upstream Tokamax describes an op's arguments under `jax.vmap` this way: `shape` is the
per-call (unbatched) shape, `vmap_axes` the `(axis, size)` of each `vmap` level from the
outermost in (`None` where the value is broadcast at that level). `standardize_function`
builds the batched program from them, so a benchmark times the batched call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


class BatchedShapeDtype(jax.ShapeDtypeStruct):
    """A `jax.ShapeDtypeStruct` with the `(axis, size)` of each enclosing `vmap` level."""

    __slots__ = ("vmap_axes",)

    def __init__(self, shape: Sequence[int], dtype: Any,
                 vmap_axes: Sequence[tuple[int, int] | None]) -> None:
        super().__init__(tuple(shape), dtype)
        axes = tuple(None if a is None else (int(a[0]), int(a[1])) for a in vmap_axes)
        self.vmap_axes = axes

    @property
    def vmap_shape(self) -> tuple[int, ...]:
        """The shape with every `vmap` axis inserted: the array the batched program takes."""
        shape = list(self.shape)
        for axis_size in reversed(self.vmap_axes):
            if axis_size is not None:
                shape.insert(*axis_size)
        return tuple(shape)

    @property
    def vmap_axis_sizes(self) -> tuple[int | None, ...]:
        return tuple(None if a is None else a[1] for a in self.vmap_axes)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, vmap_axes={self.vmap_axes})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, jax.ShapeDtypeStruct):
            return False
        other_axes = getattr(other, "vmap_axes", ())
        return super().__eq__(other) and self.vmap_axes == other_axes

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.vmap_axes))


def vmap_levels(arrays: Sequence[Any]) -> list[tuple[int | None, ...]]:
    """The `in_axes` of each `vmap` level (outermost first) for these array arguments,
    all `BatchedShapeDtype`s with as many levels, their sizes agreeing per level."""
    if not all(isinstance(a, BatchedShapeDtype) for a in arrays):
        raise ValueError("standardize_function: cannot mix BatchedShapeDtype arguments with "
                         "other arrays; describe every array argument with its vmap axes")
    depths = {len(a.vmap_axes) for a in arrays}
    if len(depths) != 1:
        raise ValueError(f"standardize_function: the BatchedShapeDtype arguments have "
                         f"different numbers of vmap levels ({sorted(depths)})")
    levels = []
    for level in zip(*(a.vmap_axes for a in arrays), strict=True):
        sizes = {a[1] for a in level if a is not None}
        if len(sizes) > 1:
            raise ValueError(f"standardize_function: one vmap level has different sizes "
                             f"{sorted(sizes)} across the BatchedShapeDtype arguments")
        levels.append(tuple(None if a is None else a[0] for a in level))
    return levels
