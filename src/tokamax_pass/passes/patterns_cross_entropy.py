"""`"linear_softmax_cross_entropy_loss"`: the per-token softmax cross-entropy of the
logits `x @ w` against integer labels, written in plain JAX, replaced by the
`linear_softmax_cross_entropy_loss` op (`reduction="none"`; a sum or mean of the losses
stays as written).

Matched at the loss, in float32, the logits `x @ w` (`x`'s last axis against a `(H, V)`
`w`, or against the last axis of a `(V, H)` `w`, a tied embedding's logits
`jnp.einsum("btd,vd->btv", x, embedding)`, whose `w.T` the op takes: the op has no
layout of its own for it, and its kernels read the transposed copy) possibly cast to
float32 and then soft-capped (`cap * tanh(logits / cap)`, Gemma 2's final-logit cap, the
op's `logits_soft_cap`), then possibly sliced along the tokens (`logits[..., :-1, :]`, a
next-token loss: the op takes those rows of `x`) first, spelled as
`-take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]`, as
`jax.nn.logsumexp(logits, -1) - take_along_axis(logits, labels[..., None], -1)[..., 0]`
(`jnp.expand_dims` and `squeeze` too; `jnp.expand_dims` then `.take(0, axis=-1)` as
`optax.softmax_cross_entropy_with_integer_labels` computes it from optax 0.2.4), or as
older versions of
`optax.softmax_cross_entropy_with_integer_labels` compute it: the logits shifted by
their gradient-stopped row max (`jnp.max(..., initial=-jnp.inf)` too), then
`log(sum(exp(shifted)))` minus the label's shifted logit. Labels index as
`take_along_axis` does: a negative one counts from the end, and one out of range gives
NaN. Wherever a spelling below takes `log_softmax(logits)`, it may be
`jax.nn.log_softmax(logits)` or `logits - jax.nn.logsumexp(logits, -1, keepdims=True)`.

Two more spellings: the label's log-probability `take_along_axis(log_softmax(logits),
...)[..., 0]` (or left `(..., 1)`, without the `[..., 0]`) negated later
(`-log_probs.mean()`, `-jnp.sum(...)`), replaced by the op's loss negated; and the
one-hot form `-(jax.nn.one_hot(labels, V) * log_softmax(logits)).sum(-1)` (the one-hot
float32 or bfloat16, whose zeros and ones are exact, or by comparison with `jnp.arange(V)`
cast to float32, also selecting 1.0 or 0.0 as Flax's `common_utils.onehot` does; optax's
`softmax_cross_entropy` of one-hot labels, also negated later:
`-(one_hot * log_softmax(logits)).sum(-1).mean()`, or summed over every axis at once,
`-jnp.sum(one_hot * log_softmax(logits))`), where a label outside `[0, V)` has an
all-zero one-hot row, so no loss and no gradient (the op ignores it). A one-hot may
also pick the label's logit, `logsumexp(logits, -1) - (one_hot * logits).sum(-1)` (as
Levanter writes the loss), where such a label's loss is the log-sum-exp alone.

The label picked by fancy indexing from `(n, V)` logits, `log_softmax(logits)[
jnp.arange(n), labels]` (negated there or later) and `logsumexp(logits, -1) -
logits[jnp.arange(n), labels]`, reads its labels as XLA's gather of jnp's default mode
does: a label outside `[-V, V)` is clamped into `[0, V)` (the loss of label 0 or V - 1),
and the transposed scatter drops its gradient (none through `log_softmax`; the
log-sum-exp's alone through `lse - logit`). Optax's spelling is also matched inside a
`jax.vmap` over the leading axis (a per-example loss the user maps), whose batched
equations differ from the unbatched ones (`logsumexp` broadcasts the zero it puts in
place of a non-finite max in two steps).
"""

from __future__ import annotations

import dataclasses
import enum
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
    same_structure,
    soft_capped,
)

NAME = "linear_softmax_cross_entropy_loss"
PRIMITIVES = frozenset({"neg", "sub", "squeeze", "jit", "gather", "reduce_sum"})


def _expanded(labels: Any, expand: str) -> Any:
    return labels[..., None] if expand == "index" else jnp.expand_dims(labels, -1)


