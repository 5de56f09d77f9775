"""`"layer_norm"`: LayerNorm and RMSNorm written in `jnp`, over the last axis, with
float32 statistics, replaced by the `layer_norm` op.

Matched (from the equation that ends it), `x` possibly upcast to float32 first and the
result rounded back to `x`'s dtype at the end, or left in float32 (as Flax's `RMSNorm`
and `LayerNorm` with float32 parameters leave a bfloat16 input's norm: the op then
normalizes the upcast input):

- statistics: `mean(x)` as `jnp.mean` (`sum / n`, with or without `keepdims`), the
  variance as `mean(square(x - mean))` (`square`, `** 2` or a product) or `jnp.var`
  (`ddof=0`), RMSNorm's as `mean(square(x))`, either possibly clipped at zero
  (`jnp.maximum(0.0, variance)`, Equinox's `LayerNorm`); Flax's fast variance
  `max(0, mean(square(x)) - square(mean))` is a near-miss (it loses precision where the
  op's does not);
- centering: `x - mean(x)` (LayerNorm), none, or `x - zeros` (RMSNorm through Flax's
  normalization shared with LayerNorm, the mean `jnp.zeros_like`);
- normalization: `x_c * rsqrt(var + eps)`, `x_c / sqrt(var + eps)`,
  `x_c * (1 / sqrt(var + eps))`, `x_c * (var + eps) ** -0.5` or
  `x_c * jnp.reciprocal(jnp.sqrt(var + eps))`;
- then optionally `* scale` (or `* (scale + c)`, Gemma's `1 + scale`) and `+ offset`,
  each a vector of the last axis' length (possibly cast to a wider float type; one
  rounded on the way, `scale.astype(jnp.bfloat16).astype(jnp.float32)`, stays outside);
  the scale may also be multiplied in before the division (`scale * x_c / sqrt(...)`)
  or into the factor (`x_c * (rsqrt(...) * scale)`, as Flax's `LayerNorm` does); or the
  centering distributed over the factor, `x * inv + (-mean * inv + offset)` with
  `inv = rsqrt(var + eps) * scale`, as Keras's `LayerNormalization` computes it.

A norm whose values feed anything but the next step (a gradient traced inside
`optimize` keeps `rsqrt(var + eps)` for its backward) is left as written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from tokamax_pass.passes.candidate import Candidate
from tokamax_pass.passes.graph import SHAPE_ONLY, Graph, literal_value, rounds, same_value

NAME = "layer_norm"
PRIMITIVES = frozenset({"convert_element_type", "add", "mul", "div"})


class _NoMatch(Exception):
    """The equations are not a norm."""


class _NearMiss(Exception):
    """A norm the op does not compute as written, and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass
class _Norm:
    """What a matched norm computes, and the equations it spans."""

    x: Any = None
    scale: Any = None
    offset: Any = None
    scale_offset: float = 0.0
    epsilon: float = 0.0
    subtract_mean: bool = False
    # `x` is upcast to float32 and the result left there: the op takes the upcast.
    upcast: bool = False
    # The mean and factor of Keras's `x * inv + (-mean * inv + offset)`, which centers
    # `x` (`None`: `x - mean` is written, or there is none).
    distributed_mean: Any = None
    distributed_factor: Any = None
    core: list[Any] = dataclasses.field(default_factory=list)


def match(eqn: Any, graph: Graph | None) -> Candidate | None:
    """The `layer_norm` candidate of the norm ending at `eqn`, if `eqn` ends one (and not
    a step before a larger one, such as the scale before the offset)."""
    if graph is None or not graph.live(eqn):
        return None
    try:
        norm = _parse(eqn, graph)
    except _NoMatch:
        return None
    except _NearMiss as near:
        return None if _extended(eqn, graph) else Candidate(NAME, None, near.reason)
    if _extended(eqn, graph):
        return None
    if not graph.private([e for e in norm.core if e is not eqn], eqn):
        return Candidate(NAME, None, "values inside the norm are used elsewhere (a gradient "
                                     "traced inside optimize keeps them for its backward)")
    return Candidate(NAME, _function(norm), inputs=tuple(
        v for v in (norm.x, norm.scale, norm.offset) if v is not None))


