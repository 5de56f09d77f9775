"""`Graph`: who produces and who uses each variable of one jaxpr, for patterns that span
several equations (a region ending at the equation where the pattern is matched)."""

from __future__ import annotations

import contextvars
import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import linear_util as lu
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

# Equations that only move or repeat values: a pattern looks through them where it says so.
SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape"})


# Equations that cast a value to another type of the same values (`pvary`: varying over
# `shard_map` mesh axes, as `jnp` inserts under `check_vma`): patterns read through them.
_SAME_VALUES = frozenset({"pvary"})


class Graph:
    """The producers and users of every variable of `jaxpr` (its top level), read through
    `_SAME_VALUES` casts: `view(eqn)` is the equation as patterns see it."""

    def __init__(self, jaxpr: Jaxpr, known: dict[Any, Any] | None = None) -> None:
        """`known`: values of inputs of `jaxpr` known while tracing (constants its caller
        passes it), read as its own constants are."""
        self._producers: dict[Any, Any] = {}
        self._users: dict[Any, list[Any]] = defaultdict(list)
        given = [*zip(jaxpr.constvars, getattr(jaxpr, "consts", None) or (), strict=False),
                 *(known or {}).items()]
        self._constants = {var: value for var, value in given
                           if not isinstance(value, jax.core.Tracer)}
        self._views: dict[int, Any] = {}
        eqns = self._read_through_casts(jaxpr.eqns)
        self._outputs = {v for v in map(self.source, jaxpr.outvars)
                         if not isinstance(v, Literal)}  # a cast literal reads as one
        self._live_ids = live = self._live(eqns)
        for eqn in eqns:
            for var in eqn.invars:
                if not isinstance(var, Literal) and id(eqn) in live:  # a dead use is none
                    self._users[var].append(eqn)
            for var in eqn.outvars:
                self._producers[var] = eqn

    def _read_through_casts(self, eqns: list[Any]) -> list[Any]:
        """`eqns` with each use of a `_SAME_VALUES` cast's result reading its operand
        instead (the casts themselves then dead); `_views` maps the ids of the changed
        equations to their replacements."""
        self._source: dict[Any, Any] = {}
        viewed = []
        for eqn in eqns:
            invars = [self._source.get(v, v) if not isinstance(v, Literal) else v
                      for v in eqn.invars]
            view = eqn
            if any(a is not b for a, b in zip(invars, eqn.invars, strict=True)):
                view = self._views[id(eqn)] = eqn.replace(invars=invars)
            if view.primitive.name in _SAME_VALUES:
                self._source.update(zip(view.outvars, view.invars, strict=True))
            viewed.append(view)
        return viewed

    def view(self, eqn: Any) -> Any:
        """`eqn` as patterns see it: reading through casts that keep values."""
        return self._views.get(id(eqn), eqn)

    def source(self, var: Any) -> Any:
        """`var` read through casts that keep values: the operand of the `_SAME_VALUES`
        cast making it, else `var` itself."""
        return var if isinstance(var, Literal) else self._source.get(var, var)

    def _live(self, eqns: list[Any]) -> set[int]:
        """The ids of the equations whose results reach an output or an effect (`jnp`
        functions leave dead ones, such as `logsumexp`'s unused `sign`)."""
        needed = set(self._outputs)
        live: set[int] = set()
        for eqn in reversed(eqns):
            if eqn.effects or any(v in needed for v in eqn.outvars):
                live.add(id(eqn))
                needed.update(v for v in eqn.invars if not isinstance(v, Literal))
        return live

    def live(self, eqn: Any) -> bool:
        """Whether `eqn`'s results are needed (a dead region is not worth a match)."""
        return id(eqn) in self._live_ids

    def producer(self, var: Any, *primitives: str) -> Any:
        """The equation making `var`, if it is one of `primitives` (any, if none given)."""
        if isinstance(var, Literal):
            return None
        eqn = self._producers.get(var)
        if eqn is None or (primitives and eqn.primitive.name not in primitives):
            return None
        return eqn

    def constant(self, var: Any) -> np.ndarray | None:
        """The value of a constant of the jaxpr known while tracing (an array the function
        closes over: a mask made with NumPy, a buffer computed before), else `None`."""
        value = self.held_constant(var)
        return None if value is None else np.asarray(value)

    def held_constant(self, var: Any) -> Any:
        """`constant(var)` as the jaxpr holds it, not copied to the host (a device array
        stays where it is), else `None`."""
        return None if isinstance(var, Literal) else self._constants.get(var)

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