def _squeezed(picked: Any, squeeze: str) -> Any:
    if squeeze == "take":  # optax's `.take(0, axis=axis)`: index 0 of an axis of 1
        return picked.take(0, axis=-1)
    return picked[..., 0] if squeeze == "index" else picked.squeeze(-1)


def _log_softmax_by_lse(logits: Any) -> Any:
    """The log-softmax as hand-written code often spells it."""
    return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


# The log-softmax as `jax.nn` computes it, and as `logits - logsumexp(logits)`.
_LOG_SOFTMAXES: tuple[Callable[[Any], Any], ...] = (
    functools.partial(jax.nn.log_softmax, axis=-1), _log_softmax_by_lse)


def _log_softmax_spelling(expand: str, squeeze: str, log_softmax: Callable[[Any], Any]
                          ) -> Callable[[Any, Any], Any]:
    def loss(logits: Any, labels: Any) -> Any:
        log_probs = log_softmax(logits)
        return -_squeezed(jnp.take_along_axis(log_probs, _expanded(labels, expand), axis=-1),
                          squeeze)

    return loss


def _optax_spelling(expand: str, squeeze: str) -> Callable[[Any, Any], Any]:
    def loss(logits: Any, labels: Any) -> Any:
        picked = jnp.take_along_axis(logits, _expanded(labels, expand), axis=-1)
        return jax.nn.logsumexp(logits, axis=-1) - _squeezed(picked, squeeze)

    return loss


def _shifted_optax_spelling(expand: str, squeeze: str, initial: bool
                            ) -> Callable[[Any, Any], Any]:
    """`optax.softmax_cross_entropy_with_integer_labels` as optax computes it: the
    logits shifted by their (gradient-stopped) row max, `log(sum(exp(shifted)))` minus
    the label's shifted logit. `initial`: the max taken with `initial=-jnp.inf`, as
    optax's versions taking `where=` write it (a no-op on the values)."""
    def loss(logits: Any, labels: Any) -> Any:
        if initial:
            logits_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
        else:
            logits_max = jnp.max(logits, axis=-1, keepdims=True)
        shifted = logits - jax.lax.stop_gradient(logits_max)
        picked = jnp.take_along_axis(shifted, _expanded(labels, expand), axis=-1)
        log_normalizers = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
        return log_normalizers - _squeezed(picked, squeeze)

    return loss


def _log_probability_spelling(expand: str, squeeze: str, log_softmax: Callable[[Any], Any]
                              ) -> Callable[[Any, Any], Any]:
    def log_probability(logits: Any, labels: Any) -> Any:
        log_probs = log_softmax(logits)
        return _squeezed(jnp.take_along_axis(log_probs, _expanded(labels, expand), axis=-1),
                         squeeze)

    return log_probability


def _picked_log_probability_spelling(expand: str, log_softmax: Callable[[Any], Any]
                                     ) -> Callable[[Any, Any], Any]:
    def picked(logits: Any, labels: Any) -> Any:
        log_probs = log_softmax(logits)
        return jnp.take_along_axis(log_probs, _expanded(labels, expand), axis=-1)

    return picked


def _indexed(array: Any, labels: Any) -> Any:
    """`array[jnp.arange(n), labels]`, each row's label, in jnp's default mode spelled
    out: the clamping `_Labels.INDEXED_*` read is that mode's (were jnp's default another,
    the user's index would trace otherwise and not be matched)."""
    return array.at[jnp.arange(array.shape[0]), labels].get(mode="promise_in_bounds")


def _indexed_log_probability_spelling(log_softmax: Callable[[Any], Any]
                                      ) -> Callable[[Any, Any], Any]:
    def log_probability(logits: Any, labels: Any) -> Any:
        return _indexed(log_softmax(logits), labels)

    return log_probability


def _indexed_log_softmax_spelling(log_softmax: Callable[[Any], Any]
                                  ) -> Callable[[Any, Any], Any]:
    log_probability = _indexed_log_probability_spelling(log_softmax)

    def loss(logits: Any, labels: Any) -> Any:
        return -log_probability(logits, labels)

    return loss


