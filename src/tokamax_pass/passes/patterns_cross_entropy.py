"""`"linear_softmax_cross_entropy_loss"`: the per-token softmax cross-entropy of the
logits `x @ w` against integer labels, written in plain JAX, replaced by the
`linear_softmax_cross_entropy_loss` op (`reduction="none"`; a sum or mean of the losses
stays as written).

Matched at the loss, in float32, the logits `x @ w` (`x`'s last axis against a `(H, V)`
`w`) possibly cast to float32 first, spelled as
`-take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]` or as optax
spells it, `jax.nn.logsumexp(logits, -1) - take_along_axis(logits, labels[..., None],
-1)[..., 0]` (`jnp.expand_dims` and `squeeze` too). Labels index as `take_along_axis`
does: a negative one counts from the end, and one out of range gives NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import Graph, dense_matmul, reference_jaxpr, same_structure

NAME = "linear_softmax_cross_entropy_loss"
PRIMITIVES = frozenset({"neg", "sub"})


def _expanded(labels: Any, expand: str) -> Any:
    return labels[..., None] if expand == "index" else jnp.expand_dims(labels, -1)


def _squeezed(picked: Any, squeeze: str) -> Any:
    return picked[..., 0] if squeeze == "index" else picked.squeeze(-1)


def _log_softmax_spelling(expand: str, squeeze: str) -> Callable[[Any, Any], Any]:
    def loss(logits: Any, labels: Any) -> Any:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -_squeezed(jnp.take_along_axis(log_probs, _expanded(labels, expand), axis=-1),
                          squeeze)

    return loss


def _optax_spelling(expand: str, squeeze: str) -> Callable[[Any, Any], Any]:
    def loss(logits: Any, labels: Any) -> Any:
        picked = jnp.take_along_axis(logits, _expanded(labels, expand), axis=-1)
        return jax.nn.logsumexp(logits, axis=-1) - _squeezed(picked, squeeze)

    return loss


_SPELLINGS = {
    "neg": tuple(_log_softmax_spelling(e, s) for e in ("index", "expand_dims")
                 for s in ("index", "squeeze")),
    "sub": tuple(_optax_spelling(e, s) for e in ("index", "expand_dims")
                 for s in ("index", "squeeze")),
}


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The op's candidate of the per-token loss `eqn` ends, if it is one."""
    if graph is None or not graph.live(eqn):
        return None
    (out,) = eqn.outvars
    if out.aval.dtype != jnp.float32:
        return None
    for logits, labels, region in _losses(eqn, graph):
        found = _logits_matmul(graph, logits)
        if found is None:
            continue
        x, w, precision, plumbing = found
        whole = [*region, *plumbing]
        if not graph.private([e for e in whole if e is not eqn], eqn):
            return Candidate(NAME, None, "the logits are used elsewhere (a gradient traced "
                                         "inside optimize keeps them for its backward)")
        return Candidate(NAME, _function(precision), inputs=(x, labels, w))
    return None


def _losses(eqn: Any, graph: Graph) -> list[tuple[Any, Any, list[Any]]]:
    """`(logits, labels, equations)` for each known spelling `eqn` ends."""
    (out,) = eqn.outvars
    found = []
    for spelling in _SPELLINGS[eqn.primitive.name]:
        candidates = _input_avals(eqn, graph)
        for logits_aval, labels_aval in candidates:
            reference = reference_jaxpr(spelling, logits_aval, labels_aval)
            bound: dict[Any, Any] = {}
            region: list[Any] = []
            if same_structure(graph, out, reference, reference.outvars[0], bound, region):
                logits, labels = (bound.get(v) for v in reference.invars)
                if logits is not None and labels is not None:
                    found.append((logits, labels, list({id(e): e for e in region}.values())))
    return found


def _input_avals(eqn: Any, graph: Graph) -> list[tuple[tuple[tuple[int, ...], Any], ...]]:
    """The `(logits, labels)` shapes and dtypes a loss of `eqn`'s shape may come from: the
    logits' vocabulary read off a `take_along_axis` among the equations before it."""
    shape = tuple(eqn.outvars[0].aval.shape)
    seen = []
    stack, visited = list(eqn.invars), set[Any]()
    while stack and len(visited) < 64:
        var = stack.pop()
        producer = graph.producer(var)
        if producer is None or id(producer) in visited:
            continue
        visited.add(id(producer))
        if producer.primitive.name == "jit" and producer.params.get("name") == "take_along_axis":
            array, indices = producer.invars
            if tuple(array.aval.shape[:-1]) == shape and jnp.issubdtype(indices.aval.dtype,
                                                                         jnp.integer):
                seen.append(((tuple(array.aval.shape), array.aval.dtype),
                             (shape, indices.aval.dtype)))
            continue
        stack.extend(producer.invars)
    return list(dict.fromkeys(seen))


def _logits_matmul(graph: Graph, logits: Any) -> tuple[Any, Any, Any, list[Any]] | None:
    """`(x, w, precision, equations)` where `logits` is `x @ w`, possibly cast to float32."""
    plumbing = []
    convert = graph.producer(logits, "convert_element_type")
    if convert is not None:
        plumbing.append(convert)
        logits = convert.invars[0]
    dot = dense_matmul(graph, logits)
    if dot is None:
        return None
    x, w = dot.invars
    if x.aval.dtype != w.aval.dtype:
        return None
    return x, w, dot.params["precision"], [*plumbing, dot]


def _function(precision: Any) -> Callable[[Any, Any, Any], Any]:
    def function(x: Any, labels: Any, w: Any) -> Any:
        from tokamax_kernels.linear_softmax_cross_entropy_loss.api import (
            linear_softmax_cross_entropy_loss,
        )

        vocabulary = w.shape[-1]
        # As `take_along_axis` indexes: from the end for a negative label, NaN out of range
        # (the op gives NaN for labels >= V, and ignores negative ones).
        labels = labels.astype(jnp.int32)
        labels = jnp.where(labels < -vocabulary, vocabulary,
                           jnp.where(labels < 0, labels + vocabulary, labels))
        return linear_softmax_cross_entropy_loss(x, labels, w, reduction="none",
                                                 precision=precision)

    return function