def _extended(eqn: Any, graph: Graph) -> bool:
    """Whether an equation using `eqn`'s result ends a larger norm (the scale after
    the normalization, the offset after the scale): that one is the match."""
    for user in graph.users(eqn.outvars[0]):
        if user.primitive.name not in PRIMITIVES:
            continue
        try:
            if any(e is eqn for e in _parse(user, graph).core):
                return True
        except _NoMatch:
            continue
        except _NearMiss:
            return True
    return False


def _function(norm: _Norm) -> Any:
    has_scale, has_offset = norm.scale is not None, norm.offset is not None

    def function(x: Any, *vectors: Any) -> Any:
        from tokamax_kernels.layer_norm.api import layer_norm

        vectors_left = list(vectors)
        scale = vectors_left.pop(0) if has_scale else None
        offset = vectors_left.pop(0) if has_offset else None
        if norm.upcast:
            x = x.astype(jnp.float32)
        return layer_norm(x, scale, offset, epsilon=norm.epsilon,
                          scale_offset=norm.scale_offset, subtract_mean=norm.subtract_mean)

    return function


def _parse(root: Any, graph: Graph) -> _Norm:
    norm = _Norm(core=[root])
    (out,) = root.outvars
    if not out.aval.shape or not jnp.issubdtype(out.aval.dtype, jnp.floating):
        raise _NoMatch
    eqn = root
    if root.primitive.name == "convert_element_type":
        (inner,) = root.invars
        if inner.aval.dtype != jnp.float32 or out.aval.dtype == jnp.float32:
            raise _NoMatch
        eqn = _take(graph, norm, inner, "add", "mul", "div")
    if eqn.primitive.name == "add":
        distributed = _distributed(graph, norm, eqn)
        eqn = distributed if distributed is not None else _offset(graph, norm, eqn)
    if eqn.primitive.name == "mul":
        eqn = _scale(graph, norm, eqn)
    _normalized(graph, norm, eqn)
    if root.primitive.name == "convert_element_type":
        if norm.x.aval.dtype != out.aval.dtype:
            raise _NoMatch
    elif out.aval.dtype != jnp.float32:
        raise _NoMatch
    else:
        norm.upcast = norm.x.aval.dtype != jnp.float32
    return norm


def _take(graph: Graph, norm: _Norm, var: Any, *primitives: str) -> Any:
    eqn = graph.producer(var, *primitives)
    if eqn is None:
        raise _NoMatch
    norm.core.append(eqn)
    return eqn


def _vector(graph: Graph, var: Any, length: int) -> Any:
    """The `(length,)` array `var` broadcasts along the last axis, else `None`: reshapes
    that add or drop leading unit axes are looked through, any other (one that moves the
    vector to another axis, `g.reshape(-1, 1)`) ends the search."""
    rank = len(var.aval.shape)
    while True:
        eqn = graph.producer(var, "broadcast_in_dim", "reshape", "convert_element_type")
        if eqn is None:
            break
        if eqn.primitive.name == "broadcast_in_dim":
            operand = eqn.invars[0]
            dims = tuple(eqn.params["broadcast_dimensions"])
            if dims != tuple(range(rank - len(operand.aval.shape), rank)):
                return None
        elif eqn.primitive.name == "reshape":
            if _without_leading_ones(eqn.invars[0].aval.shape) != _without_leading_ones(
                    eqn.outvars[0].aval.shape):
                return None
        elif not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating) or rounds(
                eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype):
            return None  # not a float, or rounded (`scale.astype(jnp.bfloat16)`)
        var = eqn.invars[0]
        rank = len(var.aval.shape)
    shape = tuple(var.aval.shape)
    if literal_value(var) is not None:
        return None
    return var if shape == (length,) and jnp.issubdtype(var.aval.dtype, jnp.floating) else None