def dense_matmul(graph: Graph, var: Any, *, transposed: bool = False) -> Any:
    """The `x @ w` equation making `var` (`x`'s last axis against the first of a `(K, N)`
    floating `w`, no batch axes, `x` floating too), or `None`. With `transposed`, the
    `x @ w.T` equation of an `(N, K)` `w` contracted on its last axis instead (a tied
    embedding's logits, `jnp.einsum("btd,vd->btv", x, embedding)`)."""
    eqn = graph.producer(var, "dot_general")
    if eqn is None:
        return None
    x, w = eqn.invars
    rank = len(x.aval.shape)
    if len(w.aval.shape) != 2 or rank < 1:
        return None
    if eqn.params["dimension_numbers"] != (((rank - 1,), (1 if transposed else 0,)),
                                           ((), ())):
        return None
    if not all(jnp.issubdtype(a.aval.dtype, jnp.floating) for a in (x, w)):
        return None
    return eqn


def rounds(source: Any, target: Any) -> bool:
    """Whether a value of the type `source` may change in `target`: another float type
    not wider, or any other type where either is not a float."""
    source, target = jnp.dtype(source), jnp.dtype(target)
    if not (jnp.issubdtype(source, jnp.floating) and jnp.issubdtype(target, jnp.floating)):
        return target != source
    return target != source and jnp.finfo(target).bits <= jnp.finfo(source).bits


def literal_value(var: Any) -> Any:
    """The Python value of a literal (a constant written into the jaxpr), else `None`."""
    if isinstance(var, Literal):
        return var.val
    return None


# Scalar arithmetic a constant is spelled with (`1 / jnp.sqrt(64.0)`, `jnp.sqrt(d)
# .astype(x.dtype)`), which tracing keeps as equations on literals.
_FOLDED = frozenset({"add", "sub", "mul", "div", "neg", "sqrt", "rsqrt", "integer_pow",
                     "pow", "exp", "log", "max", "min", "convert_element_type"})


def scalar_constant(graph: Graph, var: Any, depth: int = 6) -> Any:
    """The value of a scalar made from literals alone by `_FOLDED` arithmetic, computed
    here (a literal's own value included), else `None`."""
    if isinstance(var, Literal):
        return var.val
    eqn = graph.producer(var)
    if (depth == 0 or eqn is None or tuple(var.aval.shape) != ()
            or eqn.primitive.name not in _FOLDED or len(eqn.outvars) != 1):
        return None
    operands = [scalar_constant(graph, v, depth - 1) for v in eqn.invars]
    if any(value is None for value in operands):
        return None
    with jax.ensure_compile_time_eval():  # a value now, not an equation of the trace
        return np.asarray(eqn.primitive.bind(*operands, **eqn.params)).item()


# How many equations deep `same_value` compares: a norm with float32 statistics cast
# back to bfloat16 is a dozen.
SAME_VALUE_DEPTH = 32


def same_value(graph: Graph, a: Any, b: Any) -> bool:
    """Whether `a` and `b` are one variable, or made by equal equations of equal inputs
    (`x - mean` spelled twice; a norm computed again for each of two products), through
    at most `SAME_VALUE_DEPTH` equations. Equations with effects make no equal values."""
    return _same_value(graph, a, b, SAME_VALUE_DEPTH, {})


def _same_value(graph: Graph, a: Any, b: Any, depth: int,
                compared: dict[tuple[int, int], bool]) -> bool:
    if a is b:
        return True
    if isinstance(a, Literal) or isinstance(b, Literal):
        return (isinstance(a, Literal) and isinstance(b, Literal) and a.aval == b.aval
                and bool(np.all(np.asarray(a.val) == np.asarray(b.val))))
    key = (id(a), id(b))
    if key not in compared:
        compared[key] = _same_equation(graph, a, b, depth, compared)
    return compared[key]


