"""`"attention"`: attention written out in plain JAX,
`softmax(scale * q @ k^T [+ bias] [soft cap] [masked]) @ v`, replaced by the
`dot_product_attention` op.

Matched at the second product, from the equations JAX traces them to, so any spelling
that traces alike is one: `jnp.einsum` or `@`/`jnp.matmul`, any layout (each batch axis,
heads included, shared by q, k and v; one query, one key and one feature axis), the
scale a number multiplying (or dividing) the logits or q, a `bias` added to the logits,
a Gemma-2 soft cap `cap * tanh(logits / cap)`, a mask applied last by
`jnp.where(mask, logits, fill)` with `fill` `-inf` or at most `-1e9`, then
`jax.nn.softmax` (or `exp(l - max) / sum`) over the keys. Keys and values repeated for
grouped-query attention (`jnp.repeat`) are taken as repeated.

A query row whose keys the mask all hides gets plain JAX's value there: the mean of the
values for a finite fill, NaN for `-inf`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr

from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import Graph, literal_value, same_structure

NAME = "attention"
PRIMITIVES = frozenset({"dot_general"})
_LARGEST_FILL = -1e9


def _softmax(logits: Any) -> Any:
    return jax.nn.softmax(logits, axis=-1)


def _softmax_written_out(logits: Any) -> Any:
    e = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


_SOFTMAXES = (_softmax, _softmax_written_out)


@functools.lru_cache(maxsize=256)
def _reference(softmax: Callable[[Any], Any], shape: tuple[int, ...], dtype: Any) -> Jaxpr:
    return jax.make_jaxpr(softmax)(jax.ShapeDtypeStruct(shape, dtype)).jaxpr


@dataclasses.dataclass
class _Attention:
    """What a matched attention computes, and the equations it spans."""

    query: Any = None
    key: Any = None
    value: Any = None
    bias: Any = None
    mask: Any = None
    mask_negated: bool = False
    fill: float = 0.0
    scale: float = 1.0
    soft_cap: float | None = None
    logits_numbers: Any = None
    output_numbers: Any = None
    probabilities_first: bool = True
    region: list[Any] = dataclasses.field(default_factory=list)


class _NoMatch(Exception):
    """The equations are no attention."""


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The op's candidate of the attention whose second product is `eqn`, if it is one."""
    if graph is None or not graph.live(eqn):
        return None
    try:
        attention = _parse(eqn, graph)
    except _NoMatch:
        return None
    if not graph.private([e for e in attention.region if e is not eqn], eqn):
        return Candidate(NAME, None, "values inside the attention are used elsewhere (a "
                                     "gradient traced inside optimize keeps them for its "
                                     "backward)")
    arrays = [attention.query, attention.key, attention.value]
    arrays += [a for a in (attention.bias, attention.mask) if a is not None]
    return Candidate(NAME, functools.partial(_compute, attention, tuple(eqn.outvars[0]
                                                                         .aval.shape)),
                     inputs=tuple(arrays))


def _parse(root: Any, graph: Graph) -> _Attention:
    attention = _Attention(region=[root])
    ((lc, rc), (lb, rb)) = root.params["dimension_numbers"]
    for first, (probabilities, value) in enumerate((root.invars, root.invars[::-1])):
        rank = len(probabilities.aval.shape)
        p_contract, v_contract = (lc, rc) if first == 0 else (rc, lc)
        p_batch, v_batch = (lb, rb) if first == 0 else (rb, lb)
        if rank < 2 or tuple(p_contract) != (rank - 1,):
            continue
        if sorted(p_batch) != list(range(rank - 2)):
            continue
        if len(value.aval.shape) != rank:
            continue
        softmax_input = _softmax_input(graph, probabilities, attention.region)
        if softmax_input is None:
            continue
        attention.probabilities_first = first == 0
        attention.value = value
        attention.output_numbers = (tuple(p_batch), tuple(v_batch), tuple(v_contract))
        _logits(graph, attention, softmax_input)
        return attention
    raise _NoMatch


def _softmax_input(graph: Graph, probabilities: Any, region: list[Any]) -> Any:
    for softmax in _SOFTMAXES:
        reference = _reference(softmax, tuple(probabilities.aval.shape),
                               probabilities.aval.dtype)
        bound: dict[Any, Any] = {}
        found: list[Any] = []
        if same_structure(graph, probabilities, reference, reference.outvars[0], bound, found):
            (logits,) = bound.values()
            region.extend({id(e): e for e in found}.values())
            return logits
    return None


