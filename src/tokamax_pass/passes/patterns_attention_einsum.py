"""`"attention"`: attention written out in plain JAX,
`softmax(scale * q @ k^T [+ bias] [soft cap] [masked]) @ v`, replaced by the
`dot_product_attention` op.

Matched at the second product (or at the division after it, where the softmax's
numerators `exp(l - max)` meet the values unnormalized and the product is divided by
their row sums, as MaxText's `compute_local_attention` does), from the equations JAX
traces them to, so any spelling that traces alike is one: `jnp.einsum` or
`@`/`jnp.matmul`, any layout (each batch axis, heads included, shared by q, k and v; one
query, one key and one feature axis), the scale a number multiplying (or dividing) the
logits or q, a `bias` added to the logits (also before the scale, `(q @ k^T + bias) *
scale`: the op is given the bias scaled) or subtracted from them (`logits - bias`: the
op is given `-bias`, exactly), a Gemma-2 soft cap `cap * tanh(logits / cap)`, a mask
applied last by `jnp.where(mask, logits, fill)` (the mask boolean, or numbers kept where
nonzero, as Flax's float32 masks cast from a boolean are) with `fill` `-inf` or at most
`-1e9` (or several in turn, one fill for all: the keys every one keeps) or added as a
bias of 0 and a fill that swallows the logits (`additive_mask`: Hugging Face's Flax
models), the scale also after the mask where no bias or soft cap is under it and the
scaled fill is still at most `-1e9`, then `jax.nn.softmax` (or `exp(l - max) / sum`, or
`exp(jax.nn.log_softmax(l))`) over the keys, or `jax.nn.softmax(l, where=mask)` of a
boolean mask (taken as the op's mask; alone: beside another, a row the other hides whole
gets its fill, not `where=`'s zeros), possibly cast before the second product. The op's
logits are float32, its probabilities and result in the values' dtype: what rounds
otherwise is a near-miss (probabilities wider than the values at the product, as a
float32 softmax against bfloat16 values gives: the product is then float32, the op's
bfloat16; probabilities rounded to a narrower type on the way; logits rounded by a
narrower `preferred_element_type` of `q . k`; the second product's result of another
type than the values'). The op takes the products' `precision`; products of different
precisions are a near-miss. The scale may be spelled as arithmetic on numbers (`1 /
jnp.sqrt(64.0)`), the logits cast to a wider float type for the softmax
(`.astype(jnp.float32)`), and q and k cast to a wider one from the values' before the
product. The logits may come out of the product transposed (as `jnp.einsum` writes
them). Grouped-query attention: q may have more free axes than the query rows (`(...,
kv_heads, group, head_dim)` against un-repeated k and v), which become the op's query
heads; keys and values repeated (`jnp.repeat`) are taken as repeated. The logits of such
a product may be reshaped between the two products, as Gemma's reference code does:
merged after the first (`(B, T, K, G, S)` to `(B, T, K * G, S)`, or `(B, K, G, T, S)` to
`(B, K * G, T, S)`), soft-capped, masked and softmaxed so, and the probabilities
reshaped back to the product's shape before the second (the keys' axis kept as it is:
the softmax then reads the same rows).

A mask that is a band of key offsets built from indices (`band_mask`), where every query
row sees a key, becomes `is_causal` and `local_window_size` (masks applied in turn that
are all bands, their shared band); any other mask is passed as an array (several: each,
and the op is given the keys all of them keep). A query row whose keys the mask all
hides gets plain JAX's value there: the mean of the values for a finite fill, NaN for
`-inf` (also a fill the scale after the mask overflows to it), zeros for the softmax's
`where=`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_pass.passes import additive_mask, band_mask
from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import (
    Graph,
    literal_value,
    reference_jaxpr,
    rounds,
    same_structure,
    scalar_constant,
    soft_capped,
)

NAME = "attention"
PRIMITIVES = frozenset({"dot_general", "div"})
_LARGEST_FILL = -1e9


def _softmax(logits: Any) -> Any:
    return jax.nn.softmax(logits, axis=-1)


def _softmax_written_out(logits: Any) -> Any:
    e = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax_written_out_max_stopped(logits: Any) -> Any:
    """The written-out softmax with the max's gradient stopped, as `jax.nn.softmax` does."""
    e = jnp.exp(logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True)))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax_in_log_space(logits: Any) -> Any:
    """The softmax as the exponential of the log-probabilities."""
    return jnp.exp(jax.nn.log_softmax(logits, axis=-1))


_SOFTMAXES = (_softmax, _softmax_written_out, _softmax_written_out_max_stopped,
              _softmax_in_log_space)


def _exponentials(logits: Any) -> Any:
    """The softmax's numerators, `exp(l - max)`, left unnormalized (MaxText's
    `compute_local_attention` divides the second product by their sums instead)."""
    return jnp.exp(logits - logits.max(axis=-1, keepdims=True))


def _exponentials_max_stopped(logits: Any) -> Any:
    return jnp.exp(logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True)))


def _softmax_where(logits: Any, mask: Any) -> Any:
    """`jax.nn.softmax` over the keys a boolean `mask` keeps: 0 for the keys it hides, and
    for every key of a row it hides whole."""
    return jax.nn.softmax(logits, axis=-1, where=mask)


