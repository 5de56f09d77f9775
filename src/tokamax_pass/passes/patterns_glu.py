"""`"gated_linear_unit"`: `act(x @ w_gate) * (x @ w_up)` written in plain JAX, replaced
by the `gated_linear_unit` op.

Matched at the product, either operand order: two matmuls of one `x` (its last axis
against the first of a `(K, N)` weight), one matmul with a `(K, 2N)` weight split in
two halves (`jnp.split`, or slices) whose halves are the gate and the up projection, or
one onto two stacked outputs indexed on the second-to-last axis (`h[..., 0, :]`,
`h[..., 1, :]`: Gemma's `gating_einsum` of `(2, K, N)` or `(2, N, K)` weights, MaxText's
fused `(K, 2, N)` kernel) or on the last (`h[..., 0]`, `h[..., 1]`: `(K, N, 2)` weights,
or a `(K, 2N)` weight's product reshaped to `(..., N, 2)`, interleaved);
`act` is `jax.nn.silu`/`swish` (or written out, `g * jax.nn.sigmoid(g)`, also regrouped
with the up projection, `g * (jax.nn.sigmoid(g) * up)`), `jax.nn.gelu`
(tanh or exact), `jax.nn.relu` or `jax.nn.sigmoid` (recognized by the equations they
trace to), or none (the bilinear GLU); the activation possibly computed in float32 and
cast back to the projection's dtype, as the op computes it.
MoE experts' units over ragged dots are grouped ones (the op's `group_sizes`):
`act(jax.lax.ragged_dot(x, w_gate, sizes)) * jax.lax.ragged_dot(x, w_up, sizes)` of
`(G, K, N)` weights, or one `jax.lax.ragged_dot(x, w, sizes)` of a `(G, K, 2N)` weight
split in halves; each ragged dot in its operands' dtype (the op rounds both products so),
of one `x` and one `sizes`. Their ragged dots then belong to the unit
(`grouped_unit_root`): the `"ragged_dot"` pattern takes them only where the unit is left
as written.
Matmuls whose values feed anything else (a gradient traced inside `optimize` keeps
them for its backward) are left as written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import (
    Graph,
    dense_matmul,
    reference_jaxpr,
    rounds,
    same_structure,
    same_value,
)

NAME = "gated_linear_unit"
PRIMITIVES = frozenset({"mul"})


def gelu_exact(x: Any) -> Any:
    """`jax.nn.gelu(x, approximate=False)`, as a module-level function (an op's spec
    names its activation)."""
    return jax.nn.gelu(x, approximate=False)


def silu_written_out(x: Any) -> Any:
    """`x * jax.nn.sigmoid(x)`: `jax.nn.silu` as models write it by hand."""
    return x * jax.nn.sigmoid(x)


def silu_written_out_sigmoid_first(x: Any) -> Any:
    """`jax.nn.sigmoid(x) * x`: the written-out `jax.nn.silu`, its factors swapped."""
    return jax.nn.sigmoid(x) * x


# The activations recognized: each spelling (the equations it traces to) and the
# function the op is then given.
SPELLINGS: tuple[tuple[Callable[[Any], Any], Callable[[Any], Any]], ...] = (
    *((activation, activation) for activation in (
        jax.nn.silu, jax.nn.gelu, gelu_exact, jax.nn.relu, jax.nn.sigmoid)),
    (silu_written_out, jax.nn.silu), (silu_written_out_sigmoid_first, jax.nn.silu))


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The `gated_linear_unit` candidate of the product `eqn`, if it is a GLU's."""
    if graph is None or not graph.live(eqn) or len(eqn.invars) != 2:
        return None
    full = tuple(eqn.outvars[0].aval.shape)
    if any(tuple(v.aval.shape) != full or isinstance(v, Literal) for v in eqn.invars):
        return None
    if _inside_regrouped_silu(graph, eqn):
        return None
    for gate, up in (eqn.invars, eqn.invars[::-1]):
        found = _activation(graph, gate)
        if found is None:
            continue
        candidate = _unit(graph, eqn, up, *found)
        if candidate is not None:
            return candidate
    regrouped = _regrouped_silu(graph, eqn)
    if regrouped is not None:
        projected, up, region = regrouped
        return _unit(graph, eqn, up, jax.nn.silu, projected, region)
    return None


