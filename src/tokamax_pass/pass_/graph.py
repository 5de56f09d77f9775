"""`Graph`: who produces and who uses each variable of one jaxpr, for patterns that span
several equations (a region ending at the equation where the pattern is matched)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
from jax.extend.core import Jaxpr, Literal

# Equations that only move or repeat values: a pattern looks through them where it says so.
SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape"})


class Graph:
    """The producers and users of every variable of `jaxpr` (its top level)."""

    def __init__(self, jaxpr: Jaxpr) -> None:
        self._producers: dict[Any, Any] = {}
        self._users: dict[Any, list[Any]] = defaultdict(list)
        for eqn in jaxpr.eqns:
            for var in eqn.invars:
                if not isinstance(var, Literal):
                    self._users[var].append(eqn)
            for var in eqn.outvars:
                self._producers[var] = eqn
        self._outputs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}

    def producer(self, var: Any, *primitives: str) -> Any:
        """The equation making `var`, if it is one of `primitives` (any, if none given)."""
        if isinstance(var, Literal):
            return None
        eqn = self._producers.get(var)
        if eqn is None or (primitives and eqn.primitive.name not in primitives):
            return None
        return eqn

    def users(self, var: Any) -> list[Any]:
        return [] if isinstance(var, Literal) else self._users.get(var, [])

    def private(self, interior: Iterable[Any], root: Any) -> bool:
        """Whether every value `interior` makes is used only by `interior` and `root`,
        the region's last equation (so computing `root` otherwise drops them all)."""
        interior = list(interior)
        inside = {id(eqn) for eqn in interior} | {id(root)}
        for eqn in interior:
            for var in eqn.outvars:
                if var in self._outputs:
                    return False
                if any(id(user) not in inside for user in self.users(var)):
                    return False
        return True


def literal_value(var: Any) -> Any:
    """The Python value of a literal or scalar constant variable, else `None`."""
    if isinstance(var, Literal):
        return var.val
    return None


def same_value(graph: Graph, a: Any, b: Any, depth: int = 8) -> bool:
    """Whether `a` and `b` are one variable, or made by equal equations of equal inputs
    (`x - mean` spelled twice)."""
    if a is b:
        return True
    if isinstance(a, Literal) or isinstance(b, Literal):
        return (isinstance(a, Literal) and isinstance(b, Literal) and a.aval == b.aval
                and bool(np.all(np.asarray(a.val) == np.asarray(b.val))))
    ea, eb = graph.producer(a), graph.producer(b)
    if depth == 0 or ea is None or eb is None or ea.primitive != eb.primitive:
        return False
    if len(ea.outvars) != 1 or repr(ea.params) != repr(eb.params):
        return False
    return len(ea.invars) == len(eb.invars) and all(
        same_value(graph, x, y, depth - 1) for x, y in zip(ea.invars, eb.invars, strict=True))
