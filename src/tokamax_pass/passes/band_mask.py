"""A boolean mask built from index comparisons, read as a band of key offsets.

Causal and sliding-window masks are written as comparisons of `jnp.arange` rows and
columns (`cols <= rows`, `rows - cols <= window`, `cols > rows - window - 1`) combined
with `&`, or as `jnp.tril`/`jnp.triu` of ones (boolean, or numbers multiplied or one
minus another within it, kept where nonzero or compared with 0 or 1:
`jnp.where(jnp.tril(jnp.ones((t, t))) == 0, -jnp.inf, logits)`), either possibly turned
into two numbers and compared with a number (MaxText's additive mask read back,
`jnp.where(cols <= rows, 0.0, fill) >= fill * 0.5`; Praxis's `(rows < cols).astype(dtype)
* fill`, of indices `jnp.tile`d along axes of size 1). Each such mask keeps
exactly the entries whose offset `col - row` lies in one interval `[low, high]`, which
the attention op takes as `is_causal` and `local_window_size` instead of a mask array.
The mask's equations are read symbolically (integer values as affine functions of the
array's indices, booleans as intervals of such functions, 0/1 numbers as indicators of
those intervals), so no mask array is built; any other mask (one reading
data, a comparison that is no band, `|`, integers its dtype does not hold exactly: an
unsigned `rows - cols` wraps around) is not a band.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from tokamax_pass.passes.graph import Graph, scalar_constant

_MAX_DEPTH = 64
# The most entries of a constant mask read for its band (a (4096, 4096) causal mask).
_LARGEST_CONSTANT = 4096 * 4096


@dataclasses.dataclass(frozen=True)
class _Affine:
    """An integer array whose entry at index `i` is `sum(coefficients * i) + constant`."""

    coefficients: tuple[int, ...]
    constant: int


@dataclasses.dataclass(frozen=True)
class _Intervals:
    """A boolean array: True where each linear form `sum(form * i)` of the index lies in
    its interval `[low, high]` (`constraints` empty: True everywhere); `false`: False
    everywhere."""

    constraints: tuple[tuple[tuple[int, ...], float, float], ...]
    false: bool = False


@dataclasses.dataclass(frozen=True)
class _Indicator:
    """A numeric array: 1 where `kept` is True, 0 elsewhere (`jnp.tril` of float ones)."""

    kept: _Intervals


@dataclasses.dataclass(frozen=True)
class _Float:
    """A floating array equal everywhere to `value` (a literal too large to be read as an
    exact integer, as fills are)."""

    value: float


@dataclasses.dataclass(frozen=True)
class _Choice:
    """A numeric array: the number `on` where `kept` is True, `off` elsewhere
    (`jnp.where(causal, 0.0, fill)`, the mask MaxText adds to its logits)."""

    kept: _Intervals
    on: float
    off: float


@dataclasses.dataclass(frozen=True)
class Band:
    """`col - row` in `[low, high]` (either may be infinite) keeps an entry; `row_axis`
    is the axis (of the array the mask is broadcast to) holding the rows, the last axis
    the columns."""

    row_axis: int
    low: float
    high: float


def band(graph: Graph, mask: Any, shape: tuple[int, ...], *, negated: bool = False
         ) -> Band | None:
    """The band `mask` (a where's condition: booleans, or numbers kept where nonzero)
    keeps once broadcast (right-aligned) to `shape`, or `None`; `negated`: the band its
    negation keeps (`jnp.where(mask == 0, fill, logits)`)."""
    value = _Reader(graph).value(mask, 0)
    if isinstance(value, _Indicator):
        value = value.kept
    if isinstance(value, _Choice):  # kept where nonzero (where 0, `negated`)
        value = _where_held(value.kept, (value.on != 0) != negated,
                            (value.off != 0) != negated)
        negated = False
    if negated:
        value = _negation(value)
    if not isinstance(value, _Intervals) or value.false:
        return None
    offset = len(shape) - len(mask.aval.shape)
    row_axis, low, high = None, -math.inf, math.inf
    for form, form_low, form_high in value.constraints:
        full, lo, hi = (0,) * offset + form, form_low, form_high
        if full[-1] == -1:
            full, lo, hi = tuple(-c for c in full), -form_high, -form_low
        others = [a for a, c in enumerate(full[:-1]) if c]
        if full[-1] != 1 or len(others) != 1 or full[others[0]] != -1:
            return None
        if row_axis not in (None, others[0]):
            return None
        row_axis, low, high = others[0], max(low, lo), min(high, hi)
    if row_axis is None:
        return Band(len(shape) - 2, low, high) if len(shape) >= 2 else None
    return Band(row_axis, low, high)


def two_numbers(graph: Graph, var: Any) -> tuple[float, float] | None:
    """`(on, off)` where `var` holds one number on a band of indices and another elsewhere
    (`jnp.triu(jnp.full((t, t), -jnp.inf), 1)`, `jnp.log(jnp.tril(ones))`: 0 and
    `-inf`), else `None`."""
    value = _Reader(graph).value(var, 0)
    if isinstance(value, _Indicator):
        return 1.0, 0.0
    if isinstance(value, _Choice):
        return value.on, value.off
    return None


def intersection(bands: list[Band | None]) -> Band | None:
    """The band every one of `bands` keeps (masks applied in turn), or `None` where one is
    no band, they hold their rows on different axes, or there are none."""
    if not bands or any(b is None for b in bands):
        return None
    rows = {b.row_axis for b in bands if b is not None}
    if len(rows) != 1:
        return None
    return Band(rows.pop(), max(b.low for b in bands if b is not None),
                          min(b.high for b in bands if b is not None))


def window(band: Band, rows: int, keys: int
            ) -> tuple[bool, tuple[int, int] | None] | None:
    """`(is_causal, local_window_size)` keeping the band's entries (`local_window_size`:
    query i sees keys i-left .. i+right), or `None` where some row sees no key (plain
    JAX's value there differs from the op's) or the band does not hold the diagonal
    within the op's non-negative window."""
    low, high = band.low, band.high
    if low > high or high < 0 or low > keys - 1 or rows - 1 + low > keys - 1:
        return None
    unbounded = rows + keys
    left = unbounded if low == -math.inf else int(min(-low, unbounded))
    right = unbounded if high == math.inf else int(min(high, unbounded))
    if left < 0:
        return None
    if low == -math.inf and high == math.inf:
        return False, None
    if right == 0:
        return True, None if low == -math.inf else (left, 0)
    return False, (left, right)