def _same_equation(graph: Graph, a: Any, b: Any, depth: int,
                   compared: dict[tuple[int, int], bool]) -> bool:
    ea, eb = graph.producer(a), graph.producer(b)
    if depth == 0 or ea is None or eb is None or ea.primitive != eb.primitive:
        return False
    if len(ea.outvars) != 1 or ea.effects or eb.effects or not _same_params(ea, eb):
        return False
    return len(ea.invars) == len(eb.invars) and all(
        _same_value(graph, x, y, depth - 1, compared)
        for x, y in zip(ea.invars, eb.invars, strict=True))


def _same_params(ea: Any, eb: Any) -> bool:
    """Whether two equations of one primitive take the same parameters. Their printed
    forms leave out what a body closes over and what a function does: the constants and
    literals of bodies (a `jax.jit` function closing over an array) are compared by
    value, a `custom_jvp` call's rule by its traced JVP (`_same_rules`), and any other
    function must be one object."""
    if repr(ea.params) != repr(eb.params):
        return False
    if ea.primitive.name in _CUSTOM_DERIVATIVES and not _same_rules(ea, eb):
        return False
    rules_compared = ea.primitive.name in _CUSTOM_DERIVATIVES
    return all(_same_param(ea.params[name], eb.params[name], rules_compared)
               for name in ea.params)


def _same_param(a: Any, b: Any, rules_compared: bool) -> bool:
    """Whether two parameter values that print alike are alike (`_same_params`)."""
    if isinstance(a, Jaxpr | ClosedJaxpr) and isinstance(b, Jaxpr | ClosedJaxpr):
        (jaxpr_a, consts_a), (jaxpr_b, consts_b) = _opened(a), _opened(b)
        return (len(consts_a) == len(consts_b) and len(jaxpr_a.eqns) == len(jaxpr_b.eqns)
                and all(_same_array(x, y) for x, y in zip(consts_a, consts_b, strict=True))
                and all(_same_body_equation(x, y)
                        for x, y in zip(jaxpr_a.eqns, jaxpr_b.eqns, strict=True)))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_param(x, y, rules_compared)
                                        for x, y in zip(a, b, strict=True))
    if isinstance(a, lu.WrappedFun) or callable(a):
        return rules_compared or a is b
    return True


def _same_body_equation(ea: Any, eb: Any) -> bool:
    """Whether two equations at one place of two bodies that print alike compute alike:
    their literals equal, their parameters alike (`_same_params`)."""
    return all(not isinstance(x, Literal) or _same_array(x.val, y.val)
               for x, y in zip(ea.invars, eb.invars, strict=True)) and _same_params(ea, eb)


def _same_array(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.all(a == b))


def _recomputed(graph: Graph, a: Any, b: Any) -> list[Any]:
    """The equations computing `b` again where `same_value(graph, a, b)`: those of its
    producers down to the variables it shares with `a`, each once."""
    found: dict[int, Any] = {}
    pending = [(a, b)]
    while pending:
        a, b = pending.pop()
        if a is b or isinstance(b, Literal):
            continue
        ea, eb = graph.producer(a), graph.producer(b)
        if id(eb) not in found:
            found[id(eb)] = eb
            pending.extend(zip(ea.invars, eb.invars, strict=True))
    return list(found.values())


def soft_capped(graph: Graph, var: Any) -> tuple[Any, float, list[Any]] | None:
    """`(logits, cap, equations)` where `var` is `cap * tanh(logits / cap)` (Gemma 2's
    soft cap, `cap` a number), else `None`."""
    outer = graph.producer(var, "mul")
    if outer is None:
        return None
    for tanh_out, cap in (outer.invars, outer.invars[::-1]):
        cap_value = literal_value(cap)
        tanh = graph.producer(tanh_out, "tanh")
        if cap_value is None or tanh is None:
            continue
        inner = graph.producer(tanh.invars[0], "div")
        if inner is None or literal_value(inner.invars[1]) != cap_value:
            continue
        return inner.invars[0], float(cap_value), [outer, tanh, inner]
    return None