@dataclasses.dataclass
class _Attention:
    """What a matched attention computes, and the equations it spans.

    `axes` names each axis of the logits (and probabilities): `("batch", i)` for the
    product's `i`-th batch axis (shared by q, k and v), `("query", a)` for q's free axis
    `a` (the query rows, and grouped-query heads that share a key), `("key", a)` for k's
    free axis `a`, always last."""

    query: Any = None
    key: Any = None
    value: Any = None
    bias: Any = None
    # What the bias is multiplied by: the scale of `(q @ k^T + bias) * scale`.
    bias_scale: float = 1.0
    # `(condition, negated)` of each `jnp.where` applied in turn: a key is kept where
    # every condition (negated where `negated`) holds.
    masks: list[tuple[Any, bool]] = dataclasses.field(default_factory=list)
    fill: float = 0.0
    # Whether the mask was added to the logits as a bias (`additive_mask`): a row it hides
    # whole then has autodiff's gradient through the logits.
    additive: bool = False
    # Whether the mask was given to the softmax (`jax.nn.softmax(l, where=mask)`): a row it
    # hides whole then has zero probabilities, a zero result and no gradient.
    softmax_where: bool = False
    scale: float = 1.0
    soft_cap: float | None = None
    band: band_mask.Band | None = None
    is_causal: bool = False
    local_window_size: tuple[int, int] | None = None
    axes: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    # The shape the logits are reshaped to between the products (masks and biases are
    # of that shape), or `None` where they keep the product's shape.
    merged_shape: tuple[int, ...] | None = None
    preferred_row: int | None = None  # the query axis to take as the rows, if any
    # Why a spelling read as far as its bias is not the op's: said once the logits are
    # known to be `q . k`, so other functions are not listed as attention near-misses.
    left_alone: str | None = None
    query_numbers: Any = None  # (batch axes, contracting axis) of q
    key_numbers: Any = None  # (batch axes, contracting axis) of k
    value_numbers: Any = None  # ({logits axis: v axis} of the batch axes, keys, features)
    row: int = 0  # the logits axis of the query rows
    precision: Any = None  # the `q . k` product's (the second product's must match)
    probabilities: Any = None  # the softmax's output, before any cast
    # The probabilities' dtype out of the softmax, after each cast on the way to the
    # second product (the last: at the product).
    probability_dtypes: tuple[Any, ...] = ()
    output_axes: list[Any] = dataclasses.field(default_factory=list)
    region: list[Any] = dataclasses.field(default_factory=list)


class _NoMatch(Exception):
    """The equations are no attention."""


