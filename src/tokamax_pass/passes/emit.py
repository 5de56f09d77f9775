"""Re-emits a jaxpr traced with partitioning off, each op call bound through the pass.

`optimize` traces the user's function under `sharding.partitioning(False)`, so every
op call is a plain `tokamax_call` equation (not hidden in a `custom_partitioning`
whose per-device call is only built at compile time). Evaluating that jaxpr here,
in the trace of a `jax.jit`, binds each call through `Rewriter.bind_call`:
partitioned per device as `sharding.bind` decides (each device's call resolved for
the shapes it sees), or bound as is. Sub-jaxprs holding op calls (`jit`, `scan`,
`cond`, `while`, `remat`, `custom_vjp`/`custom_jvp`) are traced again the same way;
`custom_vjp`/`custom_jvp` rules traced later are wrapped to be re-emitted too.
`shard_map` bodies are already per device. One whose body holds the first primitive of a
selected plain-JAX pattern (`dot_general`, arithmetic: most bodies; a `shard_map`
function made before `optimize`, which `transforms` does not see, among them) is mapped
again with its body re-emitted, each device's matches and calls decided for the shapes
it sees; other bodies are rewritten in place. A body's patterns read the constants its
equation passes it as operands (what a `lax.scan` or `jax.checkpoint` body closes over:
a mask made with NumPy) as the constants they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
from jax._src import source_info_util
from jax._src.ad_util import Zero  # the symbolic zero a custom_vjp backward may return
from jax._src.interpreters import partial_eval as pe
from jax.custom_derivatives import SymbolicZero
from jax.extend import linear_util as lu
from jax.extend.core import Jaxpr, Literal

from tokamax_pass.core.primitive import is_tokamax_call
from tokamax_pass.passes.graph import Graph
from tokamax_pass.passes.walk import (
    OPAQUE,
    holds_calls,
    holds_primitives,
    is_op_wrapper,
    path_label,
    trace_plain,
)


class Binder(Protocol):
    """What evaluating a jaxpr needs from the pass (`rewrite.Rewriter` is one)."""

    pattern_primitives: frozenset[str]

    def bind_call(self, call: Any, operands: Sequence[Any], path: str) -> list[Any]: ...

    def bind_pattern(self, eqn: Any, read: Callable[[Any], Any], path: str,
                     graph: Graph | None) -> list[Any] | None: ...

    def rewrite_eqn(self, eqn: Any, path: str) -> Any: ...


def emit(rewriter: Binder, jaxpr: Jaxpr, args: Sequence[Any], path: str = "",
         known: dict[int, Any] | None = None) -> list[Any]:
    """Evaluates `jaxpr` on `args` in the current trace, op calls bound by `rewriter`;
    `known`: the values, known while tracing, of inputs (by position) that the caller
    passes constants to (patterns read them as the jaxpr's own constants)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for var, value in zip(jaxpr.all_invars, [*jaxpr.consts, *args], strict=True):
        env[var] = value
    graph = None
    if rewriter.pattern_primitives:
        graph = Graph(jaxpr, {jaxpr.invars[i]: v for i, v in (known or {}).items()})
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
              eqn.ctx.manager):
            if is_tokamax_call(eqn.primitive):
                outs = rewriter.bind_call(eqn.params["call"], invals, path)
            elif (replaced := rewriter.bind_pattern(
                    eqn if graph is None else graph.view(eqn), read, path, graph)) is not None:
                outs = replaced
            elif (mapped := _shard_map(rewriter, eqn, invals, path)) is not None:
                outs = mapped
            else:
                params = _params(rewriter, eqn, path, _known_operands(eqn, graph))
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def retrace(rewriter: Binder, jaxpr: Jaxpr, path: str, known: dict[int, Any] | None = None
            ) -> Jaxpr:
    """`jaxpr` traced again with its op calls re-emitted (the same object if it holds
    none); `known`: as `emit` takes it."""
    if not holds_calls(jaxpr, rewriter.pattern_primitives):
        return jaxpr

    def fn(*args: Any) -> list[Any]:
        return emit(rewriter, jaxpr, args, path, known)

    new, _, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(fn, debug_info=jaxpr.debug_info), jaxpr.in_avals)
    return new.with_consts(consts) if consts else new


def _shard_map(rewriter: Binder, eqn: Any, args: Sequence[Any], path: str
               ) -> list[Any] | None:
    """The outputs of a `shard_map` equation whose body holds a pattern's first
    primitive, mapped again over the same mesh and specs with the body re-emitted (inside
    the map, so each device's matches and op calls see its own shapes); `None` for other
    equations."""
    if eqn.primitive.name != "shard_map" or not holds_primitives(
            eqn.params["jaxpr"], rewriter.pattern_primitives):
        return None
    params = eqn.params
    body = params["jaxpr"]
    sub = "/".join(p for p in (path, path_label(eqn)) if p)

    def per_device(*xs: Any) -> tuple[Any, ...]:
        return tuple(emit(rewriter, body, xs, sub))

    mapped = jax.shard_map(per_device, mesh=params["mesh"], in_specs=params["in_specs"],
                           out_specs=params["out_specs"], check_vma=params["check_vma"],
                           axis_names=params["newly_manual_axes"])
    return list(mapped(*args))