def _indexed_logit_spelling(logits: Any, labels: Any) -> Any:
    return jax.nn.logsumexp(logits, axis=-1) - _indexed(logits, labels)


def _compared_one_hot(labels: Any, vocabulary: int) -> Any:
    """`(labels[..., None] == jnp.arange(V)).astype(jnp.float32)`, a one-hot by hand."""
    return (labels[..., None] == jnp.arange(vocabulary)).astype(jnp.float32)


def _flax_one_hot(labels: Any, vocabulary: int) -> Any:
    """`flax.training.common_utils.onehot` (Hugging Face's Flax training scripts): the
    comparison selecting `1.0` or `0.0`, cast to float32."""
    x = labels[..., None] == jnp.arange(vocabulary).reshape((1,) * labels.ndim + (-1,))
    chosen = jax.lax.select(x, jnp.full(x.shape, 1.0), jnp.full(x.shape, 0.0))
    return chosen.astype(jnp.float32)


# The one-hots of labels (each a label outside `[0, V)` makes an all-zero row):
# `jax.nn.one_hot` of float32 or bfloat16 (a narrower float holds its zeros and ones
# exactly: the product promotes it to the log-probabilities' float32), and by comparison.
_ONE_HOT_BUILDERS: tuple[Callable[[Any, int], Any], ...] = (
    functools.partial(jax.nn.one_hot, dtype=jnp.float32),
    functools.partial(jax.nn.one_hot, dtype=jnp.bfloat16),
    _compared_one_hot, _flax_one_hot)