def _logits(graph: Graph, attention: _Attention, logits: Any) -> None:
    """Reads the mask, soft cap, bias and scale back to the `q . k` product."""
    shape = tuple(logits.aval.shape)
    where = graph.producer(logits, "jit")
    if where is not None and where.params.get("name") == "_where":
        condition, on_true, on_false = where.invars
        if tuple(on_true.aval.shape) == shape and literal_value(on_false) is not None:
            attention.mask, fill, logits = condition, literal_value(on_false), on_true
        elif tuple(on_false.aval.shape) == shape and literal_value(on_true) is not None:
            attention.mask, fill, logits = condition, literal_value(on_true), on_false
            attention.mask_negated = True
        else:
            raise _NoMatch
        if condition.aval.dtype != jnp.bool_ or not float(fill) <= _LARGEST_FILL:
            raise _NoMatch
        attention.fill = float(fill)
        attention.region.append(where)
    capped = _soft_cap(graph, attention, logits)
    if capped is not None:
        logits = capped
    add = graph.producer(logits, "add")
    if add is not None:
        for body, bias in (add.invars, add.invars[::-1]):
            if (tuple(body.aval.shape) == shape and literal_value(bias) is None
                    and graph.producer(body, "dot_general", "mul", "div") is not None):
                attention.bias, logits = bias, body
                attention.region.append(add)
                break
        else:
            raise _NoMatch
    logits = _scaled(graph, attention, logits)
    product = graph.producer(logits, "dot_general")
    if product is None:
        raise _NoMatch
    attention.region.append(product)
    query, key = product.invars
    ((qc, kc), (qb, kb)) = product.params["dimension_numbers"]
    rank = len(shape)
    if len(qc) != 1 or len(kc) != 1 or len(qb) != rank - 2 or len(query.aval.shape) != rank:
        raise _NoMatch
    attention.query = _unscaled_query(graph, attention, query)
    attention.key = key
    attention.logits_numbers = (tuple(qb), tuple(kb), int(qc[0]), int(kc[0]))


def _scaled(graph: Graph, attention: _Attention, logits: Any) -> Any:
    eqn = graph.producer(logits, "mul", "div")
    if eqn is None:
        return logits
    for body, factor in _operand_orders(eqn):
        value = literal_value(factor)
        if value is not None and np.ndim(value) == 0 and graph.producer(body, "dot_general"):
            attention.scale *= float(value) if eqn.primitive.name == "mul" else 1 / float(value)
            attention.region.append(eqn)
            return body
    return logits


def _operand_orders(eqn: Any) -> list[tuple[Any, Any]]:
    """`(body, factor)` pairs of a product (either order) or a quotient."""
    if eqn.primitive.name == "mul":
        return [tuple(eqn.invars), tuple(eqn.invars[::-1])]
    return [tuple(eqn.invars)]


def _unscaled_query(graph: Graph, attention: _Attention, query: Any) -> Any:
    eqn = graph.producer(query, "mul", "div")
    if eqn is None or len(graph.users(query)) != 1:
        return query
    for body, factor in _operand_orders(eqn):
        value = literal_value(factor)
        if value is not None and np.ndim(value) == 0 and tuple(body.aval.shape) == tuple(
                query.aval.shape):
            attention.scale *= float(value) if eqn.primitive.name == "mul" else 1 / float(value)
            attention.region.append(eqn)
            return body
    return query


def _soft_cap(graph: Graph, attention: _Attention, logits: Any) -> Any:
    """The logits before `cap * tanh(logits / cap)`, or `None`."""
    outer = graph.producer(logits, "mul")
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
        attention.soft_cap = float(cap_value)
        attention.region.extend([outer, tanh, inner])
        return inner.invars[0]
    return None


def _leading(x: Any, batch: tuple[int, ...], *rest: int) -> Any:
    """`x` with its axes `batch` first, in that order, then `rest`."""
    return jnp.transpose(x, (*batch, *rest))


def _compute(attention: _Attention, out_shape: tuple[int, ...], query: Any, key: Any,
             value: Any, *extra: Any) -> Any:
    """The matched attention's result computed by the op (one head per batch entry)."""
    from tokamax_kernels.attention.api import dot_product_attention

    qb, kb, qc, kc = attention.logits_numbers
    rank = query.ndim
    q_free = next(d for d in range(rank) if d not in (*qb, qc))
    k_free = next(d for d in range(rank) if d not in (*kb, kc))
    p_batch, v_batch, (v_contract,) = attention.output_numbers
    v_free = next(d for d in range(rank) if d not in (*v_batch, v_contract))
    # The logits' batch axes are q's, in `qb` order; the probabilities' the same ones.
    v_order = tuple(v_batch[p_batch.index(i)] for i in range(rank - 2))
    q = _leading(query, qb, q_free, qc)[..., None, :]
    k = _leading(key, kb, k_free, kc)[..., None, :]
    v = _leading(value, v_order, v_contract, v_free)[..., None, :]
    logits_shape = (*q.shape[:-3], q.shape[-3], k.shape[-3])
    extra_arrays = list(extra)
    bias = mask = None
    if attention.bias is not None:
        bias = jnp.broadcast_to(extra_arrays.pop(0), logits_shape)[..., None, :, :]
    if attention.mask is not None:
        mask = jnp.broadcast_to(extra_arrays.pop(0), logits_shape)
        mask = ~mask if attention.mask_negated else mask
    out = dot_product_attention(q, k, v, bias, None if mask is None else mask[..., None, :, :],
                                scale=attention.scale, logits_soft_cap=attention.soft_cap)
    out = out[..., 0, :]  # (batch..., T, H)
    if mask is not None:
        hidden = ~jnp.any(mask, axis=-1)[..., None]
        if attention.fill == -np.inf:
            plain = jnp.full_like(out, np.nan)
        else:
            plain = jnp.mean(v[..., 0, :].astype(jnp.float32), axis=-2, keepdims=True)
        out = jnp.where(hidden, plain.astype(out.dtype), out)
    if not attention.probabilities_first:
        out = jnp.swapaxes(out, -1, -2)
    return out.reshape(out_shape)