def _distributed(graph: Graph, norm: _Norm, eqn: Any) -> Any:
    """The `x * inv` equation of `x * inv + (-mean * inv [+ offset])`, the centering
    distributed over the factor as Keras's `LayerNormalization` computes it (the op
    centers first, which where |mean| >> std rounds less), the mean and offset recorded;
    else `None`."""
    for product, rest in (eqn.invars, eqn.invars[::-1]):
        normalized = graph.producer(product, "mul")
        shift, offset, shifted = _offset_split(graph, rest, eqn.outvars[0].aval.shape[-1])
        moved = graph.producer(shift, "mul")
        if normalized is None or moved is None:
            continue
        for negated, factor in (moved.invars, moved.invars[::-1]):
            negation = graph.producer(negated, "neg")
            if negation is not None and factor in normalized.invars:
                norm.distributed_mean, norm.offset = negation.invars[0], offset
                norm.distributed_factor = factor
                norm.core += [e for e in (shifted, moved, negation, normalized)
                              if e is not None]
                return normalized
    return None


def _offset_split(graph: Graph, var: Any, length: int) -> tuple[Any, Any, Any]:
    """`(body, offset, eqn)` where `var` is `body + offset` by `eqn`, the offset a vector
    of the last axis; else `(var, None, None)`."""
    add = graph.producer(var, "add")
    for body, other in ([] if add is None else (add.invars, add.invars[::-1])):
        offset = _vector(graph, other, length)
        if offset is not None:
            return body, offset, add
    return var, None, None


def _without_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    leading = next((i for i, size in enumerate(shape) if size != 1), len(shape))
    return tuple(shape[leading:])


def _offset(graph: Graph, norm: _Norm, eqn: Any) -> Any:
    length = eqn.outvars[0].aval.shape[-1]
    for body, other in (eqn.invars, eqn.invars[::-1]):
        offset = _vector(graph, other, length)
        if tuple(body.aval.shape) != tuple(eqn.outvars[0].aval.shape):
            continue
        if offset is not None or _number(graph, other) == 0.0:  # zeros: no offset
            norm.offset = offset
            return _take(graph, norm, body, "mul", "div")
    raise _NoMatch


def _scale(graph: Graph, norm: _Norm, eqn: Any) -> Any:
    """`eqn` if it is the normalization itself, else the scale's and what it scales."""
    found = _scaled_body(graph, eqn)
    if found is None:
        return eqn
    body, (norm.scale, norm.scale_offset) = found
    return _take(graph, norm, body, "mul", "div")


def _scaled_body(graph: Graph, eqn: Any) -> tuple[Any, tuple[Any, float]] | None:
    """`(body, (scale, c))` where the product `eqn` is `body * (scale + c)`, `body` of
    `eqn`'s shape and the scale broadcast along its last axis; else `None`."""
    full = tuple(eqn.outvars[0].aval.shape)
    for body, other in (eqn.invars, eqn.invars[::-1]):
        if tuple(body.aval.shape) != full:
            continue
        found = _scale_of(graph, other, full[-1])
        if found is not None:
            return body, found
    return None


def _shifted_vector(graph: Graph, var: Any, length: int) -> tuple[Any, float]:
    """`(scale, c)` for `scale + c` broadcast along the last axis: Gemma's `1 + scale`,
    the scale a `(length,)` vector or one with leading unit axes
    (`jnp.expand_dims(scale, range(x.ndim - 1))`)."""
    rank = len(var.aval.shape)
    eqn = graph.producer(var, "broadcast_in_dim")
    if eqn is not None:
        operand_rank = len(eqn.invars[0].aval.shape)
        if tuple(eqn.params["broadcast_dimensions"]) == tuple(range(rank - operand_rank, rank)):
            var = eqn.invars[0]
    add = graph.producer(var, "add")
    if add is None:
        return None, 0.0
    for a, b in (add.invars, add.invars[::-1]):
        c = literal_value(b)
        if c is not None and _without_leading_ones(a.aval.shape) == (length,):
            vector = _vector(graph, a, length) or (
                a if literal_value(a) is None and tuple(a.aval.shape) == (length,) else None)
            if vector is not None and len(graph.users(add.outvars[0])) == 1:
                return vector, float(c)
    return None, 0.0


