"""`"linear_softmax_cross_entropy_loss"`: the per-token softmax cross-entropy of the
logits `x @ w` against integer labels, written in plain JAX, replaced by the
`linear_softmax_cross_entropy_loss` op (`reduction="none"`; a sum or mean of the losses
stays as written).

Matched at the loss, in float32, the logits `x @ w` (`x`'s last axis against a `(H, V)`
`w`) possibly cast to float32 and then soft-capped (`cap * tanh(logits / cap)`, Gemma
2's final-logit cap, the op's `logits_soft_cap`) first, spelled as
`-take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]` or as optax
spells it, `jax.nn.logsumexp(logits, -1) - take_along_axis(logits, labels[..., None],
-1)[..., 0]` (`jnp.expand_dims` and `squeeze` too). Labels index as `take_along_axis`
does: a negative one counts from the end, and one out of range gives NaN.

Two more spellings: the label's log-probability `take_along_axis(log_softmax(logits),
...)[..., 0]` (or left `(..., 1)`, without the `[..., 0]`) negated later
(`-log_probs.mean()`, `-jnp.sum(...)`), replaced by the op's loss negated; and the
one-hot form `-(jax.nn.one_hot(labels, V) * log_softmax(logits)).sum(-1)` (optax's
`softmax_cross_entropy` of one-hot labels), where a label outside `[0, V)` has an
all-zero one-hot row, so no loss and no gradient (the op ignores it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import (
    Graph,
    dense_matmul,
    reference_jaxpr,
    same_structure,
    soft_capped,
)

NAME = "linear_softmax_cross_entropy_loss"
PRIMITIVES = frozenset({"neg", "sub", "squeeze", "jit"})


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


def _log_probability_spelling(expand: str, squeeze: str) -> Callable[[Any, Any], Any]:
    def log_probability(logits: Any, labels: Any) -> Any:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return _squeezed(jnp.take_along_axis(log_probs, _expanded(labels, expand), axis=-1),
                         squeeze)

    return log_probability


def _picked_log_probability_spelling(expand: str) -> Callable[[Any, Any], Any]:
    def picked(logits: Any, labels: Any) -> Any:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(log_probs, _expanded(labels, expand), axis=-1)

    return picked


def _one_hot_spelling(one_hot_first: bool) -> Callable[[Any, Any], Any]:
    def loss(logits: Any, labels: Any) -> Any:
        one_hot = jax.nn.one_hot(labels, logits.shape[-1])
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -(one_hot * log_probs if one_hot_first else log_probs * one_hot).sum(-1)

    return loss


class _Labels(enum.Enum):
    """How a spelling reads its labels, which decides a label outside `[-V, V)`'s loss and
    gradient (a negative label in `[-V, 0)` counts from the end, as indexing does)."""

    # `take_along_axis` of the logits (optax's `lse - logit`): a NaN loss, and the
    # log-sum-exp's gradient alone (the out-of-range gather has none).
    PICKED_LOGIT = enum.auto()
    # `take_along_axis` of `log_softmax(logits)`: a NaN loss and no gradient (the gather's
    # transpose drops the token's cotangent before the log-softmax).
    PICKED_LOG_PROBABILITY = enum.auto()
    # `jax.nn.one_hot`: negative labels too select nothing, so no loss and no gradient.
    ONE_HOT = enum.auto()


@dataclasses.dataclass(frozen=True)
class _Spelling:
    """A reference spelling of the per-token loss (or its negation, `negated`), and how it
    reads its labels."""

    function: Callable[[Any, Any], Any]
    labels: _Labels
    negated: bool = False
    # The value keeps `take_along_axis`'s trailing axis of 1 (`(..., 1)`, not squeezed).
    keeps_axis: bool = False

    @property
    def labels_enter(self) -> str:
        """The name of the jitted call the labels enter, which holds the vocabulary."""
        return "_one_hot" if self.labels is _Labels.ONE_HOT else "take_along_axis"


_FORMS = [(e, s) for e in ("index", "expand_dims") for s in ("index", "squeeze")]
_LOG_PROBABILITY = _Labels.PICKED_LOG_PROBABILITY
_SPELLINGS = {
    "neg": (*(_Spelling(_log_softmax_spelling(e, s), _LOG_PROBABILITY) for e, s in _FORMS),
            *(_Spelling(_one_hot_spelling(first), _Labels.ONE_HOT) for first in (True, False))),
    "sub": tuple(_Spelling(_optax_spelling(e, s), _Labels.PICKED_LOGIT) for e, s in _FORMS),
    "squeeze": tuple(_Spelling(_log_probability_spelling(e, s), _LOG_PROBABILITY, negated=True)
                     for e, s in _FORMS),
    "jit": tuple(_Spelling(_picked_log_probability_spelling(e), _LOG_PROBABILITY, negated=True,
                           keeps_axis=True) for e in ("index", "expand_dims")),
}


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The op's candidate of the per-token loss `eqn` ends, if it is one."""
    if graph is None or not graph.live(eqn) or len(eqn.outvars) != 1:
        return None
    (out,) = eqn.outvars
    if out.aval.dtype != jnp.float32:
        return None
    if eqn.primitive.name == "squeeze" and any(
            user.primitive.name == "neg" for user in graph.users(out)):
        return None  # the loss itself, matched at that negation
    if eqn.primitive.name == "jit" and (
            eqn.params.get("name") != "take_along_axis" or out.aval.shape[-1:] != (1,)
            or any(user.primitive.name == "squeeze" for user in graph.users(out))):
        return None  # not the label's log-probability left `(..., 1)`: matched later
    for spelling, logits, labels, region in _losses(eqn, graph):
        found = _logits_matmul(graph, logits)
        if found is None:
            continue
        x, w, precision, cap, plumbing = found
        whole = [*region, *plumbing]
        if not graph.private([e for e in whole if e is not eqn], eqn):
            return Candidate(NAME, None, "the logits are used elsewhere (a gradient traced "
                                         "inside optimize keeps them for its backward)")
        return Candidate(NAME, _function(precision, cap, spelling), inputs=(x, labels, w))
    return None