def _unit(graph: Graph, root: Any, up: Any, activation: Callable[[Any], Any] | None,
          projected: Any, region: list[Any]) -> Candidate | None:
    """The candidate of the unit ending at `root` whose gate is `activation(projected)`
    (by the equations `region`) and whose up projection is `up`, of any kind of
    projection; `None` where `projected` and `up` are no unit's projections."""
    for kind in (_separate, _fused, _stacked, functools.partial(_separate, grouped=True),
                 functools.partial(_fused, grouped=True)):
        candidate = kind(graph, root, projected, up, activation, region)
        if candidate is not None:
            return candidate
    return None


def _regrouped_silu(graph: Graph, eqn: Any) -> tuple[Any, Any, list[Any]] | None:
    """`(g, up, equations)` where `eqn` is `g * (jax.nn.sigmoid(g) * up)`, silu's factors
    regrouped with the up projection (either product's factors in either order), `g` a
    projection; else `None`."""
    for gate, inner in (eqn.invars, eqn.invars[::-1]):
        product = graph.producer(inner, "mul")
        if product is None or graph.producer(gate, *_PROJECTIONS) is None:
            continue
        reference = reference_jaxpr(jax.nn.sigmoid, (tuple(gate.aval.shape),
                                                     gate.aval.dtype))
        for sigmoid, up in (product.invars, product.invars[::-1]):
            if tuple(up.aval.shape) != tuple(gate.aval.shape):
                continue
            bound: dict[Any, Any] = {}
            region: list[Any] = [product]
            if (same_structure(graph, sigmoid, reference, reference.outvars[0], bound,
                               region) and list(bound.values()) == [gate]):
                return gate, up, region
    return None


def _inside_regrouped_silu(graph: Graph, eqn: Any) -> bool:
    """Whether `eqn` is the inner product `jax.nn.sigmoid(g) * up` of a regrouped silu
    unit (`_regrouped_silu`), which is matched (or left alone) where it ends."""
    users = graph.users(eqn.outvars[0])
    if len(users) != 1 or users[0].primitive.name not in PRIMITIVES:
        return False
    regrouped = _regrouped_silu(graph, users[0])
    return regrouped is not None and regrouped[2][0] is eqn


def _candidate(graph: Graph, root: Any, region: list[Any], inputs: tuple[Any, ...],
               function: Callable[..., Any]) -> Candidate:
    if not graph.private(region, root):
        return Candidate(NAME, None, "the matmuls' values are used elsewhere (a gradient "
                                     "traced inside optimize keeps them for its backward)")
    return Candidate(NAME, function, inputs=inputs, region=tuple(region))


def _separate(graph: Graph, root: Any, gate: Any, up: Any,
              activation: Callable[[Any], Any] | None, region: list[Any], *,
              grouped: bool = False) -> Candidate | None:
    """`act(x @ w_gate) * (x @ w_up)` (`ragged_dot(x, w, sizes)` products of one `sizes`
    where `grouped`): the op is given the pair `(w_gate, w_up)`."""
    product = _ragged_product if grouped else dense_matmul
    gate_dot, up_dot = product(graph, gate), product(graph, up)
    if gate_dot is None or up_dot is None or gate_dot is up_dot:
        return None
    (x, w_gate, *sizes), (x_up, w_up, *sizes_up) = gate_dot.invars, up_dot.invars
    shared = list(zip((x, *sizes), (x_up, *sizes_up), strict=True))
    if (not all(same_value(graph, a, b) for a, b in shared)
            or tuple(w_gate.aval.shape) != tuple(w_up.aval.shape)
            or gate_dot.params["precision"] != up_dot.params["precision"]):
        return None
    precision = gate_dot.params["precision"]
    region = [*region, gate_dot, up_dot]
    region += [graph.producer(b) for a, b in shared
               if a is not b and graph.producer(b) is not None]

    def function(x: Any, w_gate: Any, w_up: Any, *sizes: Any) -> Any:
        from tokamax_kernels.gated_linear_unit.api import gated_linear_unit

        return gated_linear_unit(x, (w_gate, w_up), activation=activation,
                                 group_sizes=sizes[0] if sizes else None, precision=precision)

    return _candidate(graph, root, region, (x, w_gate, w_up, *sizes), function)