def _normalized(graph: Graph, norm: _Norm, eqn: Any) -> None:
    """`x_c * rsqrt(var + eps)`, `x_c / sqrt(var + eps)`, `x_c * (1 / sqrt(var + eps))`;
    the scale may be multiplied in before (`scale * x_c / sqrt(...)`) or folded into the
    factor (`x_c * (rsqrt(...) * scale)`, as Flax's `LayerNorm` does)."""
    full = tuple(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "div":
        centered, denominator = eqn.invars
        variance_plus = _through(graph, norm, denominator, "sqrt")
    elif eqn.primitive.name == "mul":
        for centered, factor in (eqn.invars, eqn.invars[::-1]):
            if tuple(centered.aval.shape) != full:
                continue
            statistic = factor if _statistic(graph, factor) else _scaled_statistic(
                graph, norm, factor)
            if statistic is not None:
                break
        else:
            raise _NoMatch
        if norm.distributed_mean is not None and factor is not norm.distributed_factor:
            raise _NoMatch  # the mean moved by another factor than the one normalizing
        variance_plus = _reciprocal_sqrt(graph, norm, statistic)
    else:
        raise _NoMatch
    if tuple(centered.aval.shape) != full:
        raise _NoMatch
    centered = _prescaled(graph, norm, centered)
    add = _take(graph, norm, variance_plus, "add")
    with_epsilon = [(a, b) for a, b in (add.invars, add.invars[::-1])
                    if literal_value(b) is not None]
    if not with_epsilon:
        raise _NoMatch
    variance, eps = with_epsilon[0]
    norm.epsilon = float(literal_value(eps))
    x32 = _centered(graph, norm, centered)
    # RMSNorm's variance squares `x` itself (`x - zeros` is `x`).
    _variance(graph, norm, variance, x32, centered if norm.subtract_mean else x32)
    x = x32
    convert = graph.producer(x32, "convert_element_type")
    if convert is not None and jnp.issubdtype(convert.invars[0].aval.dtype, jnp.floating):
        x = convert.invars[0]
    if x32.aval.dtype != jnp.float32:
        raise _NoMatch  # the op computes its statistics in float32
    norm.x = x


def _scale_of(graph: Graph, var: Any, length: int) -> tuple[Any, float] | None:
    """`(scale, c)` where `var` broadcasts `scale + c` (c 0 for a bare scale) along the
    last axis, `(None, 0.0)` where it is all ones, else `None`."""
    scale = _vector(graph, var, length)
    if scale is not None:
        return scale, 0.0
    if _number(graph, var) == 1.0:
        return None, 0.0  # ones: no scale
    scale, by = _shifted_vector(graph, var, length)
    return None if scale is None else (scale, by)


def _number(graph: Graph, var: Any) -> float | None:
    """The number `var` holds everywhere, a literal possibly broadcast or converted
    (Haiku's norms without parameters multiply by `np.array(1.)` and add `np.array(0.)`,
    broadcast to `x`'s shape), else `None`."""
    while (eqn := graph.producer(var, "broadcast_in_dim", "convert_element_type")) is not None:
        var = eqn.invars[0]
    value = literal_value(var)
    return None if value is None or np.ndim(value) else float(value)


def _scaled_statistic(graph: Graph, norm: _Norm, factor: Any) -> Any:
    """The per-row statistic of `statistic * scale` (the scale folded into the factor),
    the scale recorded; `None` if `factor` is not one or a scale was found already."""
    eqn = graph.producer(factor, "mul")
    if eqn is None or norm.scale is not None:
        return None
    for statistic, other in (eqn.invars, eqn.invars[::-1]):
        found = _scale_of(graph, other, factor.aval.shape[-1])
        if found is not None and _statistic(graph, statistic):
            norm.scale, norm.scale_offset = found
            norm.core.append(eqn)
            return statistic
    return None


def _prescaled(graph: Graph, norm: _Norm, centered: Any) -> Any:
    """`x_c` of `scale * x_c` (the scale multiplied in before the division), the scale
    recorded; else `centered` itself."""
    eqn = graph.producer(centered, "mul")
    if eqn is None or norm.scale is not None:
        return centered
    found = _scaled_body(graph, eqn)
    if found is None:
        return centered
    body, (norm.scale, norm.scale_offset) = found
    norm.core.append(eqn)
    return body


# Element-wise steps from the variance to its factor, each of one array and numbers.
_FACTOR_STEPS = ("rsqrt", "sqrt", "add", "div", "pow", "integer_pow")


def _statistic(graph: Graph, var: Any) -> bool:
    """Whether `var` is one value per row (last axis 1), possibly broadcast to the rows'
    length: a `(..., 1)` array, the broadcast of one along the last axis, or a value
    computed element by element from such a broadcast and numbers (Haiku's `RMSNorm`
    broadcasts its mean of squares to `x`'s shape before `rsqrt(ms + eps)`)."""
    while not (len(var.aval.shape) >= 1 and var.aval.shape[-1] == 1):
        eqn = graph.producer(var, "broadcast_in_dim")
        if eqn is not None:
            var = eqn.invars[0]
            return len(var.aval.shape) >= 1 and var.aval.shape[-1] == 1
        eqn = graph.producer(var, *_FACTOR_STEPS)
        arrays = [] if eqn is None else [v for v in eqn.invars if literal_value(v) is None]
        if len(arrays) != 1:
            return False
        (var,) = arrays
    return True


def _through(graph: Graph, norm: _Norm, var: Any, primitive: str) -> Any:
    """The operand of the `primitive` equation making `var`, broadcasts looked through."""
    var = _unbroadcast(graph, norm, var)
    return _take(graph, norm, var, primitive).invars[0]


def _unbroadcast(graph: Graph, norm: _Norm, var: Any) -> Any:
    while (eqn := graph.producer(var, *SHAPE_ONLY)) is not None:
        norm.core.append(eqn)
        var = eqn.invars[0]
    return var


def _reciprocal_sqrt(graph: Graph, norm: _Norm, var: Any) -> Any:
    """What `var` is the reciprocal square root of: `rsqrt(v)`, `1 / sqrt(v)`,
    `v ** -0.5` or `jnp.reciprocal(jnp.sqrt(v))`."""
    var = _unbroadcast(graph, norm, var)
    eqn = _take(graph, norm, var, "rsqrt", "div", "pow", "integer_pow")
    if eqn.primitive.name == "rsqrt":
        return eqn.invars[0]
    if eqn.primitive.name == "pow":
        if literal_value(eqn.invars[1]) != -0.5:
            raise _NoMatch
        return eqn.invars[0]
    if eqn.primitive.name == "integer_pow":
        if eqn.params["y"] != -1:
            raise _NoMatch
        return _through(graph, norm, eqn.invars[0], "sqrt")
    one, denominator = eqn.invars
    if literal_value(one) != 1:
        raise _NoMatch
    return _through(graph, norm, denominator, "sqrt")


def _centered(graph: Graph, norm: _Norm, var: Any) -> Any:
    """`x` of `x - mean(x)` (LayerNorm, `subtract_mean`), or of `x - zeros` (Flax's
    `RMSNorm`, whose shared normalization subtracts a mean of zeros: exact, `x - 0` is
    `x`), else `var` itself (RMSNorm)."""
    if norm.distributed_mean is not None:
        if not _is_mean_of(graph, norm.distributed_mean, var, norm.core):
            raise _NoMatch
        norm.subtract_mean = True
        return var
    sub = graph.producer(var, "sub")
    if sub is not None:
        x, mean = sub.invars
        if _is_mean_of(graph, mean, x, []):
            norm.core.append(sub)
            norm.subtract_mean = True
            _is_mean_of(graph, mean, x, norm.core)
            return x
        zeros = _zeros(graph, mean)
        if zeros is not None:
            norm.core.extend([sub, *zeros])
            return x
    return var


def _zeros(graph: Graph, var: Any) -> list[Any] | None:
    """The equations broadcasting (or reshaping) a literal zero into `var`
    (`jnp.zeros_like`), else `None`."""
    eqns = []
    while (eqn := graph.producer(var, *SHAPE_ONLY)) is not None:
        eqns.append(eqn)
        var = eqn.invars[0]
    value = literal_value(var)
    return eqns if eqns and value is not None and float(value) == 0.0 else None


def _is_mean_of(graph: Graph, var: Any, x: Any, core: list[Any]) -> bool:
    """Whether `var` is the mean of `x` over its last axis (`sum / n`, broadcasts aside);
    the equations are added to `core`."""
    after = []
    while (eqn := graph.producer(var, *SHAPE_ONLY)) is not None:
        after.append(eqn)
        var = eqn.invars[0]
    div = graph.producer(var, "div")
    if div is None:
        return False
    total, count = div.invars
    before = []
    while (eqn := graph.producer(total, *SHAPE_ONLY)) is not None:
        before.append(eqn)
        total = eqn.invars[0]
    reduce = graph.producer(total, "reduce_sum")
    if reduce is None or not same_value(graph, reduce.invars[0], x):
        return False
    rank = len(x.aval.shape)
    if tuple(reduce.params["axes"]) != (rank - 1,) or literal_value(count) != x.aval.shape[-1]:
        return False
    if not _keeps_rows([*reversed(before), *reversed(after)], x.aval.shape):
        return False
    core.extend([*after, div, *before, reduce])
    return True


def _keeps_rows(eqns: list[Any], shape: tuple[int, ...]) -> bool:
    """Whether the shape-only `eqns` (in the order they run) take a statistic of each
    row of an array of `shape` (its leading axes; the last one reduced) to that row's
    place: every leading axis stays where it is, and only axes of size one, or the last
    axis, are added. `mean[:, None, :]` of a `(B, T)` mean broadcasts against `(B, T, T)`
    with the rows along the features: each feature gets another row's statistic."""
    # Which leading axis of `shape` each axis holds (`None`: one of size one, or added).
    axes: list[int | None] = [i if n != 1 else None for i, n in enumerate(shape[:-1])]
    for eqn in eqns:
        source, target = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        if eqn.primitive.name == "broadcast_in_dim":
            moved: list[int | None] = [None] * len(target)
            for i, d in enumerate(eqn.params["broadcast_dimensions"]):
                moved[d] = axes[i] if source[i] == target[d] else None
            axes = moved
        else:
            if eqn.params.get("dimensions") is not None:
                return False
            kept = [a for a, n in zip(axes, source, strict=True) if n != 1]
            if [n for n in source if n != 1] != [n for n in target if n != 1]:
                return False
            placed = iter(kept)
            axes = [next(placed) if n != 1 else None for n in target]
    return (len(axes) in (len(shape) - 1, len(shape))
            and all(a in (None, i) for i, a in enumerate(axes))
            and all(i in axes for i, n in enumerate(shape[:-1]) if n != 1))


def _variance(graph: Graph, norm: _Norm, var: Any, x: Any, centered: Any) -> None:
    """`var` is the variance of `x` (`mean(square(centered))`, `jnp.var`), or for RMSNorm
    the mean of `square(x)`; also clipped at zero, `jnp.maximum(0.0, variance)` (as
    Equinox's `LayerNorm` writes it: a mean of squares is never negative, so the clip
    changes no value, and the gradient it halves at zero meets centered values of 0)."""
    var = _unclipped(graph, norm, _unbroadcast(graph, norm, var))
    jnp_var = graph.producer(var, "jit")
    if jnp_var is not None and jnp_var.params.get("name") == "_var":
        if len(jnp_var.invars) != 2:
            raise _NearMiss("the variance is masked (`where=`); the op's takes every "
                            "element of the row")
        operand, ddof = jnp_var.invars
        inner = jnp_var.params["jaxpr"].jaxpr
        axes = {tuple(e.params["axes"]) for e in inner.eqns if e.primitive.name == "reduce_sum"}
        if not norm.subtract_mean or operand is not x or axes != {(len(x.aval.shape) - 1,)}:
            raise _NoMatch
        if literal_value(ddof) != 0:
            raise _NearMiss(f"the variance divides by n - {int(literal_value(ddof))} (ddof), "
                            "the op by n")
        norm.core.append(jnp_var)
        return
    if norm.subtract_mean and _fast_variance(graph, var, x):
        raise _NearMiss("the variance is Flax's fast one, mean(x^2) - mean^2, which loses "
                        "precision where |mean| >> std; the op's is mean((x - mean)^2)")
    square = _square_of(graph, var)
    if square is None:
        raise _NoMatch
    if not _is_mean_of(graph, var, square.outvars[0], norm.core):
        raise _NoMatch
    operand = square.invars[0]
    if not same_value(graph, operand, centered):
        raise _NoMatch
    norm.core.append(square)
    again = None if operand is centered else graph.producer(operand)
    if again is not None:  # `x - mean` computed again for the variance
        norm.core.append(again)
        if again.primitive.name == "sub":  # with its own broadcast of the mean
            _is_mean_of(graph, again.invars[1], again.invars[0], norm.core)


def _unclipped(graph: Graph, norm: _Norm, var: Any) -> Any:
    """`v` of `jnp.maximum(0.0, v)` where `v` is no difference (Flax's fast variance is
    one, a near-miss `_variance` names), the `max` recorded; else `var` itself."""
    maximum = graph.producer(var, "max")
    if maximum is None:
        return var
    for zero, clipped in (maximum.invars, maximum.invars[::-1]):
        if literal_value(zero) == 0 and graph.producer(clipped, "sub") is None:
            norm.core.append(maximum)
            return _unbroadcast(graph, norm, clipped)
    return var


def _fast_variance(graph: Graph, var: Any, x: Any) -> bool:
    """Whether `var` is `max(0, mean(square(x)) - square(mean(x)))`, Flax's default
    ("fast") variance."""
    maximum = graph.producer(var, "max")
    if maximum is None:
        return False
    for zero, difference in (maximum.invars, maximum.invars[::-1]):
        sub = graph.producer(difference, "sub")
        if literal_value(zero) != 0 or sub is None:
            continue
        mean_of_squares, squared_mean = sub.invars
        square = _square_of(graph, mean_of_squares)
        outer = graph.producer(squared_mean, "square", "integer_pow", "mul")
        if square is None or outer is None or _square_of_operand(outer) is None:
            continue
        if (same_value(graph, square.invars[0], x)
                and _is_mean_of(graph, mean_of_squares, square.outvars[0], [])
                and _is_mean_of(graph, _square_of_operand(outer), x, [])):
            return True
    return False


def _square_of_operand(eqn: Any) -> Any:
    """What the squaring equation `eqn` squares, else `None`."""
    name = eqn.primitive.name
    if name == "integer_pow" and eqn.params["y"] != 2:
        return None
    if name == "mul" and eqn.invars[0] is not eqn.invars[1]:
        return None
    return eqn.invars[0]


def _square_of(graph: Graph, mean: Any) -> Any:
    """The squaring equation whose values `mean` averages, if it is one."""
    while (eqn := graph.producer(mean, *SHAPE_ONLY)) is not None:
        mean = eqn.invars[0]
    div = graph.producer(mean, "div")
    if div is None:
        return None
    total = div.invars[0]
    while (eqn := graph.producer(total, *SHAPE_ONLY)) is not None:
        total = eqn.invars[0]
    reduce = graph.producer(total, "reduce_sum")
    if reduce is None:
        return None
    square = graph.producer(reduce.invars[0], "square", "integer_pow", "mul")
    return None if square is None or _square_of_operand(square) is None else square