def _losses(eqn: Any, graph: Graph) -> list[tuple[_Spelling, Any, Any, list[Any]]]:
    """`(spelling, logits, labels, equations)` for each known spelling `eqn` ends."""
    (out,) = eqn.outvars
    found = []
    for spelling in _SPELLINGS[eqn.primitive.name]:
        candidates = _input_avals(eqn, graph, spelling)
        for logits_aval, labels_aval in candidates:
            reference = reference_jaxpr(spelling.function, logits_aval, labels_aval)
            bound: dict[Any, Any] = {}
            region: list[Any] = []
            if same_structure(graph, out, reference, reference.outvars[0], bound, region):
                logits, labels = (bound.get(v) for v in reference.invars)
                if logits is not None and labels is not None:
                    found.append((spelling, logits, labels,
                                  list({id(e): e for e in region}.values())))
    return found


def _input_avals(eqn: Any, graph: Graph, spelling: _Spelling
                 ) -> list[tuple[tuple[tuple[int, ...], Any], ...]]:
    """The `(logits, labels)` shapes and dtypes a loss of `eqn`'s shape may come from: the
    logits' vocabulary read off the call the labels enter (`take_along_axis`: its array is
    the logits; `_one_hot`: its result is their shape), `eqn` or one before it."""
    labels_enter = spelling.labels_enter
    shape = tuple(eqn.outvars[0].aval.shape)
    if spelling.keeps_axis:
        shape = shape[:-1]
    seen = []
    stack, visited = list(eqn.outvars), set[Any]()
    while stack and len(visited) < 64:
        var = stack.pop()
        producer = graph.producer(var)
        if producer is None or id(producer) in visited:
            continue
        visited.add(id(producer))
        if producer.primitive.name == "jit" and producer.params.get("name") == labels_enter:
            labels = producer.invars[-1]
            logits = (producer.invars if labels_enter == "take_along_axis"
                      else producer.outvars)[0]
            if tuple(logits.aval.shape[:-1]) == shape and jnp.issubdtype(labels.aval.dtype,
                                                                          jnp.integer):
                seen.append(((tuple(logits.aval.shape), logits.aval.dtype),
                             (shape, labels.aval.dtype)))
            continue
        stack.extend(producer.invars)
    return list(dict.fromkeys(seen))


def _logits_matmul(graph: Graph, logits: Any
                   ) -> tuple[Any, Any, Any, float | None, list[Any]] | None:
    """`(x, w, precision, cap, equations)` where `logits` is `x @ w`, possibly cast to
    float32, then possibly soft-capped (`cap * tanh(logits / cap)`; else `cap` None)."""
    plumbing: list[Any] = []
    cap = None
    capped = soft_capped(graph, logits)
    if capped is not None:
        logits, cap, plumbing = capped
    convert = graph.producer(logits, "convert_element_type")
    if convert is not None:
        plumbing.append(convert)
        logits = convert.invars[0]
    dot = dense_matmul(graph, logits)
    if dot is None:
        return None
    x, w = dot.invars
    # The op rounds the logits to the inputs' dtype, as a product without a wider
    # `preferred_element_type` does.
    if x.aval.dtype != w.aval.dtype or dot.outvars[0].aval.dtype != x.aval.dtype:
        return None
    return x, w, dot.params["precision"], cap, [*plumbing, dot]


def _function(precision: Any, cap: float | None,
              spelling: _Spelling) -> Callable[[Any, Any, Any], Any]:
    def function(x: Any, labels: Any, w: Any) -> Any:
        from tokamax_kernels.linear_softmax_cross_entropy_loss.api import (
            linear_softmax_cross_entropy_loss,
        )

        op_labels, nan = _labels_for_op(spelling.labels, labels.astype(jnp.int32),
                                        w.shape[-1])
        losses = linear_softmax_cross_entropy_loss(x, op_labels, w, reduction="none",
                                                   logits_soft_cap=cap, precision=precision)
        if nan is not None:
            losses = losses + jnp.where(nan, jnp.nan, 0.0)
        losses = -losses if spelling.negated else losses
        return losses[..., None] if spelling.keeps_axis else losses

    return function


def _labels_for_op(read: _Labels, labels: Any, vocabulary: int) -> tuple[Any, Any]:
    """`(labels, nan)`: the op's labels giving the loss and gradient the spelling gives
    (the op ignores a negative label and gives a label >= V a NaN loss and its
    log-sum-exp's gradient), and the tokens whose loss must be made NaN besides (`None`:
    none)."""
    outside = (labels < -vocabulary) | (labels >= vocabulary)
    if read is _Labels.ONE_HOT:
        return jnp.where(outside | (labels < 0), -1, labels), None
    wrapped = jnp.where(labels < 0, labels + vocabulary, labels)
    if read is _Labels.PICKED_LOGIT:
        return jnp.where(outside, vocabulary, wrapped), None
    return jnp.where(outside, -1, wrapped), outside
