"""Partition rules: which dims of an op call split over a mesh, and how mesh axes map to them.

A family's `partition_rule` returns a `PartitionRule` of `Dims` (the factor of each dim
of each argument and output); `tokamax_pass.core.sharding` applies it with JAX's
mechanisms. Here: the rule types, and the mapping of mesh axes onto factors, from the
operands' shardings or, where none can be read, from the rule's preference order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

_log = logging.getLogger("tokamax_pass.sharding")
_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Dims:
    """The factor of each dim of one array (`None`: not partitionable, gathered), and the
    factors over which the array is a partial sum (outputs only)."""

    factors: tuple[str | None, ...]
    summed: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PartitionRule:
    """How one op call partitions.

    Attributes:
      arguments: argument name -> `Dims` (or a pytree of them, like the argument);
        arrays left out are replicated.
      out, residuals: `Dims` pytrees like the op's output and residuals.
      order: the factors in preference order (for meshes with no shardings to read);
        a factor left out is split only where an operand's sharding asks for it.
      localize: `(arguments, shard) -> arguments` run on each device's block before
        the call (a ragged dot turns global group sizes into the block's own).
      restore: `(outputs, arguments, shard) -> outputs` run on the call's (structured)
        outputs, before partial sums are summed; `arguments` as before `localize`.
    """

    arguments: Mapping[str, Any]
    out: Any
    residuals: Any = None
    order: tuple[str, ...] = ()
    localize: Callable[[dict[str, Any], Shard], dict[str, Any]] | None = None
    restore: Callable[[Any, dict[str, Any], Shard], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which block of each factor this device holds (inside the per-device function)."""

    axes: Mapping[str, tuple[str, ...]]
    sizes: Mapping[str, int]

    def count(self, factor: str) -> int:
        return math.prod(self.sizes[a] for a in self.axes.get(factor, ()))

    def index(self, factor: str) -> Any:
        axes = self.axes.get(factor, ())
        return jax.lax.axis_index(axes) if axes else 0


def is_dims(value: Any) -> bool:
    return value is None or isinstance(value, Dims)


def by_path(tree: Any) -> dict[str, Dims]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_dims)[0]
    return {jax.tree_util.keystr(p): d for p, d in leaves if d is not None}


def leaf_dims(tree: Any, rule_tree: Any, ndims: Sequence[int], *,
               none_leaves: bool = True, summed: tuple[str, ...] = ()) -> list[Dims]:
    """`Dims` for each leaf of `tree` (`None`s count as leaves if `none_leaves`, as in
    `OpCall`'s flattening of the arguments)."""
    rule = by_path(rule_tree)
    is_leaf = (lambda v: v is None) if none_leaves else None
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    dims = [rule.get(jax.tree_util.keystr(p)) for p, _ in paths]
    return [d if d is not None and len(d.factors) == n else Dims((None,) * n, summed)
            for d, n in zip(dims, ndims, strict=True)]


def every_factor(arguments: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(sorted({f for d in by_path(arguments).values() for f in d.factors
                         if f is not None}))


def gradient_dims(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """An argument's gradient splits like the argument and is a partial sum over every
    factor the argument does not carry (each block of that factor used all of it)."""
    every = set(every_factor(arguments))

    def grad(d: Dims | None) -> Dims | None:
        if d is None:
            return None
        return Dims(d.factors, tuple(sorted(every - set(d.factors))))

    return {k: jax.tree.map(grad, v, is_leaf=is_dims) for k, v in arguments.items()}


# --- which mesh axes each factor gets ---------------------------------------------------------

def _factor_sizes(shapes: Sequence[Sequence[int]], dims: Sequence[Dims]) -> dict[str, list[int]]:
    sizes: dict[str, list[int]] = {}
    for shape, d in zip(shapes, dims, strict=True):
        for size, factor in zip(shape, d.factors, strict=True):
            if factor is not None:
                sizes.setdefault(factor, []).append(size)
    return sizes


def _divides(count: int, sizes: Sequence[int]) -> bool:
    return all(s % count == 0 for s in sizes)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def assignment_from_specs(specs: Sequence[PartitionSpec | None], shapes: Sequence[Sequence[int]],
                          dims: Sequence[Dims], mesh_sizes: Mapping[str, int],
                          what: str) -> dict[str, tuple[str, ...]]:
    """Factor -> mesh axes read from the operands' shardings (first operand wins).

    A sharded dim whose factor is `None`, cannot take those axes, or disagrees with
    an earlier operand is gathered; a one-time warning names it.
    """
    sizes = _factor_sizes(shapes, dims)
    assignment: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    dropped = []
    for index, (spec, shape, d) in enumerate(zip(specs, shapes, dims, strict=True)):
        entries = tuple(spec or ()) + (None,) * (len(shape) - len(tuple(spec or ())))
        for dim, (entry, factor) in enumerate(zip(entries, d.factors, strict=True)):
            axes = _spec_axes(entry)
            if not axes:
                continue
            if factor in assignment and assignment[factor] == axes:
                continue
            count = math.prod(mesh_sizes[a] for a in axes)
            if (factor is None or factor in assignment or used & set(axes)
                    or not _divides(count, sizes[factor])):
                dropped.append(f"operand {index} dim {dim} ({'/'.join(axes)})")
                continue
            assignment[factor] = axes
            used |= set(axes)
    if dropped:
        message = (f"{what}: cannot partition {', '.join(dropped)} without communication; "
                   "gathering them (see docs/optimize.md, 'More than one device')")
        warn_once(message, message)
    return assignment


def assignment_by_order(order: Sequence[str], shapes: Sequence[Sequence[int]],
                        dims: Sequence[Dims], mesh_sizes: Mapping[str, int]
                        ) -> dict[str, tuple[str, ...]]:
    """Factor -> mesh axes when no sharding is visible: mesh axis i goes to factor i of
    `order`, else to the first one that it still divides; otherwise it is unused."""
    sizes = _factor_sizes(shapes, dims)
    factors = [f for f in order if f in sizes]
    assignment: dict[str, tuple[str, ...]] = {}
    for i, (axis, size) in enumerate(mesh_sizes.items()):
        if size == 1:
            continue
        preferred = factors[i:i + 1] + factors
        for factor in preferred:
            axes = (*assignment.get(factor, ()), axis)
            if _divides(math.prod(mesh_sizes[a] for a in axes), sizes[factor]):
                assignment[factor] = axes
                break
    return assignment


def spec_for(d: Dims, assignment: Mapping[str, tuple[str, ...]]) -> PartitionSpec:
    entries = []
    for factor in d.factors:
        axes = assignment.get(factor, ()) if factor is not None else ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _log.warning(message)


# --- the per-device function -----------------------------------------------------------------