def reference_jaxpr(spelling: Callable[..., Any],
                    *avals: tuple[tuple[int, ...], Any]) -> Jaxpr:
    """The jaxpr of a pattern's reference spelling on `(shape, dtype)` operands, which
    `same_structure` compares a user's equations with. Traced once per abstract mesh in
    effect: a target's mesh (`core.targeting`) changes what tracing records in the
    equations, so a jaxpr traced under another would not compare equal."""
    return _traced(spelling, avals, jax.sharding.get_abstract_mesh())


@functools.lru_cache(maxsize=1024)
def _traced(spelling: Callable[..., Any], avals: tuple[tuple[tuple[int, ...], Any], ...],
            mesh: Any) -> Jaxpr:
    del mesh  # the cache key: the mesh in effect is the one traced under
    return jax.make_jaxpr(spelling)(*(jax.ShapeDtypeStruct(*aval) for aval in avals)).jaxpr


def same_structure(graph: Graph, var: Any, reference: Jaxpr, ref_var: Any,
                   bound: dict[Any, Any], region: list[Any]) -> bool:
    """Whether `var` is computed as `reference` (a jaxpr traced from a known spelling)
    computes `ref_var`, each input of `reference` bound to one variable of `graph`
    (recorded in `bound`; an input used twice may be two variables of one value,
    `h[..., 0]` sliced twice); the equations are added to `region`. Casts that keep
    values are read through, in `graph` and in the bodies of calls (`same_function`)."""
    if isinstance(ref_var, Literal):
        value = literal_value(var)
        return value is not None and var.aval == ref_var.aval and bool(
            np.all(np.asarray(value) == np.asarray(ref_var.val)))
    var = graph.source(var)
    if ref_var in bound:  # an input the spelling reads twice, the user's maybe written twice
        if not same_value(graph, bound[ref_var], var):
            return False
        region.extend(_recomputed(graph, bound[ref_var], var))
        return True
    if ref_var in reference.invars:
        if isinstance(var, Literal):
            return False
        bound[ref_var] = var
        return True
    ref_eqn = next((e for e in reference.eqns if any(o is ref_var for o in e.outvars)), None)
    eqn = graph.producer(var)
    if ref_eqn is None or eqn is None or eqn.primitive != ref_eqn.primitive:
        return False
    if len(eqn.outvars) != len(ref_eqn.outvars) or len(eqn.invars) != len(ref_eqn.invars):
        return False
    if [o is var for o in eqn.outvars] != [o is ref_var for o in ref_eqn.outvars]:
        return False
    if _params_key(eqn.params) != _params_key(ref_eqn.params):
        return False
    if not _same_rules(eqn, ref_eqn):
        return False
    if not all(same_function(eqn.params[name], ref_eqn.params[name])
               for name in _bodies(ref_eqn.params)):
        return False
    region.append(eqn)
    return all(same_structure(graph, a, reference, b, bound, region)
               for a, b in zip(eqn.invars, ref_eqn.invars, strict=True))


def same_function(body: Jaxpr | ClosedJaxpr, reference: Jaxpr | ClosedJaxpr) -> bool:
    """Whether `body` (a call's jaxpr, as `jit` holds one) computes each of its outputs
    from its inputs (in order) as `reference` does, compared by `same_structure`: so a
    body of a `shard_map` under `check_vma`, whose `pvary` casts mark literals varying
    over the mesh axes, is the body of the same call outside it. Without effects."""
    jaxpr, consts = _opened(body)
    ref_jaxpr, ref_consts = _opened(reference)
    if jaxpr.effects or ref_jaxpr.effects:
        return False
    inputs, ref_inputs = [*jaxpr.constvars, *jaxpr.invars], [*ref_jaxpr.constvars,
                                                             *ref_jaxpr.invars]
    if ([_shape_dtype(v) for v in (*inputs, *jaxpr.outvars)]
            != [_shape_dtype(v) for v in (*ref_inputs, *ref_jaxpr.outvars)]
            or len(jaxpr.constvars) != len(ref_jaxpr.constvars)):
        return False
    if not all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(consts, ref_consts, strict=True)):
        return False
    graph = Graph(jaxpr)
    bound = dict(zip(ref_inputs, inputs, strict=True))
    return all(same_structure(graph, out, ref_jaxpr, ref_out, bound, [])
               for out, ref_out in zip(jaxpr.outvars, ref_jaxpr.outvars, strict=True))