def kept_axes(merged: tuple[int, ...], shape: tuple[int, ...]) -> dict[int, int]:
    """`{merged axis: shape axis}` of the axes a row-major reshape from `shape` to
    `merged` leaves whole: the same size after the same number of elements."""
    def spans(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
        return [(math.prod(sizes[:a]), size) for a, size in enumerate(sizes)]

    unmerged = spans(shape)
    return {a: unmerged.index(span) for a, span in enumerate(spans(merged))
            if span in unmerged}


class _Reader:
    """Symbolic values of the variables of `graph` (and of `jit` calls' jaxprs)."""

    def __init__(self, graph: Graph) -> None:
        self._graph = graph
        self._memo: dict[Any, Any] = {}

    def value(self, var: Any, depth: int) -> Any:
        if isinstance(var, Literal):
            return _literal(var)
        if var in self._memo:
            return self._memo[var]
        eqn = self._graph.producer(var)
        result = None
        folded = None if var.aval.shape else scalar_constant(self._graph, var)
        if folded is not None:  # arithmetic on numbers: Praxis's `large_negative * 0.5`
            result = _scalar(folded, var.aval.dtype)
        elif eqn is not None and depth < _MAX_DEPTH and len(eqn.outvars) == 1:
            operands = [self.value(v, depth + 1) for v in eqn.invars]
            result = _apply(eqn, operands)
        elif eqn is None and (constant := self._graph.constant(var)) is not None:
            result = _constant_band(constant)
        self._memo[var] = result
        return result


def _constant_band(value: np.ndarray) -> Any:
    """The symbolic value of a constant mask (`np.tril(np.ones((t, t), bool))`, a buffer
    computed before tracing): booleans, or 0s and 1s, keeping one band of key offsets
    `col - row` on its last two axes (any others of size 1); else `None`."""
    if (value.ndim < 2 or value.size > _LARGEST_CONSTANT or min(value.shape[-2:]) < 2
            or any(size != 1 for size in value.shape[:-2])):
        return None
    kept = value.reshape(value.shape[-2:])
    if value.dtype != np.bool_:
        if not np.all((kept == 0) | (kept == 1)):
            return None
        kept = kept != 0
    if not kept.any():
        return None
    rows, cols = value.shape[-2], value.shape[-1]
    offsets = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    low, high = int(offsets[kept].min()), int(offsets[kept].max())
    if not np.array_equal(kept, (offsets >= low) & (offsets <= high)):
        return None
    band = _constraint((0,) * (value.ndim - 2) + (-1, 1),
                       -math.inf if low <= -(rows - 1) else low,
                       math.inf if high >= cols - 1 else high)
    return band if value.dtype == np.bool_ else _Indicator(band)


def _literal(var: Any) -> Any:
    """The symbolic value of a scalar literal, as its dtype holds it (a weakly typed
    Python float keeps its float64 value in the jaxpr: `-0.7 * float32 max` rounds)."""
    return _scalar(var.val, var.aval.dtype)


def _scalar(number: Any, dtype: Any) -> Any:
    """The symbolic value of a scalar `number` of `dtype`, as the dtype holds it."""
    value = np.asarray(number, dtype)
    if value.ndim != 0:
        return None
    if value.dtype == np.bool_:
        return _Intervals((), false=not bool(value))
    floating = jnp.issubdtype(value.dtype, jnp.floating)  # bfloat16 too
    if floating and math.isinf(float(value)):
        return _Float(float(value))  # a fill: `jnp.where(causal, 0.0, -jnp.inf)`
    if np.issubdtype(value.dtype, np.integer) or (floating and float(value).is_integer()):
        return _Affine((), int(value))
    return None


def _evaluate(closed: ClosedJaxpr, operands: list[Any]) -> list[Any]:
    """The symbolic values of a sub-jaxpr's outputs, given its inputs'."""
    env: dict[Any, Any] = dict(zip(closed.jaxpr.invars, operands, strict=True))

    def read(var: Any) -> Any:
        return _literal(var) if isinstance(var, Literal) else env.get(var)

    for eqn in closed.jaxpr.eqns:
        if len(eqn.outvars) == 1:
            env[eqn.outvars[0]] = _apply(eqn, [read(v) for v in eqn.invars])
    return [read(v) for v in closed.jaxpr.outvars]


def _apply(eqn: Any, operands: list[Any]) -> Any:
    """The symbolic value of `eqn`'s one result, or `None` where it is not one (also an
    integer the result's dtype cannot hold: unsigned `rows - cols` wraps around)."""
    result = _symbolic(eqn, operands)
    if isinstance(result, _Affine) and not _held(result, eqn.outvars[0].aval):
        return _exact_float(result, eqn.outvars[0].aval.dtype)
    return result


def _exact_float(value: _Affine, dtype: Any) -> _Float | None:
    """`value` as a `_Float` where it is one number that the floating `dtype` holds
    exactly (a fill such as `-1e9` in float32), else `None`: a sum the dtype rounds
    (`2.0**24 + 1` is `2.0**24` in float32) is not the number the program compares."""
    if not jnp.issubdtype(dtype, jnp.floating) or any(value.coefficients):
        return None
    held = float(np.asarray(float(value.constant), dtype))
    if not math.isfinite(held) or int(held) != value.constant:
        return None
    return _Float(held)


def _held(value: _Affine, aval: Any) -> bool:
    """Whether every entry of `value`, an array of `aval`'s shape, is exact in its dtype:
    within an integer type's range, or a float's range of consecutive integers."""
    spans = [c * (size - 1) for c, size in zip(value.coefficients, aval.shape, strict=True)]
    low = value.constant + sum(min(0, s) for s in spans)
    high = value.constant + sum(max(0, s) for s in spans)
    dtype = np.dtype(aval.dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return int(info.min) <= low and high <= int(info.max)
    largest = 2 ** (jnp.finfo(dtype).nmant + 1)
    return -largest <= low and high <= largest


# Equations that move or repeat an array's entries, read for each kind of value.
_MOVES = ("broadcast_in_dim", "reshape", "slice", "tile")


def _symbolic(eqn: Any, operands: list[Any]) -> Any:
    name = eqn.primitive.name
    out_shape = tuple(eqn.outvars[0].aval.shape)
    if name == "iota":
        coefficients = [0] * len(out_shape)
        coefficients[eqn.params["dimension"]] = 1
        return _Affine(_unit_axes_zeroed(coefficients, out_shape), 0)
    if name in ("jit", "pjit"):
        if any(o is None for o in operands):
            return None
        (result,) = _evaluate(eqn.params["jaxpr"], operands)
        return result
    if any(o is None for o in operands):
        return None
    if isinstance(operands[0], _Float) and name in _MOVES:
        return operands[0]
    if isinstance(operands[0], _Indicator | _Choice) and name in _MOVES:
        kept = _symbolic(eqn, [operands[0].kept])
        return None if kept is None else dataclasses.replace(operands[0], kept=kept)
    if name == "broadcast_in_dim":
        return _remap(operands[0], dict(enumerate(eqn.params["broadcast_dimensions"])),
                      len(out_shape), out_shape)
    if name == "reshape":
        return _reshape(operands[0], tuple(eqn.invars[0].aval.shape), out_shape)
    if name == "slice":
        return _sliced(operands[0], eqn.params, out_shape)
    if name == "tile":
        return _tiled(operands[0], tuple(eqn.invars[0].aval.shape), eqn.params["reps"],
                      out_shape)
    if name == "convert_element_type":
        return _converted(eqn, operands[0])
    if name == "select_n" and len(operands) == 3:
        return _select(*operands) or _choice(*operands)
    if any(isinstance(o, _Choice) for o in operands):
        return _choice_compared(name, operands)
    if name == "log" and isinstance(operands[0], _Indicator):  # Mistral's reference
        return _Choice(operands[0].kept, 0.0, -math.inf)
    if any(isinstance(o, _Indicator) for o in operands):
        return _indicator_op(name, operands)
    if name in ("add", "sub", "mul", "neg"):
        return _arithmetic(name, operands, out_shape)
    if name in ("lt", "le", "gt", "ge", "eq", "ne"):
        return _compare(name, operands, out_shape)
    if name == "and":
        return _conjunction(*operands) if all(isinstance(o, _Intervals)
                                              for o in operands) else None
    if name == "not":
        return _negation(operands[0])
    return None


def _converted(eqn: Any, value: Any) -> Any:
    """A conversion's value: a boolean mask to numbers an indicator, an indicator to
    booleans its mask; otherwise the value where the conversion keeps it."""
    if eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
        return value  # a weakly typed value made strong (`jnp.full(s, 0.0).astype(f32)`)
    to_bool = eqn.outvars[0].aval.dtype == np.bool_
    if isinstance(value, _Intervals) and not to_bool:
        return _Indicator(value)
    if isinstance(value, _Indicator):
        return value.kept if to_bool else value
    if isinstance(value, _Float | _Choice):
        return value if _held_exactly(value, eqn.outvars[0].aval.dtype) else None
    return value if _same_kind(eqn) else None


def _held_exactly(value: _Float | _Choice, dtype: Any) -> bool:
    """Whether the floating `dtype` holds each number of `value` as it is (a mask of 0
    and `-inf` made in bfloat16 and cast to float32); a conversion that rounds one, or
    any to integers, is no such value."""
    numbers = [value.value] if isinstance(value, _Float) else [value.on, value.off]
    return jnp.issubdtype(dtype, jnp.floating) and all(
        float(np.asarray(n, dtype)) == n for n in numbers)


def _constant(value: Any) -> int | None:
    """The value of an integer array equal everywhere, else `None`."""
    if isinstance(value, _Affine) and not any(value.coefficients):
        return value.constant
    return None


def _indicator_op(name: str, operands: list[Any]) -> Any:
    """An equation of an indicator: a product with another one (or with 1), or a
    comparison with a number (true where the indicator's 0 or 1 compares so)."""
    if name == "mul":
        return _indicator_product(operands)
    if name == "sub":
        return _difference(*operands)
    found = _compared(name, operands, _Indicator, _constant)
    if found is None:
        return None
    indicator, holds = found
    return _where_held(indicator.kept, holds(1), holds(0))


def _indicator_product(operands: list[Any]) -> Any:
    """A product of indicators (and 1s): the indicator of their masks' conjunction; an
    indicator times another finite number `c`: `c` on its mask and 0 elsewhere (Praxis's
    additive causal mask, `(rows < cols).astype(dtype) * large_negative_number`). A
    product of infinite `c` is no choice (`0 * -inf` is NaN)."""
    masks, numbers = [], []
    for operand in operands:
        if isinstance(operand, _Indicator):
            masks.append(operand.kept)
        elif _constant(operand) != 1:
            numbers.append(_number(operand))
    kept = functools.reduce(_conjunction, masks)
    if not numbers:
        return _Indicator(kept)
    if len(numbers) != 1 or numbers[0] is None or not math.isfinite(numbers[0]):
        return None
    return _Choice(kept, numbers[0], 0.0)


_COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt,
                "le": operator.le, "gt": operator.gt, "ge": operator.ge}
_MIRRORED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _compared(name: str, operands: list[Any], kind: type,
              number_of: Callable[[Any], float | None]
              ) -> tuple[Any, Callable[[float], bool]] | None:
    """`(value, holds)` of a comparison of a `kind` value with a number (`number_of` the
    other operand), on either side: `holds(v)` is whether `v` compares so with it."""
    if name not in _COMPARISONS or len(operands) != 2:
        return None
    value, other = operands
    if not isinstance(value, kind):
        value, other, name = other, value, _MIRRORED.get(name, name)
    number = number_of(other)
    if not isinstance(value, kind) or number is None:
        return None
    compare = _COMPARISONS[name]
    return value, lambda v: compare(v, number)


def _where_held(kept: Any, held_on: bool, held_off: bool) -> Any:
    """Where a comparison holds, of a value that is one number where the mask `kept` is
    true and another elsewhere: `held_on` and `held_off` say where it holds for each."""
    if held_on and held_off:
        return _Intervals(())
    if held_on:
        return kept
    if held_off:
        return _negation(kept)
    return _Intervals((), false=True)


def _difference(minuend: Any, subtrahend: Any) -> Any:
    """`a - b` of indicators (`a` also all 1) where `b`'s mask lies within `a`'s: the
    indicator of `a`'s mask without `b`'s (`jnp.tril(ones) - jnp.tril(ones, -w)`)."""
    if _constant(minuend) == 1:
        minuend = _Indicator(_Intervals(()))
    if not (isinstance(minuend, _Indicator) and isinstance(subtrahend, _Indicator)
            and _within(subtrahend.kept, minuend.kept)):
        return None
    outside = _negation(subtrahend.kept)
    return None if outside is None else _Indicator(_conjunction(minuend.kept, outside))


def _within(inner: _Intervals, outer: _Intervals) -> bool:
    """Whether every entry `inner` keeps, `outer` keeps: each of `outer`'s constraints
    narrowed by one of `inner`'s on the same form (a sufficient condition)."""
    if inner.false or not outer.constraints:
        return True
    bounds = {form: (low, high) for form, low, high in inner.constraints}
    return not outer.false and all(
        form in bounds and low <= bounds[form][0] and bounds[form][1] <= high
        for form, low, high in outer.constraints)


def _same_kind(eqn: Any) -> bool:
    """Whether a conversion keeps the values: integers to integers, booleans to booleans."""
    before, after = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    if np.bool_ in (before, after):
        return before == after
    return np.issubdtype(before, np.integer) and np.issubdtype(after, np.integer)


def _unit_axes_zeroed(coefficients: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The coefficients with those of size-1 axes dropped (their index is always 0)."""
    return tuple(0 if size == 1 else int(c) for c, size in zip(coefficients, shape,
                                                                strict=True))


def _remap(value: Any, axis_map: dict[int, int], rank: int, out_shape: tuple[int, ...]) -> Any:
    """`value` with its axis `a` moved to `axis_map[a]` in an array of rank `rank`."""

    def form(coefficients: tuple[int, ...]) -> tuple[int, ...]:
        new = [0] * rank
        for axis, c in enumerate(coefficients):
            if c:
                new[axis_map[axis]] = c
        return _unit_axes_zeroed(new, out_shape)

    if isinstance(value, _Affine):
        if not value.coefficients:
            return _Affine((0,) * rank, value.constant)
        return _Affine(form(value.coefficients), value.constant)
    if value.false:
        return value
    return _Intervals(tuple((form(f), lo, hi) for f, lo, hi in value.constraints))


def _reshape(value: Any, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Any:
    """A reshape that only adds or drops size-1 axes moves the others; any other is none."""
    kept_in = [a for a, size in enumerate(in_shape) if size != 1]
    kept_out = [a for a, size in enumerate(out_shape) if size != 1]
    if [in_shape[a] for a in kept_in] != [out_shape[a] for a in kept_out]:
        return None
    axis_map = dict(zip(kept_in, kept_out, strict=True))
    axis_map.update({a: 0 for a, size in enumerate(in_shape) if size == 1})
    return _remap(value, axis_map, len(out_shape), out_shape)


def _sliced(value: Any, params: dict[str, Any], out_shape: tuple[int, ...]) -> Any:
    """`value` sliced with unit strides (`causal[:t, :t]` of a longer causal mask, as
    nanoGPT and Hugging Face's Flax models slice theirs): the entry at `i` is the one at
    `i + start`; any other slice is none."""
    strides, starts = params.get("strides"), params["start_indices"]
    if strides is not None and any(stride != 1 for stride in strides):
        return None

    def shift(form: tuple[int, ...]) -> int:
        return sum(c * start for c, start in zip(form, starts, strict=True))

    if isinstance(value, _Affine):
        value = _widened(value, len(out_shape))
        return _Affine(_unit_axes_zeroed(value.coefficients, out_shape),
                       value.constant + shift(value.coefficients))
    if value.false:
        return value
    return functools.reduce(_conjunction, [
        _constraint(_unit_axes_zeroed(form, out_shape), low - shift(form), high - shift(form))
        for form, low, high in value.constraints], _Intervals(()))


def _tiled(value: Any, in_shape: tuple[int, ...], reps: tuple[int, ...],
           out_shape: tuple[int, ...]) -> Any:
    """`jnp.tile` that repeats only axes of size 1 (Praxis's `jnp.tile(jnp.arange(t)[None,
    :], [t, 1])`): a broadcast, the entry at `i` the one at `i` with those axes at 0; a
    tile repeating a longer axis is periodic, no affine value or band."""
    if len(reps) != len(in_shape) or any(
            r != 1 and size != 1 for r, size in zip(reps, in_shape, strict=True)):
        return None
    return _remap(value, {a: a for a in range(len(in_shape))}, len(out_shape), out_shape)


def _widened(value: _Affine, rank: int) -> _Affine:
    return value if value.coefficients else _Affine((0,) * rank, value.constant)


def _arithmetic(name: str, operands: list[Any], out_shape: tuple[int, ...]) -> Any:
    if not all(isinstance(o, _Affine) for o in operands):
        return None
    rank = len(out_shape)
    values = [_widened(o, rank) for o in operands]
    if name == "neg":
        (a,) = values
        return _Affine(tuple(-c for c in a.coefficients), -a.constant)
    a, b = values
    if name == "mul":
        if any(a.coefficients) and any(b.coefficients):
            return None
        factor, other = (a, b) if not any(a.coefficients) else (b, a)
        return _Affine(tuple(factor.constant * c for c in other.coefficients),
                       factor.constant * other.constant)
    sign = 1 if name == "add" else -1
    return _Affine(tuple(x + sign * y for x, y in zip(a.coefficients, b.coefficients,
                                                      strict=True)),
                   a.constant + sign * b.constant)


def _compare(name: str, operands: list[Any], out_shape: tuple[int, ...]) -> Any:
    """`lhs - rhs = form . i + k` compared with 0: the interval of `form . i`."""
    difference = _arithmetic("sub", operands, out_shape)
    if difference is None:
        return None
    form, k = difference.coefficients, difference.constant
    if name == "ne":  # one interval only where it is everywhere true or everywhere false
        return None if any(form) else _Intervals((), false=k == 0)
    low, high = {"lt": (-math.inf, -k - 1), "le": (-math.inf, -k), "gt": (-k + 1, math.inf),
                 "ge": (-k, math.inf), "eq": (-k, -k)}[name]
    return _constraint(form, low, high)


def _constraint(form: tuple[int, ...], low: float, high: float) -> _Intervals:
    """`low <= form . i <= high`, the form's first coefficient made positive."""
    if not any(form):
        return _Intervals((), false=not low <= 0 <= high)
    if next(c for c in form if c) < 0:
        form, low, high = tuple(-c for c in form), -high, -low
    return _Intervals(((form, low, high),))


def _conjunction(a: _Intervals, b: _Intervals) -> _Intervals:
    if a.false or b.false:
        return _Intervals((), false=True)
    merged: dict[tuple[int, ...], tuple[float, float]] = {}
    for form, low, high in (*a.constraints, *b.constraints):
        lo, hi = merged.get(form, (-math.inf, math.inf))
        merged[form] = (max(lo, low), min(hi, high))
    return _Intervals(tuple((form, lo, hi) for form, (lo, hi) in merged.items()))


def _negation(value: Any) -> Any:
    """`~value` where it is again an interval: of one one-sided constraint, or a constant."""
    if not isinstance(value, _Intervals):
        return None
    if value.false:
        return _Intervals(())
    if not value.constraints:
        return _Intervals((), false=True)
    if len(value.constraints) != 1:
        return None
    ((form, low, high),) = value.constraints
    if low == -math.inf and high != math.inf:
        return _Intervals(((form, high + 1, math.inf),))
    if high == math.inf and low != -math.inf:
        return _Intervals(((form, -math.inf, low - 1),))
    return None


def _select(predicate: Any, on_false: Any, on_true: Any) -> Any:
    """`select_n(p, a, b)` (`b` where `p`) of booleans, one of `a` and `b` all False; or
    of numbers, one of them all 0 and the other all 1 or an indicator (`jnp.tril`)."""
    if isinstance(predicate, _Intervals) and not isinstance(on_false, _Intervals):
        kept = [_Intervals(()) if _constant(o) == 1 else o.kept
                if isinstance(o, _Indicator) else None for o in (on_false, on_true)]
        if _constant(on_false) == 0 and kept[1] is not None:
            selected = _select(predicate, _Intervals((), false=True), kept[1])
        elif _constant(on_true) == 0 and kept[0] is not None:
            selected = _select(predicate, kept[0], _Intervals((), false=True))
        else:
            return None
        return None if selected is None else _Indicator(selected)
    if not all(isinstance(o, _Intervals) for o in (predicate, on_false, on_true)):
        return None
    if on_false.false:
        return _conjunction(predicate, on_true)
    if on_true.false:
        negated = _negation(predicate)
        return None if negated is None else _conjunction(negated, on_false)
    return None


def _number(value: Any) -> float | None:
    """The number an array equal everywhere holds, else `None`."""
    if isinstance(value, _Float):
        return value.value
    constant = _constant(value)
    return None if constant is None else float(constant)


def _choice(predicate: Any, on_false: Any, on_true: Any) -> _Choice | None:
    """`select_n(p, a, b)` of two numbers: `b` where the interval `p` holds, else `a`."""
    on, off = _number(on_true), _number(on_false)
    if not isinstance(predicate, _Intervals) or on is None or off is None:
        return None
    return _Choice(predicate, on, off)


def _choice_compared(name: str, operands: list[Any]) -> _Intervals | None:
    """A choice compared with a number (of the same dtype, unconverted: the numbers as
    the program holds them): true where the number the choice holds there compares so
    (MaxText's `mask >= fill * 0.5`)."""
    found = _compared(name, operands, _Choice, _number)
    if found is None:
        return None
    choice, holds = found
    return _where_held(choice.kept, holds(choice.on), holds(choice.off))