def _fused(graph: Graph, root: Any, gate: Any, up: Any,
           activation: Callable[[Any], Any] | None, region: list[Any], *,
           grouped: bool = False) -> Candidate | None:
    """One projection `x @ w` (`ragged_dot(x, w, sizes)` where `grouped`) of a
    `(..., K, 2N)` weight split in halves: the op is given `w` as `(..., K, 2, N)` (gate
    first) or the pair of its halves."""
    halves = _halves(graph, gate, up)
    if halves is None:
        return None
    projected, gate_first, split_eqns = halves
    dot = _ragged_product(graph, projected) if grouped else dense_matmul(graph, projected)
    if dot is None:
        return None
    precision = dot.params["precision"]
    region = [*region, *split_eqns, dot]

    def function(x: Any, w: Any, *sizes: Any) -> Any:
        from tokamax_kernels.gated_linear_unit.api import gated_linear_unit

        n = w.shape[-1] // 2
        weights = (w.reshape(*w.shape[:-1], 2, n) if gate_first
                   else (w[..., n:], w[..., :n]))
        return gated_linear_unit(x, weights, activation=activation,
                                 group_sizes=sizes[0] if sizes else None, precision=precision)

    return _candidate(graph, root, region, tuple(dot.invars), function)


def _ragged_product(graph: Graph, var: Any) -> Any:
    """The `jax.lax.ragged_dot(x, w, sizes)` equation making `var` (`x` `(M, K)` in
    consecutive groups against `(G, K, N)` weights, no group offset, the product in the
    operands' floating dtype), or `None`."""
    eqn = graph.producer(var, "ragged_dot_general")
    if eqn is None:
        return None
    params = eqn.params
    numbers = params["ragged_dot_dimension_numbers"]
    if (numbers.dot_dimension_numbers != (((1,), (1,)), ((), ()))
            or tuple(numbers.lhs_ragged_dimensions) != (0,)
            or tuple(numbers.rhs_group_dimensions) != (0,)):
        return None
    if params.get("group_offset") is not None or params.get("out_sharding") is not None:
        return None
    x, w, _ = eqn.invars
    dtypes = {jnp.dtype(a.aval.dtype) for a in (x, w, var)}
    if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
        return None
    return eqn


# How many equations deep `grouped_unit_root` looks for the unit's product: past an
# activation written out (`g * jax.nn.sigmoid(g)`: two), or one `jax.nn` call (one).
_ACTIVATION_DEPTH = 3


def grouped_unit_root(graph: Graph, eqn: Any) -> Any:
    """The product ending a grouped unit this pattern would replace whose gate or up
    projection is the ragged dot `eqn`, or `None`: searched among the equations using
    its result, through the activation's."""
    frontier, seen = list(eqn.outvars), set[int]()
    for _ in range(_ACTIVATION_DEPTH):
        users = [u for var in frontier for u in graph.users(var) if id(u) not in seen]
        seen.update(id(u) for u in users)
        for user in users:
            if user.primitive.name not in PRIMITIVES:
                continue
            candidate = match(user, graph)
            if (candidate is not None and candidate.function is not None
                    and any(e is eqn for e in candidate.region)):
                return user
        frontier = [var for u in users for var in u.outvars]
    return None


def _stacked(graph: Graph, root: Any, gate: Any, up: Any,
             activation: Callable[[Any], Any] | None, region: list[Any]) -> Candidate | None:
    """A projection onto two stacked outputs, then `act(h[..., 0, :]) * h[..., 1, :]`
    (either index the gate's), or stacked last, `act(h[..., 0]) * h[..., 1]`: `h =
    jnp.einsum("...K,K2N->...2N", x, w)` (MaxText's fused MLP kernel, the op's own `(K,
    2, N)` layout), of weights stacked first, `"...F,NFH->...NH"` or `"...F,NHF->...NH"`
    (Gemma's `gating_einsum`), or last, `"...k,knt->...nt"` of `(K, N, 2)` weights; or
    `x @ w` of a `(K, 2N)` weight reshaped to `(..., 2, N)` or to `(..., N, 2)` (gate
    and up interleaved). The op is given the weights as `(K, 2, N)`, their axes moved
    so (the products it computes are the plain ones, in another order)."""
    picked = _stacked_rows(graph, gate, up)
    if picked is None:
        return None
    projected, gate_index, stacked_last, pick_eqns = picked
    found = _stacked_product(graph, projected, stacked_last)
    if found is None:
        return None
    dot, as_stacked, product_eqns = found
    region = [*region, *pick_eqns, *product_eqns]
    precision = dot.params["precision"]

    def function(x: Any, w: Any) -> Any:
        from tokamax_kernels.gated_linear_unit.api import gated_linear_unit

        weights = as_stacked(w)
        weights = weights if gate_index == 0 else weights[:, ::-1]
        return gated_linear_unit(x, weights, activation=activation, precision=precision)

    return _candidate(graph, root, region, tuple(dot.invars), function)


