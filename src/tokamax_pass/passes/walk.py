"""What the pass's walk over a jaxpr needs to know about equations: which hold op calls
(at any depth), how a sub-jaxpr is named in a plan's path, and how a function is traced
with every op call a plain `tokamax_call`. Both `emit` (evaluating a jaxpr) and `rewrite`
(rewriting one in place) use it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import Jaxpr, jaxprs_in_params

from tokamax_pass.core import sharding
from tokamax_pass.core.primitive import is_tokamax_call

# Primitives whose sub-jaxprs are kernel bodies, never holding op calls.
OPAQUE = frozenset({"pallas_call", "core_map"})
# Primitives whose rules hold op calls traced only when called.
_RULES = frozenset({"custom_vjp_call", "custom_jvp_call"})


def _holds(jaxpr: Jaxpr, found: Callable[[Any], bool]) -> bool:
    """Whether an equation of `jaxpr` (at any depth, kernel bodies aside) is `found`."""
    return any(found(eqn) or (eqn.primitive.name not in OPAQUE
                              and any(_holds(j, found) for j in jaxprs_in_params(eqn.params)))
               for eqn in jaxpr.eqns)


def holds_calls(jaxpr: Jaxpr, primitives: frozenset[str] = frozenset()) -> bool:
    """Whether `jaxpr` (at any depth) holds an op call, a custom rule that may, or an
    equation of `primitives` (where a plain-JAX pattern starts)."""
    return _holds(jaxpr, lambda eqn: is_tokamax_call(eqn.primitive)
                  or eqn.primitive.name in _RULES or eqn.primitive.name in primitives)


def holds_primitives(jaxpr: Jaxpr, primitives: frozenset[str]) -> bool:
    """Whether `jaxpr` (at any depth, kernel bodies aside) holds an equation of
    `primitives`."""
    return _holds(jaxpr, lambda eqn: eqn.primitive.name in primitives)


def trace_plain(fn: Any, *args: Any) -> Any:
    """`fn(*args)` with every op call bound as a plain `tokamax_call`."""
    with sharding.partitioning(False):
        return fn(*args)


def trace_arguments(fun: Callable[..., Any], args: Any, kwargs: Any
                    ) -> tuple[Any, list[Any], Any]:
    """`fun(*args, **kwargs)` traced plainly to a closed jaxpr of its traced arguments
    (other leaves, such as Python numbers, are seen by `fun` as they are); returns the
    jaxpr, the values it takes and the tree of its outputs."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]

    def flat_fun(*values: Any) -> Any:
        filled = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            filled[i] = value
        call_args, call_kwargs = jax.tree.unflatten(treedef, filled)
        return fun(*call_args, **call_kwargs)

    values = [leaves[i] for i in dynamic]
    jaxpr, out_shape = trace_plain(jax.make_jaxpr(flat_fun, return_shape=True), *values)
    return jaxpr, values, jax.tree.structure(out_shape)


def tracebacks(jaxpr: Jaxpr) -> Iterator[Any]:
    """The tracebacks of `jaxpr`'s equations, at any depth (kernel bodies aside)."""
    for eqn in jaxpr.eqns:
        if eqn.source_info.traceback is not None:
            yield eqn.source_info.traceback
        if eqn.primitive.name not in OPAQUE:
            for sub in jaxprs_in_params(eqn.params):
                yield from tracebacks(sub)


_PATH_NAMES = {"remat2": "checkpoint", "custom_vjp_call": "custom_vjp",
               "custom_jvp_call": "custom_jvp"}


def path_label(eqn: Any) -> str:
    """`scan`, `checkpoint`, `custom_vjp`, `pjit[name]`: a sub-jaxpr's element of a path."""
    kind = _PATH_NAMES.get(eqn.primitive.name, eqn.primitive.name)
    name = eqn.params.get("name")
    if name is None and kind == "custom_jvp":
        name = getattr(eqn.params["call_jaxpr"].debug_info, "func_name", None)
    return f"{kind}[{name}]" if isinstance(name, str) else kind


def is_op_wrapper(eqn: Any) -> bool:
    """The framework's own `custom_vjp` around one op call adds nothing to a path."""
    body = eqn.params.get("call_jaxpr")
    return (eqn.primitive.name == "custom_vjp_call" and isinstance(body, Jaxpr)
            and len(body.eqns) == 1 and is_tokamax_call(body.eqns[0].primitive))