class _LeftAlone(Exception):
    """The equations are an attention the op computes otherwise (the message says how)."""


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The op's candidate of the attention whose second product is `eqn`, or whose second
    product of unnormalized probabilities `eqn` divides by their sums, if it is one."""
    if graph is None or not graph.live(eqn):
        return None
    try:
        if eqn.primitive.name == "div":
            attention, product, reshaped = _parse_normalized_after(eqn, graph)
        else:
            attention, product, reshaped = _parse(eqn, graph), eqn, []
    except _NoMatch:
        return None
    except _LeftAlone as refusal:
        return Candidate(NAME, None, str(refusal))
    if not graph.private([e for e in attention.region if e is not eqn], eqn):
        return Candidate(NAME, None, "values inside the attention are used elsewhere (a "
                                     "gradient traced inside optimize keeps them for its "
                                     "backward)")
    rounding = _rounded_otherwise(attention, product)
    if rounding is not None:
        return Candidate(NAME, None, rounding)
    if product.params["precision"] != attention.precision:
        return Candidate(NAME, None, f"the products' precisions differ ({attention.precision} "
                                     f"and {product.params['precision']}); the op takes one")
    arrays = [attention.query, attention.key, attention.value]
    arrays += [a for a in (attention.bias,) if a is not None]
    arrays += [condition for condition, _ in attention.masks]
    out = product.outvars[0].aval
    compute = functools.partial(_compute, attention, tuple(out.shape), out.dtype)
    if reshaped:
        compute = functools.partial(_shaped, compute, reshaped)
    return Candidate(NAME, compute, inputs=tuple(arrays))


def _parse(root: Any, graph: Graph,
           read_softmax: Callable[[Graph, Any, list[Any]], tuple[Any, Any]] | None = None
           ) -> _Attention:
    """The attention whose second product is `root`; `read_softmax` reads the logits (and
    a mask given to the softmax) back from the probabilities (`_softmax_input`)."""
    read_softmax = read_softmax or _softmax_input
    attention = _Attention(region=[root])
    ((lc, rc), (lb, rb)) = root.params["dimension_numbers"]
    for first, (probabilities, value) in enumerate((root.invars, root.invars[::-1])):
        rank = len(probabilities.aval.shape)
        p_contract, v_contract = (lc, rc) if first == 0 else (rc, lc)
        p_batch, v_batch = (lb, rb) if first == 0 else (rb, lb)
        if rank < 2 or tuple(p_contract) != (rank - 1,) or len(v_contract) != 1:
            continue
        if len(value.aval.shape) != len(p_batch) + 2:
            continue
        uncast = _uncast(graph, probabilities, attention.region)
        unmerged = _unmerged(graph, uncast, attention.region)
        softmaxed = _uncast(graph, unmerged, attention.region)
        softmax_input, softmax_mask = read_softmax(graph, softmaxed, attention.region)
        if softmax_input is None:
            continue
        attention.probabilities = softmaxed
        attention.probability_dtypes = tuple(
            jnp.dtype(v.aval.dtype) for v in (softmaxed, uncast, probabilities))
        attention.value = value
        _logits(graph, attention, softmax_input, softmax_mask)
        if (unmerged is uncast) != (attention.merged_shape is None):
            raise _NoMatch  # the logits reshaped, the probabilities not back (or the reverse)
        if unmerged is not uncast and tuple(uncast.aval.shape) != tuple(
                _sizes(attention, attention.query.aval, attention.key.aval)):
            raise _NoMatch  # the probabilities reshaped to another shape than the product's
        batch = {j for j, (role, _) in enumerate(attention.axes) if role == "batch"}
        if set(p_batch) != batch:
            raise _NoMatch
        (v_keys,) = v_contract
        v_features = next(a for a in range(len(value.aval.shape))
                          if a not in (*v_batch, v_keys))
        attention.value_numbers = (dict(zip(p_batch, v_batch, strict=True)), v_keys,
                                   v_features)
        rows = [j for j, (role, _) in enumerate(attention.axes) if role == "query"]
        # The second product's output: its batch axes, then p's free axes and v's (or
        # v's first where v is the product's first operand).
        if first == 0:
            attention.output_axes = [*p_batch, *rows, "features"]
        else:
            attention.output_axes = [*p_batch, "features", *rows]
        return attention
    raise _NoMatch


def _parse_normalized_after(root: Any, graph: Graph) -> tuple[_Attention, Any, list[Any]]:
    """`(attention, second product, reshapes)` where `root` divides the product of the
    softmax's numerators `exp(l - max)` and the values, possibly transposed and reshaped
    (`reshapes`, in order), by the numerators' row sums, each element by its own row's
    (MaxText's `compute_local_attention`, normalized after the product: the op's result,
    rounded otherwise)."""
    numerator, denominator = root.invars
    if tuple(numerator.aval.shape) != tuple(root.outvars[0].aval.shape):
        raise _NoMatch
    reshapes, product_out = _moved(graph, numerator, ("transpose", "reshape"))
    product = graph.producer(product_out, "dot_general")
    if product is None:
        raise _NoMatch
    attention = _parse(product, graph, _exponentials_input)
    exponentials = attention.probabilities
    spread, sums = _moved(graph, denominator, ("transpose", "reshape", "broadcast_in_dim"))
    total = graph.producer(sums, "reduce_sum")
    if (attention.merged_shape is not None or total is None
            or total.invars[0] is not exponentials
            or tuple(total.params["axes"]) != (len(exponentials.aval.shape) - 1,)):
        raise _NoMatch
    if not _rows_line_up(attention, product, reshapes, spread, root):
        raise _NoMatch
    attention.region.extend([*reshapes, *spread, total])
    return attention, product, reshapes


def _exponentials_input(graph: Graph, var: Any, region: list[Any]) -> tuple[Any, Any]:
    """`(logits, None)` where `var` is `exp(logits - max)` over the keys, else
    `(None, None)`."""
    for spelling in (_exponentials, _exponentials_max_stopped):
        reference = reference_jaxpr(spelling, (tuple(var.aval.shape), var.aval.dtype))
        inputs = _spelled_as(graph, var, reference, region)
        if inputs is not None:
            return inputs[0], None
    return None, None


def _moved(graph: Graph, var: Any, primitives: tuple[str, ...]) -> tuple[list[Any], Any]:
    """`(equations, source)` where `var` is `source` moved by `equations` (in order), each
    one of `primitives`, which move or repeat values but change none."""
    moves = []
    while (eqn := graph.producer(var, *primitives)) is not None:
        if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
            break
        moves.append(eqn)
        var = eqn.invars[0]
    return moves[::-1], var


def _rows_line_up(attention: _Attention, product: Any, reshapes: list[Any],
                  spread: list[Any], root: Any) -> bool:
    """Whether each element of the product that `root` divides meets the sum of its own
    row of the probabilities: the logits rows numbered, moved as the product's rows and
    as the sums are, agree wherever the sums are not repeated across the features."""
    rows_shape = tuple(attention.probabilities.aval.shape[:-1])
    rows = np.arange(math.prod(rows_shape)).reshape(rows_shape)
    logit_axes = [a for a in attention.output_axes if a != "features"]
    by_product = np.broadcast_to(
        np.expand_dims(np.transpose(rows, logit_axes), attention.output_axes.index("features")),
        product.outvars[0].aval.shape)
    numerator, denominator = _replayed(reshapes, by_product), _replayed(spread, rows)
    out_shape = tuple(root.outvars[0].aval.shape)
    if numerator is None or denominator is None or denominator.ndim != len(out_shape):
        return False
    repeated = [a for a, (size, full) in enumerate(zip(denominator.shape, out_shape,
                                                       strict=True)) if size != full]
    if any(denominator.shape[a] != 1 or numerator.strides[a] != 0 for a in repeated):
        return False  # the sums repeat along an axis the product's rows do not
    first = tuple(slice(0, 1) if a in repeated else slice(None) for a in range(len(out_shape)))
    return bool(np.array_equal(numerator[first], denominator))


def _replayed(moves: list[Any], x: np.ndarray) -> np.ndarray | None:
    """`x` moved as the equations `moves` (`_moved`) move their operand, as NumPy views (a
    repeated axis stays repeated: stride 0); `None` where a reshape would copy."""
    for eqn in moves:
        name, params = eqn.primitive.name, eqn.params
        if name == "transpose":
            x = np.transpose(x, params["permutation"])
        elif name == "broadcast_in_dim":
            kept = params["broadcast_dimensions"]
            x = x.reshape([x.shape[kept.index(a)] if a in kept else 1
                           for a in range(len(params["shape"]))], copy=False)
            x = np.broadcast_to(x, params["shape"])
        else:
            try:
                x = np.reshape(x, params["new_sizes"], copy=False)
            except ValueError:
                return None
    return x


def _shaped(compute: Callable[..., Any], reshapes: list[Any], *arrays: Any) -> Any:
    """`compute(*arrays)` moved as the equations `reshapes` move their operand."""
    out = compute(*arrays)
    for eqn in reshapes:
        out = eqn.primitive.bind(out, **eqn.params)
    return out


def _unmerged(graph: Graph, var: Any, region: list[Any]) -> Any:
    """`var` before a reshape that keeps its last axis (the keys), else `var`."""
    reshape = graph.producer(var, "reshape")
    if (reshape is None or reshape.params.get("dimensions") is not None
            or not var.aval.shape or not reshape.invars[0].aval.shape
            or var.aval.shape[-1] != reshape.invars[0].aval.shape[-1]):
        return var
    region.append(reshape)
    return reshape.invars[0]


def _is_product(graph: Graph, var: Any) -> bool:
    """Whether `var` is the `q . k` product, possibly cast wider or reshaped after."""
    return _product(graph, _unwidened(graph, _unmerged(graph, var, []), []))[0] is not None


def _uncast(graph: Graph, var: Any, region: list[Any]) -> Any:
    """`var` before a cast from another float type (the probabilities' `.astype(v.dtype)`)."""
    cast = graph.producer(var, "convert_element_type")
    if cast is None or not all(jnp.issubdtype(a.aval.dtype, jnp.floating)
                               for a in (cast.invars[0], var)):
        return var
    region.append(cast)
    return cast.invars[0]


def _unwidened(graph: Graph, var: Any, region: list[Any]) -> Any:
    """The logits `var` before a cast to a wider float type (`.astype(jnp.float32)`), which
    the op's float32 logits make no difference to; a narrowing cast rounds them, which the
    op would not, so it is not read through."""
    cast = graph.producer(var, "convert_element_type")
    if cast is None:
        return var
    before, after = jnp.dtype(cast.invars[0].aval.dtype), jnp.dtype(var.aval.dtype)
    if not (jnp.issubdtype(before, jnp.floating) and jnp.issubdtype(after, jnp.floating)
            and not rounds(before, after)):
        return var
    region.append(cast)
    return cast.invars[0]


def _softmax_input(graph: Graph, probabilities: Any, region: list[Any]
                   ) -> tuple[Any, Any]:
    """`(logits, mask)` of a softmax (`_SOFTMAXES`, or `_softmax_where` of a boolean
    `mask`, else `None` for it) making `probabilities`; `(None, None)` for no softmax."""
    for softmax in _SOFTMAXES:
        reference = reference_jaxpr(softmax, (tuple(probabilities.aval.shape),
                                              probabilities.aval.dtype))
        inputs = _spelled_as(graph, probabilities, reference, region)
        if inputs is not None:
            return inputs[0], None
    return _softmax_where_input(graph, probabilities, region)


def _spelled_as(graph: Graph, var: Any, reference: Any, region: list[Any]
                ) -> list[Any] | None:
    """The user's values bound to `reference`'s inputs, in order, where `var` is computed
    as `reference` computes its output (its equations added to `region`); else `None`."""
    bound: dict[Any, Any] = {}
    found: list[Any] = []
    if not same_structure(graph, var, reference, reference.outvars[0], bound, found):
        return None
    region.extend({id(e): e for e in found}.values())
    return [bound.get(v) for v in reference.invars]


def _softmax_where_input(graph: Graph, probabilities: Any, region: list[Any]
                         ) -> tuple[Any, Any]:
    """`(logits, mask)` where `probabilities` is `jax.nn.softmax(logits, axis=-1,
    where=mask)` of a boolean `mask` (read from its last `jnp.where(mask, p, 0)`, whose
    shape the reference is traced at), else `(None, None)`."""
    where = graph.producer(probabilities, "jit")
    if where is None or where.params.get("name") != "_where" or len(where.invars) != 3:
        return None, None
    mask = where.invars[0]
    if mask.aval.dtype != jnp.bool_:
        return None, None
    reference = reference_jaxpr(_softmax_where, (tuple(probabilities.aval.shape),
                                                 probabilities.aval.dtype),
                                (tuple(mask.aval.shape), mask.aval.dtype))
    matched: list[Any] = []
    inputs = _spelled_as(graph, probabilities, reference, matched)
    if inputs is None or inputs[1] is not mask:
        return None, None
    region.extend(matched)
    return inputs[0], mask


def _product(graph: Graph, var: Any) -> tuple[Any, Any]:
    """`(dot_general, transpose)` making `var`: a product, possibly transposed after (as
    `jnp.einsum` writes an output order the product does not give), or `(None, None)`."""
    product, transpose = graph.producer(var, "dot_general"), None
    if product is None:
        transpose = graph.producer(var, "transpose")
        if transpose is not None:
            product = graph.producer(transpose.invars[0], "dot_general")
    if product is None or any(rounds(a.aval.dtype, product.outvars[0].aval.dtype)
                              for a in product.invars):
        return None, None  # none, or one rounding its logits (a narrower result type)
    return product, transpose


def _rounded_otherwise(attention: _Attention, product: Any) -> str | None:
    """Why the op, which multiplies the probabilities in the values' dtype (rounding them
    to it) and returns that product in it, would round otherwise than the equations
    matched, or `None` where it would not."""
    values = jnp.dtype(attention.value.aval.dtype)
    if not jnp.issubdtype(values, jnp.floating):
        return None
    *on_the_way, at_product = attention.probability_dtypes
    if jnp.finfo(at_product).bits > jnp.finfo(values).bits:
        return (f"the probabilities meet the values in {at_product}, wider than the "
                f"values' {values}, which the op would round them to")
    rounded = [d for d in on_the_way if rounds(values, d)]
    if rounded:
        return (f"the probabilities are rounded to {rounded[0]} before they meet the "
                f"values' {values}; the op's are not")
    out = jnp.dtype(product.outvars[0].aval.dtype)
    if out != values:
        return (f"the second product's result is {out}, the op's the values' {values} "
                "(preferred_element_type)")
    return None


def _logits(graph: Graph, attention: _Attention, logits: Any, softmax_mask: Any = None
            ) -> None:
    """Reads the mask, soft cap, bias and scale back to the `q . k` product; a cast of the
    logits to a wider float type (`.astype(jnp.float32)` for the softmax) after the
    product, scale, bias or mask is read through, the op computing them in float32
    anyway. `softmax_mask`: the mask given to the softmax (`where=`), if any."""
    shape = tuple(logits.aval.shape)
    logits = _unwidened(graph, logits, attention.region)
    after_mask, scaled_dtype = 1.0, logits.aval.dtype
    scaled = _scaled_after_mask(graph, attention, logits)
    if scaled is not None:
        after_mask, logits = scaled
        logits = _unwidened(graph, logits, attention.region)
    bands: list[band_mask.Band | None] = []
    while (where := graph.producer(logits, "jit")) is not None and where.params.get(
            "name") == "_where":
        if len(where.invars) != 3:
            raise _NoMatch  # `jnp.where` differentiated in forward mode
        condition, on_true, on_false = where.invars
        if tuple(on_true.aval.shape) == shape and literal_value(on_false) is not None:
            negated, fill, logits = False, literal_value(on_false), on_true
        elif tuple(on_false.aval.shape) == shape and literal_value(on_true) is not None:
            negated, fill, logits = True, literal_value(on_true), on_false
        else:
            raise _NoMatch
        condition = _boolean(graph, condition, attention.region)
        if condition is None or not float(fill) <= _LARGEST_FILL:
            raise _NoMatch
        if attention.masks and float(fill) != attention.fill:
            raise _NoMatch  # masks of different fills hide different values
        attention.fill = float(fill)
        attention.masks.append((condition, negated))
        attention.region.append(where)
        bands.append(band_mask.band(graph, condition, shape, negated=negated))
        logits = _unwidened(graph, logits, attention.region)
    capped = _soft_cap(graph, attention, logits)
    if capped is not None:
        logits = capped
    logits = _scaled_sum(graph, attention, logits)
    add = graph.producer(logits, "add", "sub")
    in_turn = None
    if add is not None:
        for body, bias in _operand_orders(add):
            if (tuple(body.aval.shape) == shape and literal_value(bias) is None
                    and (graph.producer(_unwidened(graph, body, []), "mul", "div") is not None
                         or _is_product(graph, body))):
                # A product scaled in bf16, widened by the float32 bias it meets.
                attention.bias, logits = bias, _unwidened(graph, body, attention.region)
                if add.primitive.name == "sub":  # `logits - b`: the bias `-b`, exactly
                    attention.bias_scale = -attention.bias_scale
                attention.region.append(add)
                break
        else:
            logits, in_turn = _mask_biases_added_in_turn(graph, attention, add, shape)
        if attention.soft_cap is None and attention.bias is not None:
            _additive_mask(graph, attention, bands, shape, in_turn)
        if in_turn is not None and not attention.additive and attention.left_alone is None:
            raise _NoMatch  # the mask stays a bias beside the other: the op takes one bias
    if softmax_mask is not None:
        _softmax_where_mask(graph, attention, softmax_mask, bands, shape)
    attention.band = band_mask.intersection(bands)
    if after_mask != 1.0:
        if attention.bias is not None or attention.soft_cap is not None:
            raise _NoMatch  # the scale would apply to the bias or cap too: not the op's
        with np.errstate(over="ignore"):
            fill = np.asarray(attention.fill, scaled_dtype) * np.asarray(after_mask, scaled_dtype)
        if not fill <= _LARGEST_FILL:
            raise _NoMatch  # the scaled fill no longer hides its keys
        attention.scale *= after_mask
        attention.fill = float(fill)  # `-inf` where the scale overflows it: NaN rows
    logits = _unwidened(graph, _scaled(graph, attention, logits), attention.region)
    unmerged = _unmerged(graph, logits, attention.region)
    if unmerged is not logits:
        attention.merged_shape = shape
        logits = _unwidened(graph, _scaled(graph, attention, unmerged), attention.region)
    product, transpose = _product(graph, logits)
    if product is None:
        raise _NoMatch
    attention.region += [e for e in (product, transpose) if e is not None]
    attention.precision = product.params["precision"]
    _operands(graph, attention, product, transpose)
    if attention.left_alone is not None:
        raise _LeftAlone(attention.left_alone)
    if attention.merged_shape is not None:
        _unmerge_band(attention, tuple(logits.aval.shape))
        shape = tuple(logits.aval.shape)
    _mask_as_band(attention, shape)


def _additive_mask(graph: Graph, attention: _Attention, bands: list[band_mask.Band | None],
                   shape: tuple[int, ...], in_turn: additive_mask.AdditiveMask | None = None
                   ) -> None:
    """A bias that spells a mask with a fill swallowing the logits (`additive_mask`) taken
    as the op's mask, the rest of the bias (if any) staying its bias. A smaller fill
    (`-1e9` in float32, rounding the logits to multiples of 64; Keras 3's `-1e9` in
    bfloat16, `-3e4` in float16; any at or below the kernels' floor) leaves a row it
    hides whole a softmax of the logits it rounds, which the op does not compute (its
    float32 logits round less, its kernels hold logits below the floor); masks applied
    by `jnp.where` too stop the gradient of some of those keys. `in_turn`: the mask and
    the other bias read from two sums (`_mask_biases_added_in_turn`), else the mask is
    read from the bias."""
    if attention.bias_scale <= 0:
        return
    found = in_turn or additive_mask.read(graph, attention.bias)
    dtype, scale = attention.bias.aval.dtype, attention.bias_scale
    if found is None:
        fill = additive_mask.data_mask_fill(graph, attention.bias)
        if fill is not None and additive_mask.keeps_hidden_logits(fill, dtype, scale):
            attention.left_alone = (
                f"the bias is a mask read from the data times {fill:g}, "
                f"{_data_mask_fill(fill * scale, fill, dtype)}")
        return
    fill = found.fill * scale
    if not additive_mask.swallows(fill):
        if additive_mask.keeps_hidden_logits(found.fill, dtype, scale):
            attention.left_alone = (f"the bias hides keys by {fill:g}, "
                                    f"{_hidden_logits(found.fill, dtype)}")
        return
    if attention.masks:
        attention.left_alone = ("a bias-spelled mask beside a jnp.where mask: a row they "
                                "hide whole gets a gradient that depends on which hid each key")
        return
    other = None if found.rest is None else additive_mask.read(graph, found.rest)
    if other is not None:
        attention.left_alone = _two_additive_masks(found.fill, other.fill)
        return
    attention.masks.append((found.values, True))  # keys kept where the values are 0
    attention.fill, attention.additive, attention.bias = fill, True, found.rest
    bands.append(band_mask.band(graph, found.values, shape, negated=True))


def _softmax_where_mask(graph: Graph, attention: _Attention, mask: Any,
                        bands: list[band_mask.Band | None], shape: tuple[int, ...]) -> None:
    """Takes the mask given to the softmax (`where=`) as the op's; beside another mask
    (`jnp.where` or a bias), the attention is left alone: a row the other hides whole
    among the keys `where=` keeps gets the other's fill there (the mean of those values,
    or NaN), where the op would give the zeros of a row hidden whole."""
    if attention.masks:
        attention.left_alone = ("a mask given to the softmax (where=) beside another mask: "
                                "a row the other hides whole among the keys where= keeps "
                                "gets the other's fill there, not where='s zeros")
        return
    attention.masks.append((mask, False))
    attention.softmax_where = True
    bands.append(band_mask.band(graph, mask, shape, negated=False))


def _mask_biases_added_in_turn(graph: Graph, attention: _Attention, add: Any,
                               shape: tuple[int, ...]
                               ) -> tuple[Any, additive_mask.AdditiveMask | None]:
    """The logits under two biases added one after the other, and the mask one of them
    spells with the other as its rest: `logits + position_bias + mask_bias` (T5's, in
    either order) reads as `logits + (position_bias + mask_bias)` does, the fill
    swallowing the other bias where it hides a key. Two masks spelled as biases leave the
    attention alone (`_two_additive_masks`; no mask is returned); raises `_NoMatch` for
    any other sum."""
    if add.primitive.name != "add":
        raise _NoMatch
    for inner_sum, outer_bias in _operand_orders(add):
        inner = graph.producer(inner_sum, "add")
        outer = additive_mask.read(graph, outer_bias)
        if inner is None or literal_value(outer_bias) is not None or (
                outer is not None and outer.rest is not None):
            continue
        for body, inner_bias in _operand_orders(inner):
            found = additive_mask.read(graph, inner_bias)
            mask, rest = (outer, inner_bias) if outer is not None else (found, outer_bias)
            if (mask is None or tuple(body.aval.shape) != shape
                    or literal_value(inner_bias) is not None
                    or (found is not None and found.rest is not None)
                    or (graph.producer(body, "mul", "div") is None
                        and not _is_product(graph, body))):
                continue
            attention.region += [add, inner]
            if found is not None and outer is not None:
                attention.left_alone = _two_additive_masks(found.fill, outer.fill)
                return body, None
            attention.bias = rest
            return body, dataclasses.replace(mask, rest=rest)
    raise _NoMatch


def _two_additive_masks(fill: float, other_fill: float) -> str:
    """Why two masks spelled as biases and added are left alone."""
    if fill == other_fill == -math.inf:
        return ("two masks spelled as biases of -inf added: a row they hide whole is NaN in "
                "plain JAX, and so are the gradients of its query, keys and values, where "
                "the op's gradients are finite")
    return ("two masks spelled as biases added: keys both hide are -inf, so a row one hides "
            "whole averages only the keys the other keeps")


def _hidden_logits(fill: float, dtype: Any) -> str:
    """Why a bias-spelled mask of `fill` that does not swallow the logits is left alone."""
    return (f"which does not swallow the logits added to it (it rounds them to multiples "
            f"of {additive_mask.spacing(fill, dtype):g} in {jnp.dtype(dtype).name}): a row "
            "it hides whole keeps a softmax of what is left, which the op does not compute "
            f"(its kernels hold logits below {additive_mask.KERNEL_FLOOR:g} at one floor)")


def _data_mask_fill(scaled_fill: float, fill: float, dtype: Any) -> str:
    """Why a bias of numbers from the data times `fill` that hides keys is left alone."""
    if not additive_mask.swallows(scaled_fill):
        return _hidden_logits(fill, dtype)
    return ("which swallows the logits but is numbers, not a boolean choice: the op "
            "cannot take it as its mask, and as a bias it lies below the floor the op's "
            f"kernels hold logits at ({additive_mask.KERNEL_FLOOR:g})")


def _unmerge_band(attention: _Attention, shape: tuple[int, ...]) -> None:
    """The band of the merged logits' mask as one of the product's axes, the query rows
    preferably the query axis the reshape left whole; no band where its rows are merged."""
    assert attention.merged_shape is not None
    kept = band_mask.kept_axes(attention.merged_shape, shape)
    band = attention.band
    if band is not None:
        attention.band = (dataclasses.replace(band, row_axis=kept[band.row_axis])
                          if band.row_axis in kept else None)
    whole = [a for a in kept.values() if attention.axes[a][0] == "query"]
    attention.preferred_row = whole[0] if len(whole) == 1 else None


def _operands(graph: Graph, attention: _Attention, product: Any, transpose: Any) -> None:
    """Names the logits' axes and finds q and k: k is the operand whose one free axis is
    the logits' last (the softmax's), q the other."""
    x, y = product.invars
    ((xc, yc), (xb, yb)) = product.params["dimension_numbers"]
    if len(xc) != 1 or len(yc) != 1:
        raise _NoMatch
    x_free = [a for a in range(len(x.aval.shape)) if a not in (*xc, *xb)]
    y_free = [a for a in range(len(y.aval.shape)) if a not in (*yc, *yb)]
    axes = ([("batch", i) for i in range(len(xb))] + [("x", a) for a in x_free]
            + [("y", a) for a in y_free])
    if transpose is not None:
        axes = [axes[p] for p in transpose.params["permutation"]]
    key_side = axes[-1][0]
    if key_side == "batch" or len(x_free if key_side == "x" else y_free) != 1:
        raise _NoMatch
    if not (y_free if key_side == "x" else x_free):  # q has no rows
        raise _NoMatch
    query, key = (y, x) if key_side == "x" else (x, y)
    q_numbers, k_numbers = ((yb, yc[0]), (xb, xc[0])) if key_side == "x" else (
        (xb, xc[0]), (yb, yc[0]))
    attention.axes = [(role if role == "batch" else "key" if role == key_side else "query",
                       int(a)) for role, a in axes]
    attention.query, attention.key = _narrowed(graph, attention,
                                               _unscaled_query(graph, attention, query), key)
    attention.query_numbers = (tuple(int(a) for a in q_numbers[0]), int(q_numbers[1]))
    attention.key_numbers = (tuple(int(a) for a in k_numbers[0]), int(k_numbers[1]))


def _narrowed(graph: Graph, attention: _Attention, query: Any, key: Any) -> tuple[Any, Any]:
    """q and k before casts from the values' narrower float type, `(query, key)` where both
    are cast so (Flax's `dot_product_attention_weights(..., dtype=jnp.float32)` on
    bfloat16 q and k, Hugging Face's `attention_softmax_in_fp32`): the product of the
    upcast values is exact in float32, as the op's float32 accumulation of theirs."""
    casts: list[Any] = []
    uncast = [_unwidened(graph, var, casts) for var in (query, key)]
    if len(casts) != 2 or any(v.aval.dtype != attention.value.aval.dtype for v in uncast):
        return query, key
    attention.region.extend(casts)
    return uncast[0], uncast[1]


def _mask_as_band(attention: _Attention, shape: tuple[int, ...]) -> None:
    """Picks the query rows' axis; a mask that is a band of the rows and keys whose every
    row sees a key becomes `is_causal` and `local_window_size` (no mask array)."""
    rows = [j for j, (role, _) in enumerate(attention.axes) if role == "query"]
    attention.row = (attention.preferred_row if attention.preferred_row is not None
                     else len(shape) - 2 if len(shape) - 2 in rows else rows[0])
    band = attention.band
    if band is None or band.row_axis not in rows:
        attention.band = None
        return
    window = band_mask.window(band, shape[band.row_axis], shape[-1])
    if window is None:
        attention.band = None
        return
    attention.row, attention.masks = band.row_axis, []
    attention.is_causal, attention.local_window_size = window


def _constant_factor(graph: Graph, var: Any, accepts: Callable[[Any], bool]
                     ) -> tuple[float, Any, Any] | None:
    """`(factor, body, eqn)` where `var` is `body` times (or over: the factor is then the
    reciprocal) a nonzero scalar constant, by the equation `eqn`, and `accepts(body)`;
    else `None`."""
    eqn = graph.producer(var, "mul", "div")
    if eqn is None:
        return None
    for body, factor in _operand_orders(eqn):
        value = scalar_constant(graph, factor)
        if value is not None and np.ndim(value) == 0 and float(value) != 0 and accepts(body):
            return (float(value) if eqn.primitive.name == "mul" else 1 / float(value)), body, eqn
    return None


def _scaled(graph: Graph, attention: _Attention, logits: Any) -> Any:
    """The logits before a constant scale (the product, possibly cast to a wider float
    type first: `einsum(q, k).astype(jnp.float32) / sqrt(d)`), else `logits`."""
    return _taken_scale(attention, logits, _constant_factor(
        graph, logits, lambda body: _is_product(graph, body)))


def _taken_scale(attention: _Attention, var: Any, found: tuple[float, Any, Any] | None) -> Any:
    """The body of `found` (`_constant_factor`), its factor taken into the op's scale, or
    `var` where nothing was found."""
    if found is None:
        return var
    scale, body, eqn = found
    attention.scale *= scale
    attention.region.append(eqn)
    return body


def _biased_product(graph: Graph, var: Any) -> bool:
    """Whether `var` is a (possibly scaled) `q . k` product plus (or minus) an array (a
    bias)."""
    add = graph.producer(_unwidened(graph, var, []), "add", "sub")
    return add is not None and any(
        literal_value(bias) is None and (
            graph.producer(_unwidened(graph, summand, []), "mul", "div") is not None
            or _is_product(graph, summand))
        for summand, bias in _operand_orders(add))


def _boolean(graph: Graph, condition: Any, region: list[Any]) -> Any:
    """The mask a `jnp.where` condition keeps keys by: a boolean one itself, the boolean
    a float one was cast from (`mask.astype(jnp.float32)`, as Flax's `make_causal_mask`
    gives: nonzero exactly where the boolean is true), or another number array (kept
    where nonzero, as `jnp.where` reads it); `None` for anything else."""
    if condition.aval.dtype == jnp.bool_:
        return condition
    if not jnp.issubdtype(condition.aval.dtype, jnp.number):
        return None
    cast = graph.producer(condition, "convert_element_type")
    if cast is not None and cast.invars[0].aval.dtype == jnp.bool_:
        region.append(cast)
        return cast.invars[0]
    return condition


def _scaled_sum(graph: Graph, attention: _Attention, logits: Any) -> Any:
    """The sum under a constant scale of `(q @ k^T + bias) * scale`, the scale taken as the
    op's and the bias's (`bias_scale`: the op adds its bias after scaling), else
    `logits`."""
    found = _constant_factor(graph, logits, lambda body: _biased_product(graph, body))
    if found is None:
        return logits
    attention.bias_scale = found[0]
    return _unwidened(graph, _taken_scale(attention, logits, found), attention.region)


def _is_where(graph: Graph, var: Any) -> bool:
    where = graph.producer(_unwidened(graph, var, []), "jit")
    return where is not None and where.params.get("name") == "_where"


def _scaled_after_mask(graph: Graph, attention: _Attention, logits: Any
                       ) -> tuple[float, Any] | None:
    """`(scale, masked logits)` where `logits` are masked logits times a constant
    (`jnp.where(mask, l, -inf) / jnp.sqrt(d)`), else `None`. The caller checks the scaled
    fill still hides its keys (a negative scale makes it the largest logit) and that no
    bias or soft cap sits under the scale."""
    found = _constant_factor(graph, logits, lambda body: _is_where(graph, body))
    if found is None:
        return None
    scale, body, eqn = found
    attention.region.append(eqn)
    return scale, body


def _operand_orders(eqn: Any) -> list[tuple[Any, Any]]:
    """`(body, operand)` pairs of a binary equation: both orders of a product or sum,
    the written order of a quotient or difference (`body / factor`, `body - bias`)."""
    if eqn.primitive.name in ("mul", "add"):
        return [tuple(eqn.invars), tuple(eqn.invars[::-1])]
    return [tuple(eqn.invars)]


def _unscaled_query(graph: Graph, attention: _Attention, query: Any) -> Any:
    if len(graph.users(query)) != 1:
        return query
    return _taken_scale(attention, query, _constant_factor(
        graph, query, lambda body: tuple(body.aval.shape) == tuple(query.aval.shape)))


def _soft_cap(graph: Graph, attention: _Attention, logits: Any) -> Any:
    """The logits before `cap * tanh(logits / cap)`, or `None`."""
    found = soft_capped(graph, logits)
    if found is None:
        return None
    inner, attention.soft_cap, eqns = found
    attention.region.extend(eqns)
    return inner


def _compute(attention: _Attention, out_shape: tuple[int, ...], out_dtype: Any, query: Any,
             key: Any, value: Any, *extra: Any) -> Any:
    """The matched attention's result computed by the op: the batch axes but one as the
    op's batch, the query rows as its sequence, the last batch axis and the query's other
    free axes (grouped-query heads sharing a key) as its heads."""
    from tokamax_kernels.attention.api import dot_product_attention

    axes, row = attention.axes, attention.row
    logits_shape = _sizes(attention, query, key)
    batch = [j for j, (role, _) in enumerate(axes) if role == "batch"]
    groups = [j for j, (role, _) in enumerate(axes) if role == "query" and j != row]
    heads = [batch[-1]] if groups and batch else []
    others = [j for j in batch if j not in heads]
    (qb, qc), (kb, kc) = attention.query_numbers, attention.key_numbers
    v_batch, v_keys, v_features = attention.value_numbers

    def q_axis(j: int) -> int:
        role, a = axes[j]
        return qb[a] if role == "batch" else a

    other_sizes = [logits_shape[j] for j in others]
    head_count = math.prod(logits_shape[j] for j in (*heads, *groups))
    q = jnp.transpose(query, [q_axis(j) for j in (*others, row, *heads, *groups)] + [qc])
    q = q.reshape(*other_sizes, logits_shape[row], head_count, q.shape[-1])
    k = jnp.transpose(key, [kb[axes[j][1]] for j in others] + [axes[-1][1]]
                      + [kb[axes[j][1]] for j in heads] + [kc])
    v = jnp.transpose(value, [v_batch[j] for j in others] + [v_keys]
                      + [v_batch[j] for j in heads] + [v_features])
    if not heads:
        k, v = k[..., None, :], v[..., None, :]

    def per_head(x: Any) -> Any:
        """A bias or mask of the logits, as the op's `(*batch, heads, rows, keys)`."""
        if attention.merged_shape is not None:
            x = jnp.broadcast_to(x, attention.merged_shape).reshape(logits_shape)
        x = jnp.transpose(jnp.broadcast_to(x, logits_shape),
                          (*others, *heads, *groups, row, len(axes) - 1))
        return x.reshape(*other_sizes, head_count, logits_shape[row], logits_shape[-1])

    extra_arrays = list(extra)
    bias = mask = None
    if attention.bias is not None:
        bias = per_head(extra_arrays.pop(0))
        if attention.bias_scale != 1.0:
            bias = bias * jnp.asarray(attention.bias_scale, bias.dtype)
    for _, negated in attention.masks:
        kept = per_head(extra_arrays.pop(0))
        kept = kept if kept.dtype == jnp.bool_ else kept != 0
        kept = ~kept if negated else kept
        mask = kept if mask is None else mask & kept
    out = dot_product_attention(q, k, v, bias, mask, scale=attention.scale,
                                is_causal=attention.is_causal,
                                local_window_size=attention.local_window_size,
                                logits_soft_cap=attention.soft_cap,
                                precision=attention.precision)
    if mask is not None:
        hidden = jnp.swapaxes(~jnp.any(mask, axis=-1), -1, -2)[..., None]
        if attention.softmax_where:
            plain = jnp.zeros_like(out)
        elif attention.fill == -np.inf:
            plain = _nan_through_the_values(v, hidden, head_count)
        else:
            plain = jnp.mean(v.astype(jnp.float32), axis=-3, keepdims=True)
            plain = jnp.repeat(plain, head_count // v.shape[-2], axis=-2)
            if attention.additive:
                plain = plain + additive_mask.hidden_row_gradient(q, k, v, bias,
                                                                  attention.scale)
        out = jnp.where(hidden, plain.astype(out.dtype), out)
    out = out.reshape(*other_sizes, logits_shape[row],
                      *[logits_shape[j] for j in (*heads, *groups)], out.shape[-1])
    labels = [*others, row, *heads, *groups, "features"]
    out = jnp.transpose(out, [labels.index(a) for a in attention.output_axes])
    return out.reshape(out_shape).astype(out_dtype)


def _nan_through_the_values(value: Any, hidden: Any, head_count: int) -> Any:
    """NaN in the query rows a fill of `-inf` hides whole (`hidden`), as plain JAX's
    softmax gives them, computed from the values so that their gradient is NaN too:
    autodiff of plain JAX multiplies those rows' NaN probabilities into the gradient of
    every key and feature of the values of their batch element and head, even where the
    rows' cotangent is zero."""
    summed = jnp.sum(value.astype(jnp.float32), axis=-3, keepdims=True)
    summed = jnp.repeat(summed, head_count // value.shape[-2], axis=-2)
    return jnp.where(hidden, jnp.nan, 0.0) * summed


def _sizes(attention: _Attention, query: Any, key: Any) -> list[int]:
    """The logits' shape, read from q and k."""
    qb, _ = attention.query_numbers
    sizes = []
    for role, a in attention.axes:
        sizes.append(query.shape[qb[a]] if role == "batch" else
                     query.shape[a] if role == "query" else key.shape[a])
    return sizes