def _stacked_product(graph: Graph, h: Any, stacked_last: bool
                     ) -> tuple[Any, Callable[[Any], Any], list[Any]] | None:
    """`(dot, as_stacked, equations)` where `h` (stacked on its last axis where `stacked_last`, else
    on the one before) is `x`'s last axis contracted with a 3-D weight, or `x @ w` of a
    `(K, 2N)` weight reshaped to split its last axis in two; `as_stacked(w)` is that
    weight as `(K, 2, N)`; `equations`: the product's (and its reshape's). `None`
    otherwise."""
    reshape = graph.producer(h, "reshape")
    if reshape is not None:
        dot = dense_matmul(graph, reshape.invars[0])
        shape, flat = tuple(h.aval.shape), tuple(reshape.invars[0].aval.shape)
        if (dot is None or reshape.params.get("dimensions") is not None
                or shape[:-2] != flat[:-1]):
            return None
        k, n = dot.invars[1].aval.shape[0], shape[-2] if stacked_last else shape[-1]
        if stacked_last:
            return dot, lambda w: jnp.swapaxes(w.reshape(k, n, 2), 1, 2), [reshape, dot]
        return dot, lambda w: w.reshape(k, 2, n), [reshape, dot]
    dot = graph.producer(h, "dot_general")
    if dot is None:
        return None
    x, w = dot.invars
    rank = len(x.aval.shape)
    ((x_contract, w_contract), batch) = dot.params["dimension_numbers"]
    if len(w.aval.shape) != 3 or batch != ((), ()) or tuple(x_contract) != (rank - 1,):
        return None
    (contracted,) = w_contract
    free = [a for a in range(3) if a != contracted]  # `h`'s last two axes, in order
    stack_axis, n_axis = free[::-1] if stacked_last else free
    return dot, lambda w: jnp.transpose(w, (contracted, stack_axis, n_axis)), [dot]


def _stacked_rows(graph: Graph, gate: Any, up: Any
                  ) -> tuple[Any, int, bool, list[Any]] | None:
    """`(h, gate_index, stacked_last, equations)` where `gate` and `up` are `h[..., i, :]`
    and `h[..., 1 - i, :]` of an `h` whose second-to-last axis has length 2, or `h[...,
    i]` and `h[..., 1 - i]` of one whose last axis has (`stacked_last`) (a slice of it,
    squeezed), `i` the gate's index."""
    picks = []
    for var in (gate, up):
        squeeze = graph.producer(var, "squeeze")
        sliced = None if squeeze is None else graph.producer(squeeze.invars[0], "slice")
        if sliced is None or len(squeeze.params["dimensions"]) != 1:
            return None
        h = sliced.invars[0]
        shape = tuple(h.aval.shape)
        (axis,) = squeeze.params["dimensions"]
        p = sliced.params
        if (axis not in (len(shape) - 2, len(shape) - 1) or len(shape) < 2
                or shape[axis] != 2 or p["strides"] not in (None, (1,) * len(shape))):
            return None
        index = int(p["start_indices"][axis])
        picked = [(0, size) for size in shape]
        picked[axis] = (index, index + 1)
        if list(zip(p["start_indices"], p["limit_indices"], strict=True)) != picked:
            return None
        picks.append((h, index, axis == len(shape) - 1, [squeeze, sliced]))
    (h, gate_index, last, gate_eqns), (h_up, up_index, up_last, up_eqns) = picks
    if h is not h_up or gate_index == up_index or last != up_last:
        return None
    return h, gate_index, last, [*gate_eqns, *up_eqns]


