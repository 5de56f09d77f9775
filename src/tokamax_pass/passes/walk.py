"""What the pass's walk over a jaxpr needs to know about equations: which hold op calls
(at any depth), how a sub-jaxpr is named in a plan's path, and how a function is traced
with every op call a plain `tokamax_call`. Both `emit` (evaluating a jaxpr) and `rewrite`
(rewriting one in place) use it."""

from __future__ import annotations

from typing import Any

from jax.extend.core import Jaxpr, jaxprs_in_params

from tokamax_pass.core import sharding
from tokamax_pass.core.primitive import is_tokamax_call

# Primitives whose sub-jaxprs are kernel bodies, never holding op calls.
OPAQUE = frozenset({"pallas_call", "core_map"})
# Primitives whose rules hold op calls traced only when called.
_RULES = frozenset({"custom_vjp_call", "custom_jvp_call"})


def holds_calls(jaxpr: Jaxpr, primitives: frozenset[str] = frozenset()) -> bool:
    """Whether `jaxpr` (at any depth) holds an op call, a custom rule that may, or an
    equation of `primitives` (where a plain-JAX pattern starts)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if is_tokamax_call(eqn.primitive) or name in _RULES or name in primitives:
            return True
        if name not in OPAQUE and any(holds_calls(j, primitives)
                                      for j in jaxprs_in_params(eqn.params)):
            return True
    return False


def trace_plain(fn: Any, *args: Any) -> Any:
    """`fn(*args)` with every op call bound as a plain `tokamax_call`."""
    with sharding.partitioning(False):
        return fn(*args)


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