_CUSTOM_DERIVATIVES = frozenset({"custom_jvp_call", "custom_vjp_call"})
# Set while `_same_rules` compares two JVPs: the `custom_jvp` call inside each (its
# primal, already compared) is not compared again.
_IN_RULES: contextvars.ContextVar[bool] = contextvars.ContextVar("tokamax_pass_in_rules",
                                                                 default=False)


def _same_rules(eqn: Any, ref_eqn: Any) -> bool:
    """Whether the derivative rule `eqn` carries is the reference's: `_params_key` tells
    functions apart by kind alone, so a `custom_jvp` function computing the reference's
    values with another JVP (a straight-through `relu`) would read as it. Their JVPs,
    traced, must compute alike; a `custom_vjp` call never matches (no reference holds one).
    Both equations are of one primitive."""
    if _IN_RULES.get() or eqn.primitive.name not in _CUSTOM_DERIVATIVES:
        return True
    if eqn.primitive.name != "custom_jvp_call" or not all(
            jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
        return False
    token = _IN_RULES.set(True)
    try:
        return same_function(_jvp_jaxpr(eqn), _jvp_jaxpr(ref_eqn))
    finally:
        _IN_RULES.reset(token)


def _jvp_jaxpr(eqn: Any) -> ClosedJaxpr:
    """The jaxpr of `jax.jvp` of the one equation `eqn` (primals, then tangents)."""
    body = _opened(eqn.params["call_jaxpr"])[0]  # its debug info names the same operands
    alone = ClosedJaxpr(Jaxpr([], list(eqn.invars), list(eqn.outvars), [eqn],
                              debug_info=body.debug_info), [])
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(lambda p, t: jax.jvp(jaxpr_as_fun(alone), p, t))(avals, avals)


def _opened(body: Jaxpr | ClosedJaxpr) -> tuple[Jaxpr, list[Any]]:
    """`(jaxpr, consts)` of a closed jaxpr, a plain one with no constant values."""
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, [None] * len(body.constvars)


def _shape_dtype(var: Any) -> tuple[tuple[int, ...], Any]:
    """A variable's shape and dtype, without what else its type records (the mesh axes
    it varies over, under `check_vma`)."""
    return tuple(var.aval.shape), var.aval.dtype


def _bodies(params: dict[str, Any]) -> list[str]:
    """The names of the parameters holding jaxprs (a call's body)."""
    return [name for name, value in params.items() if isinstance(value, (Jaxpr, ClosedJaxpr))]


# Parameters placing a result on devices (`jnp.zeros_like` of a sharded value, `iota`
# under a mesh), which keep its values: a reference traced from unsharded shapes has none.
_PLACEMENT = frozenset({"sharding", "out_sharding"})


def _params_key(params: dict[str, Any]) -> dict[str, str]:
    """Parameters comparable across traces, but for the jaxprs (compared by
    `same_function`) and placements (`_PLACEMENT`): functions by kind, NumPy integers as
    numbers."""
    key = {}
    for name, value in params.items():
        if name in _PLACEMENT:
            continue
        if isinstance(value, (Jaxpr, ClosedJaxpr)):
            key[name] = "jaxpr"
        elif isinstance(value, lu.WrappedFun) or callable(value):
            key[name] = type(value).__name__
        else:
            key[name] = repr(_plain(value))
    return key


def _plain(value: Any) -> Any:
    """NumPy scalars as Python numbers (`jax.vmap` leaves `np.int64` axes in parameters)."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.integer):
        return int(value)
    return value