def _halves(graph: Graph, gate: Any, up: Any) -> tuple[Any, bool, list[Any]] | None:
    """`(h, gate_first, equations)` where `gate` and `up` are the two halves of `h`'s
    last axis (`jnp.split` or slices); one half times itself is not a GLU's product."""
    if gate is up:
        return None
    split = graph.producer(gate, "split")
    if split is not None and split is graph.producer(up, "split"):
        (h,) = split.invars
        rank = len(h.aval.shape)
        sizes = tuple(int(s) for s in split.params["sizes"])
        if split.params["axis"] != rank - 1 or len(sizes) != 2 or sizes[0] != sizes[1]:
            return None
        return h, split.outvars[0] is gate, [split]
    slices = [graph.producer(v, "slice") for v in (gate, up)]
    if None in slices or slices[0].invars[0] is not slices[1].invars[0]:
        return None
    h = slices[0].invars[0]
    shape = tuple(h.aval.shape)
    n = shape[-1] // 2
    if shape[-1] % 2:
        return None
    bounds = []
    for eqn in slices:
        p = eqn.params
        if p["strides"] not in (None, (1,) * len(shape)):
            return None
        if tuple(p["start_indices"][:-1]) != (0,) * (len(shape) - 1):
            return None
        if tuple(p["limit_indices"][:-1]) != shape[:-1]:
            return None
        bounds.append((p["start_indices"][-1], p["limit_indices"][-1]))
    if bounds == [(0, n), (n, 2 * n)]:
        return h, True, slices
    if bounds == [(n, 2 * n), (0, n)]:
        return h, False, slices
    return None


# What a gate's projection is made by: a matmul (a ragged one too), or a part of a fused one.
_PROJECTIONS = ("dot_general", "ragged_dot_general", "split", "slice", "squeeze")


def _activation(graph: Graph, gate: Any
                ) -> tuple[Callable[[Any], Any] | None, Any, list[Any]] | None:
    """`(activation, its operand, its equations)` where `gate` is an activation of
    `SPELLINGS` applied to a matmul or a half of one (`None`, no equations: `gate` is
    that itself), possibly computed in a wider float type and cast back
    (`_activation_computed_wider`)."""
    if graph.producer(gate, *_PROJECTIONS) is not None:
        return None, gate, []
    found = _spelled_activation(graph, gate)
    if found is not None and graph.producer(found[1], *_PROJECTIONS) is not None:
        return found
    return _activation_computed_wider(graph, gate)


def _spelled_activation(graph: Graph, gate: Any
                        ) -> tuple[Callable[[Any], Any], Any, list[Any]] | None:
    """`(activation, its operand, its equations)` where `gate` is an activation of
    `SPELLINGS` of one operand, else `None`."""
    for spelling, activation in SPELLINGS:
        reference = reference_jaxpr(spelling, (tuple(gate.aval.shape), gate.aval.dtype))
        bound: dict[Any, Any] = {}
        region: list[Any] = []
        if same_structure(graph, gate, reference, reference.outvars[0], bound, region):
            (operand,) = bound.values() or (None,)
            if operand is not None:
                return activation, operand, list({id(e): e for e in region}.values())
    return None


def _activation_computed_wider(graph: Graph, gate: Any
                               ) -> tuple[Callable[[Any], Any], Any, list[Any]] | None:
    """`act(g.astype(jnp.float32)).astype(g.dtype)` of a projection `g`: the activation
    computed in a wider float type and rounded back, as the op computes it (which then
    multiplies by the up projection in that type too and rounds once)."""
    narrow = graph.producer(gate, "convert_element_type")
    if narrow is None or not all(jnp.issubdtype(v.aval.dtype, jnp.floating)
                                 for v in (narrow.invars[0], gate)):
        return None
    if not rounds(narrow.invars[0].aval.dtype, gate.aval.dtype):
        return None
    found = _spelled_activation(graph, narrow.invars[0])
    if found is None:
        return None
    activation, operand, region = found
    widen = graph.producer(operand, "convert_element_type")
    if (widen is None or widen.invars[0].aval.dtype != gate.aval.dtype
            or graph.producer(widen.invars[0], *_PROJECTIONS) is None):
        return None
    return activation, widen.invars[0], [*region, widen, narrow]