# Primitives whose body takes the equation's operands as its inputs, each unchanged: all
# of them, or (`scan`) the first `num_consts`, the constants its body closes over.
_OPERANDS_PASSED = frozenset({"jit", "pjit", "remat2", "checkpoint"})


def _known_operands(eqn: Any, graph: Graph | None) -> dict[int, Any]:
    """The values known while tracing (constants of the jaxpr: a mask made with NumPy)
    of the operands `eqn` passes its body unchanged, by position: so a constant a
    `lax.scan` or `jax.checkpoint` body closes over, which it receives as an operand,
    reads as the constant it is."""
    name = eqn.primitive.name
    if graph is None or (name != "scan" and name not in _OPERANDS_PASSED):
        return {}
    passed = eqn.invars[:_scan_constants(eqn.params)] if name == "scan" else eqn.invars
    values = {i: graph.held_constant(var) for i, var in enumerate(passed)}
    return {i: value for i, value in values.items() if value is not None}


def _scan_constants(params: dict[str, Any]) -> int:
    """How many of a `scan`'s operands are the constants its body closes over: its
    `num_consts`, or the leaves of the first of its `ft_in` groups (constants, carry,
    scanned); none where neither reads so."""
    if "num_consts" in params:
        return int(params["num_consts"])
    try:
        return len(list(params["ft_in"].unpack()[0]))
    except (AttributeError, IndexError, KeyError, TypeError):
        return 0


def _params(rewriter: Binder, eqn: Any, path: str, known: dict[int, Any] | None = None
            ) -> dict[str, Any]:
    if eqn.primitive.name in OPAQUE:
        return eqn.params
    if eqn.primitive.name == "shard_map":  # already per device: rewrite in place
        return rewriter.rewrite_eqn(eqn, path).params
    sub = path if is_op_wrapper(eqn) else "/".join(p for p in (path, path_label(eqn)) if p)
    return {name: _param(rewriter, name, value, sub, known)
            for name, value in eqn.params.items()}


def _param(rewriter: Binder, name: str, value: Any, path: str,
           known: dict[int, Any] | None = None) -> Any:
    if isinstance(value, Jaxpr):
        return retrace(rewriter, value, path, known)
    if isinstance(value, tuple) and value and all(isinstance(v, Jaxpr) for v in value):
        return tuple(retrace(rewriter, v, f"{path}/{name}{i}") for i, v in enumerate(value))
    if isinstance(value, lu.WrappedFun):
        if name in ("fwd_jaxpr_thunk", "jvp_jaxpr_fun"):
            return wrap_thunk(rewriter, value, path)
        if name == "bwd":
            return wrap_bwd(rewriter, value, path)
    return value


def wrap_thunk(rewriter: Binder, thunk: lu.WrappedFun, path: str) -> lu.WrappedFun:
    """A custom_vjp forward / custom_jvp rule thunk whose jaxpr comes back re-emitted."""

    def emitted_thunk(*args: Any) -> Any:
        jaxpr, consts, *rest = trace_plain(thunk.call_wrapped, *args)
        new = retrace(rewriter, jaxpr.with_consts(consts) if consts else jaxpr, path)
        return (new, new.consts, *rest)

    return lu.wrap_init(emitted_thunk, debug_info=thunk.debug_info)


def wrap_bwd(rewriter: Binder, bwd: lu.WrappedFun, path: str) -> lu.WrappedFun:
    """A custom_vjp backward traced with partitioning off, then re-emitted. Symbolic zero
    cotangents (`symbolic_zeros=True` rules) reach it as they are, not as arrays."""

    def emitted_bwd(*args: Any) -> Any:
        zeros: dict[int, Any] = {}
        symbolic = {i: a for i, a in enumerate(args) if isinstance(a, SymbolicZero)}
        arrays = [a for i, a in enumerate(args) if i not in symbolic]

        def traced(*inner: Any) -> Any:
            given = iter(inner)
            cts, logs = bwd.call_wrapped(*(symbolic[i] if i in symbolic else next(given)
                                           for i in range(len(args))))
            zeros.update((i, ct) for i, ct in enumerate(cts) if isinstance(ct, Zero))
            return [ct for ct in cts if not isinstance(ct, Zero)], logs

        closed, shapes = trace_plain(jax.make_jaxpr(traced, return_shape=True), *arrays)
        flat = emit(rewriter, closed, arrays, path)
        nonzero, logs = jax.tree.unflatten(jax.tree.structure(shapes), flat)
        nonzero = iter(nonzero)
        count = len(zeros) + len(shapes[0])
        return [zeros[i] if i in zeros else next(nonzero) for i in range(count)], logs

    return lu.wrap_init(emitted_bwd, debug_info=bwd.debug_info)