def _one_hot_product(one_hot_first: bool, one_hot: Callable[[Any, int], Any],
                     log_softmax: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """`one_hot * log_softmax(logits)`, the one-hot built by `one_hot(labels, V)`."""
    def product(logits: Any, labels: Any) -> Any:
        one_hot_labels = one_hot(labels, logits.shape[-1])
        log_probs = log_softmax(logits)
        return one_hot_labels * log_probs if one_hot_first else log_probs * one_hot_labels

    return product


def _one_hot_logit_spelling(one_hot_first: bool, one_hot: Callable[[Any, int], Any]
                             ) -> Callable[[Any, Any], Any]:
    """`logsumexp(logits, -1) - (one_hot * logits).sum(-1)`, the label's logit picked by
    its one-hot (as Levanter writes its loss)."""
    def loss(logits: Any, labels: Any) -> Any:
        one_hot_labels = one_hot(labels, logits.shape[-1])
        picked = one_hot_labels * logits if one_hot_first else logits * one_hot_labels
        return jax.nn.logsumexp(logits, axis=-1) - picked.sum(-1)

    return loss


def _one_hot_log_probability_spelling(one_hot_first: bool, one_hot: Callable[[Any, int], Any],
                                      log_softmax: Callable[[Any], Any]
                                      ) -> Callable[[Any, Any], Any]:
    product = _one_hot_product(one_hot_first, one_hot, log_softmax)

    def log_probability(logits: Any, labels: Any) -> Any:
        return product(logits, labels).sum(-1)

    return log_probability


def _one_hot_total_spelling(one_hot_first: bool, one_hot: Callable[[Any, int], Any],
                            log_softmax: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """`-jnp.sum(one_hot * log_softmax(logits))`: every token's loss summed at once."""
    product = _one_hot_product(one_hot_first, one_hot, log_softmax)

    def loss(logits: Any, labels: Any) -> Any:
        return -product(logits, labels).sum()

    return loss


def _one_hot_spelling(one_hot_first: bool, one_hot: Callable[[Any, int], Any],
                      log_softmax: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    log_probability = _one_hot_log_probability_spelling(one_hot_first, one_hot, log_softmax)

    def loss(logits: Any, labels: Any) -> Any:
        return -log_probability(logits, labels)

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
    # A one-hot (`jax.nn.one_hot`, or by comparison): negative labels too select nothing,
    # so no loss and no gradient.
    ONE_HOT = enum.auto()
    # A one-hot picking the label's logit (`lse - (one_hot * logits).sum(-1)`): a label
    # outside `[0, V)` picks nothing, so the log-sum-exp is its loss and its gradient.
    ONE_HOT_LOGIT = enum.auto()
    # `log_softmax(logits)[jnp.arange(n), labels]`: XLA's gather clamps the label into
    # `[0, V)`, and the scatter of its transpose drops it: that loss and no gradient.
    INDEXED_LOG_PROBABILITY = enum.auto()
    # `lse - logits[jnp.arange(n), labels]`: the clamped label's loss, and the
    # log-sum-exp's gradient alone.
    INDEXED_LOGIT = enum.auto()


_INDEXED = frozenset({_Labels.INDEXED_LOG_PROBABILITY, _Labels.INDEXED_LOGIT})
_ONE_HOT_LABELS = frozenset({_Labels.ONE_HOT, _Labels.ONE_HOT_LOGIT})


@dataclasses.dataclass(frozen=True)
class _Spelling:
    """A reference spelling of the per-token loss (or its negation, `negated`), and how it
    reads its labels."""

    function: Callable[[Any, Any], Any]
    labels: _Labels
    negated: bool = False
    # The value keeps `take_along_axis`'s trailing axis of 1 (`(..., 1)`, not squeezed).
    keeps_axis: bool = False
    # The value is the sum of every token's (one reduction over all the axes).
    summed: bool = False
    # `function` is mapped by `jax.vmap` over the logits' and labels' leading axis.
    mapped: bool = False

    def enters(self, eqn: Any) -> bool:
        """Whether the labels enter the spelling at `eqn`, which holds the vocabulary: the
        fancy index's `gather`, else the jitted `take_along_axis` or `_one_hot` call, or a
        one-hot's comparison with `jnp.arange(V)`."""
        if self.labels in _INDEXED:
            return eqn.primitive.name == "gather"
        if self.labels in _ONE_HOT_LABELS and eqn.primitive.name == "eq":
            return True  # a one-hot by comparison with `jnp.arange(V)`
        name = "_one_hot" if self.labels in _ONE_HOT_LABELS else "take_along_axis"
        return eqn.primitive.name == "jit" and eqn.params.get("name") == name

    def fits(self, rank: int) -> bool:
        """Whether the spelling is written for logits of `rank` axes: `(n, V)` for the
        fancy index by `jnp.arange(n)`, a leading axis to map for `mapped`."""
        if self.labels in _INDEXED:
            return rank == 2
        return rank >= (2 if self.mapped else 1)


_FORMS = [(e, s) for e in ("index", "expand_dims") for s in ("index", "squeeze")]
# Optax's own forms of the label's logit: `take_along_axis(logits, jnp.expand_dims(labels,
# axis), axis).take(0, axis)`, as `softmax_cross_entropy_with_integer_labels` picks it.
_OPTAX_FORMS = [*_FORMS, ("expand_dims", "take")]
_LOG_PROBABILITY = _Labels.PICKED_LOG_PROBABILITY
# One-hot labels: the one-hot's factor first or second, and how it is built.
_ONE_HOTS = [(first, one_hot) for first in (True, False) for one_hot in _ONE_HOT_BUILDERS]
_SPELLINGS = {
    "neg": (*(_Spelling(_log_softmax_spelling(e, s, f), _LOG_PROBABILITY)
              for e, s in _FORMS for f in _LOG_SOFTMAXES),
            *(_Spelling(_one_hot_spelling(first, one_hot, f), _Labels.ONE_HOT)
              for first, one_hot in _ONE_HOTS for f in _LOG_SOFTMAXES),
            *(_Spelling(_one_hot_total_spelling(first, one_hot, f), _Labels.ONE_HOT, summed=True)
              for first, one_hot in _ONE_HOTS for f in _LOG_SOFTMAXES),
            *(_Spelling(_indexed_log_softmax_spelling(f), _Labels.INDEXED_LOG_PROBABILITY)
              for f in _LOG_SOFTMAXES)),
    "sub": (*(_Spelling(_optax_spelling(e, s), _Labels.PICKED_LOGIT) for e, s in _OPTAX_FORMS),
            *(_Spelling(jax.vmap(_optax_spelling(e, s)), _Labels.PICKED_LOGIT, mapped=True)
              for e, s in _OPTAX_FORMS),
            *(_Spelling(_shifted_optax_spelling(e, s, initial), _Labels.PICKED_LOGIT)
              for e, s in _FORMS for initial in (False, True)),
            _Spelling(_indexed_logit_spelling, _Labels.INDEXED_LOGIT),
            *(_Spelling(_one_hot_logit_spelling(first, one_hot), _Labels.ONE_HOT_LOGIT)
              for first, one_hot in _ONE_HOTS)),
    "gather": tuple(_Spelling(_indexed_log_probability_spelling(f),
                              _Labels.INDEXED_LOG_PROBABILITY, negated=True)
                    for f in _LOG_SOFTMAXES),
    "squeeze": tuple(_Spelling(_log_probability_spelling(e, s, f), _LOG_PROBABILITY,
                               negated=True) for e, s in _FORMS for f in _LOG_SOFTMAXES),
    "reduce_sum": tuple(_Spelling(_one_hot_log_probability_spelling(first, one_hot, f),
                                  _Labels.ONE_HOT, negated=True)
                        for first, one_hot in _ONE_HOTS for f in _LOG_SOFTMAXES),
    "jit": tuple(_Spelling(_picked_log_probability_spelling(e, f), _LOG_PROBABILITY,
                           negated=True, keeps_axis=True)
                 for e in ("index", "expand_dims") for f in _LOG_SOFTMAXES),
}


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The op's candidate of the per-token loss `eqn` ends, if it is one."""
    if graph is None or not graph.live(eqn) or len(eqn.outvars) != 1:
        return None
    (out,) = eqn.outvars
    if out.aval.dtype != jnp.float32:
        return None
    if eqn.primitive.name in ("squeeze", "gather", "reduce_sum") and any(
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
        whole = [*region, *found.equations]
        if not graph.private([e for e in whole if e is not eqn], eqn):
            return Candidate(NAME, None, "the logits are used elsewhere (a gradient traced "
                                         "inside optimize keeps them for its backward)")
        return Candidate(NAME, _function(found, spelling), inputs=(found.x, labels, found.w))
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
    logits' vocabulary read off the equation the labels enter (`_Spelling.enters`),
    `eqn` or one before it."""
    out_shape = tuple(eqn.outvars[0].aval.shape)
    # The tokens' shape (`None` for a sum over them: read off the logits).
    shape = None if spelling.summed else out_shape[:-1] if spelling.keeps_axis else out_shape
    seen = []
    stack, visited = list(eqn.outvars), set[Any]()
    while stack and len(visited) < 64:
        var = stack.pop()
        producer = graph.producer(var)
        if producer is None or id(producer) in visited:
            continue
        visited.add(id(producer))
        if spelling.enters(producer):
            seen.extend(_entry_avals(graph, producer, spelling, shape))
            continue
        stack.extend(producer.invars)
    return list(dict.fromkeys(seen))


def _entry_avals(graph: Graph, entry: Any, spelling: _Spelling,
                 shape: tuple[int, ...] | None) -> list[tuple[tuple[tuple[int, ...], Any], ...]]:
    """The `(logits, labels)` shapes and dtypes read off `entry`, the equation the labels
    enter: `take_along_axis`'s and the fancy index's array is the logits (or their
    log-softmax, of their shape), `_one_hot`'s result has their shape. `shape` is the
    tokens' (`None`: any)."""
    logits = (entry.outvars if spelling.labels in _ONE_HOT_LABELS else entry.invars)[0]
    logits_shape = tuple(logits.aval.shape)
    # A one-hot's dtype may be narrower than the logits': a loss matched is float32, and
    # so are its logits (the op's).
    dtype = jnp.float32 if spelling.labels in _ONE_HOT_LABELS else logits.aval.dtype
    if shape is None:
        shape = logits_shape[:-1]
    if logits_shape[:-1] != shape or not spelling.fits(len(logits_shape)):
        return []
    indices = entry.invars[-1]  # the labels, or the fancy index's rows and labels
    dtypes = (_index_dtypes(graph, indices) if spelling.labels in _INDEXED
              else [indices.aval.dtype])
    return [((logits_shape, dtype), (shape, label_dtype)) for label_dtype in dtypes
            if jnp.issubdtype(label_dtype, jnp.integer)]


def _index_dtypes(graph: Graph, indices: Any) -> list[Any]:
    """The dtypes of the values a fancy index's `indices` are made from, a few equations
    back: jnp converts the labels to the rows' integer type before pairing them, so the
    labels' own dtype is among these."""
    dtypes = [indices.aval.dtype]
    stack, visited = [indices], 0
    while stack and visited < 16:
        producer = graph.producer(stack.pop())
        if producer is None:
            continue
        visited += 1
        operands = [v for v in producer.invars if not isinstance(v, Literal)]
        dtypes.extend(v.aval.dtype for v in operands)
        stack.extend(operands)
    return list(dict.fromkeys(dtypes))


@dataclasses.dataclass(frozen=True)
class _LogitsMatmul:
    """The logits' product `x @ w` (`x @ w.T` where `transposed`: a `(V, H)` `w`, as a
    tied embedding is), its precision and soft cap (`None`: none), and its equations
    from the product to the logits."""

    x: Any
    w: Any
    precision: Any
    cap: float | None
    transposed: bool
    equations: list[Any]
    # The `slice` equation taking some tokens' logits (`logits[:, :-1]`), or `None`.
    tokens: Any = None


def _logits_matmul(graph: Graph, logits: Any) -> _LogitsMatmul | None:
    """The product `logits` are, possibly cast to float32, then possibly soft-capped
    (`cap * tanh(logits / cap)`); possibly sliced along the tokens' axes, the whole
    vocabulary kept, last or before the cast (`logits[..., :-1, :]`, the next-token loss
    of Hugging Face's training scripts: the op takes the tokens' rows of `x`)."""
    plumbing: list[Any] = []
    tokens = _token_slice(graph, logits)
    if tokens is not None:
        logits = tokens.invars[0]
    cap = None
    capped = soft_capped(graph, logits)
    if capped is not None:
        logits, cap, eqns = capped
        plumbing += eqns
    convert = graph.producer(logits, "convert_element_type")
    if convert is not None:
        plumbing.append(convert)
        logits = convert.invars[0]
    if tokens is None and cap is None:
        tokens = _token_slice(graph, logits)
        if tokens is not None:
            logits = tokens.invars[0]
    transposed = False
    dot = dense_matmul(graph, logits)
    if dot is None:
        transposed = True
        dot = dense_matmul(graph, logits, transposed=True)
    if dot is None:
        return None
    x, w = dot.invars
    # The op rounds the logits to the inputs' dtype, as a product without a wider
    # `preferred_element_type` does.
    if x.aval.dtype != w.aval.dtype or dot.outvars[0].aval.dtype != x.aval.dtype:
        return None
    equations = [*plumbing, dot] + ([] if tokens is None else [tokens])
    return _LogitsMatmul(x, w, dot.params["precision"], cap, transposed, equations, tokens)


def _token_slice(graph: Graph, var: Any) -> Any:
    """The `slice` equation making `var` that keeps the whole last axis (the vocabulary),
    else `None`."""
    eqn = graph.producer(var, "slice")
    if eqn is None:
        return None
    vocabulary = eqn.invars[0].aval.shape[-1]
    if (eqn.params["start_indices"][-1] != 0 or eqn.params["limit_indices"][-1] != vocabulary
            or (eqn.params["strides"] or (1,))[-1] != 1):
        return None
    return eqn


def _function(product: _LogitsMatmul, spelling: _Spelling) -> Callable[[Any, Any, Any], Any]:
    precision, cap, transposed = product.precision, product.cap, product.transposed

    def function(x: Any, labels: Any, w: Any) -> Any:
        from tokamax_kernels.linear_softmax_cross_entropy_loss.api import (
            linear_softmax_cross_entropy_loss,
        )

        # The op takes `(H, V)` weights: a `(V, H)` one is passed transposed (the op has
        # no layout of its own for it), so its gradient arrives in its own layout.
        w = w.T if transposed else w
        if product.tokens is not None:
            x = _token_rows(x, product.tokens.params)
        labels = labels.astype(jnp.int32)
        outside = _outside(labels, w.shape[-1])
        op_labels, nan = _labels_for_op(spelling.labels, labels, outside, w.shape[-1])
        losses = linear_softmax_cross_entropy_loss(x, op_labels, w, reduction="none",
                                                   logits_soft_cap=cap, precision=precision)
        if nan is not None:
            losses = losses + jnp.where(nan, jnp.nan, 0.0)
        if spelling.labels in _INDEXED:
            losses = _clamped_gradient(spelling.labels, losses, outside, x, w, op_labels,
                                       precision, cap)
        if spelling.labels is _Labels.ONE_HOT_LOGIT:  # label 0's loss, its logit added back
            picks_nothing = outside | (labels < 0)
            losses = losses + jnp.where(
                picks_nothing, _label_logits(x, w, op_labels, precision, cap), 0.0)
        losses = -losses if spelling.negated else losses
        if spelling.summed:
            return losses.sum()
        return losses[..., None] if spelling.keeps_axis else losses

    return function


def _token_rows(x: Any, params: dict[str, Any]) -> Any:
    """The rows of `x` whose logits a `slice` of them with `params` takes."""
    strides = params["strides"]
    return jax.lax.slice(x, (*params["start_indices"][:-1], 0),
                         (*params["limit_indices"][:-1], x.shape[-1]),
                         None if strides is None else (*strides[:-1], 1))


def _outside(labels: Any, vocabulary: int) -> Any:
    """The labels no index reaches, even counting from the end: outside `[-V, V)`."""
    return (labels < -vocabulary) | (labels >= vocabulary)


def _labels_for_op(read: _Labels, labels: Any, outside: Any, vocabulary: int
                   ) -> tuple[Any, Any]:
    """`(labels, nan)`: the op's labels giving the loss and gradient the spelling gives
    (the op ignores a negative label and gives a label >= V a NaN loss and its
    log-sum-exp's gradient; a fancy index's clamped label then has its gradient fixed
    by `_clamped_gradient`, and a one-hot's label picking no logit is given label 0,
    whose logit is added back), and the tokens whose loss must be made NaN besides
    (`None`: none). `outside`: the labels outside `[-V, V)` (`_outside`)."""
    if read is _Labels.ONE_HOT:
        return jnp.where(outside | (labels < 0), -1, labels), None
    if read is _Labels.ONE_HOT_LOGIT:
        return jnp.where(outside | (labels < 0), 0, labels), None
    wrapped = jnp.where(labels < 0, labels + vocabulary, labels)
    if read in _INDEXED:
        return jnp.clip(wrapped, 0, vocabulary - 1), None
    if read is _Labels.PICKED_LOGIT:
        return jnp.where(outside, vocabulary, wrapped), None
    return jnp.where(outside, -1, wrapped), outside


def _clamped_gradient(read: _Labels, losses: Any, outside: Any, x: Any, w: Any,
                      labels: Any, precision: Any, cap: float | None) -> Any:
    """`losses` of the clamped `labels`, with the gradient a fancy index gives the tokens
    `outside`: none through `log_softmax`; the log-sum-exp's alone through `lse - logit`,
    the label logit's gradient (which the op's loss subtracts) added back by a term of
    value zero. That term reads each token's column of `w` (`n x H`), and its gradient
    is one more `w`-sized array in the backward."""
    if read is _Labels.INDEXED_LOG_PROBABILITY:
        return jnp.where(outside, jax.lax.stop_gradient(losses), losses)
    logits = _label_logits(x, w, labels, precision, cap)
    return losses + jnp.where(outside, logits - jax.lax.stop_gradient(logits), 0.0)


def _label_logits(x: Any, w: Any, labels: Any, precision: Any, cap: float | None) -> Any:
    """Each token's (float32, soft-capped) logit of its label in `[0, V)`: a column of `w`
    a token (`n x H` read), whose gradient is one more `w`-sized array in the backward."""
    logits = jnp.einsum("...h,...h->...", x, w.T[labels], precision=precision)
    logits = logits.astype(jnp.float32)
    return logits if cap is None else cap * jnp.tanh(logits / cap)
