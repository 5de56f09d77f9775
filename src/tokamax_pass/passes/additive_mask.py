"""Masks spelled as additive biases: `logits + lax.select(mask, zeros, full(fill))`, as
Hugging Face's Flax models (and EasyLM, T5 ports) turn a boolean mask into a bias of
0 and `jnp.finfo(dtype).min`, `jnp.where(mask, 0.0, fill)`, or `(1.0 - mask) * fill`
(ports of BERT).

Added to the logits, a fill of at most `SWALLOWING_FILL` swallows them whole: every key
it hides gets the same logit, the fill, so a row hidden entirely gets uniform
probabilities (the mean of the values), as a mask's fill gives. What differs from a
mask is the gradient there: autodiff of `logits + bias` differentiates the logits the
sum rounded away, the softmax's gradient at uniform probabilities, where a mask
(`jnp.where`) stops it. `hidden_row_gradient` gives the attention that gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_pass.passes import band_mask
from tokamax_pass.passes.graph import SHAPE_ONLY, Graph, literal_value, scalar_constant

# A fill added to logits of any size a model computes leaves the fill alone.
SWALLOWING_FILL = -1e30
# The floor the `triton` attention kernels hold a logit at (`HIDDEN_LOGIT` in
# `tokamax_kernels.attention._flash_tiles`): a row a bias hides whole below it averages
# its values there.
KERNEL_FLOOR = -1e5


@dataclasses.dataclass(frozen=True)
class AdditiveMask:
    """`bias` is `rest` (or nothing) plus `values`: 0 where a key is kept and `fill`
    elsewhere (so the keys kept are where `values == 0`, whatever shape it has)."""

    values: Any
    fill: float
    rest: Any = None


def read(graph: Graph, bias: Any) -> AdditiveMask | None:
    """The mask `bias` spells, alone or added to another bias (T5's position bias plus
    its mask's), else `None`."""
    fill = _fill(graph, bias)
    if fill is not None:
        return AdditiveMask(bias, fill)
    add = graph.producer(_unweakened(graph, bias), "add")
    if add is None:
        return None
    for rest, values in (add.invars, add.invars[::-1]):
        fill = _fill(graph, values)
        if fill is not None:
            return AdditiveMask(values, fill, rest)
    return None


def _unweakened(graph: Graph, var: Any) -> Any:
    """`var` before a cast to its own dtype (a weakly typed sum made strong: `causal +
    padding` of two `jnp.where(m, 0.0, -jnp.inf)` biases), else `var`."""
    cast = graph.producer(var, "convert_element_type")
    if cast is None or cast.invars[0].aval.dtype != var.aval.dtype:
        return var
    return cast.invars[0]


def _fill(graph: Graph, var: Any) -> float | None:
    """The negative constant of `var` where it is 0 or that constant as a boolean
    chooses, possibly cast, broadcast or reshaped after (the fill read in the cast's
    type: `finfo(float32).min` in bfloat16 is `-inf`); else `None`."""
    dtypes = []
    while (eqn := graph.producer(var, "convert_element_type", *SHAPE_ONLY)) is not None:
        if eqn.primitive.name == "convert_element_type":
            dtypes.append(var.aval.dtype)
        var = eqn.invars[0]
    chosen = _chosen(graph, var)
    if chosen is None:
        return _banded_fill(graph, var, dtypes)
    condition, values = chosen
    if condition.aval.dtype != jnp.bool_ or any(v is None for v in values):
        return None
    low, high = sorted(_cast(v, [var.aval.dtype, *reversed(dtypes)]) for v in values)
    return low if high == 0.0 and low < 0.0 else None


def _chosen(graph: Graph, var: Any) -> tuple[Any, list[Any]] | None:
    """`(condition, values)`: the boolean and the two constants it chooses between to make
    `var`, by `lax.select`, `jnp.where`, or `(1.0 - condition) * c` (the boolean cast to
    a float: 0 where it holds, `c` elsewhere); else `None`."""
    select = graph.producer(var, "select_n")
    if select is not None and len(select.invars) == 3:
        condition, *cases = select.invars
        return condition, [_filled(graph, v) for v in cases]
    where = graph.producer(var, "jit")
    if where is not None and where.params.get("name") == "_where" and len(where.invars) == 3:
        condition, on_true, on_false = where.invars
        return condition, [literal_value(v) for v in (on_false, on_true)]
    product = graph.producer(var, "mul")
    for complement, factor in ([] if product is None else (product.invars,
                                                           product.invars[::-1])):
        sub = graph.producer(complement, "sub")
        cast = None if sub is None else graph.producer(sub.invars[1], "convert_element_type")
        if cast is not None and literal_value(sub.invars[0]) == 1:
            return cast.invars[0], [0.0, scalar_constant(graph, factor)]
    return None


def _banded_fill(graph: Graph, var: Any, dtypes: list[Any]) -> float | None:
    """The negative number `var` holds off a band of indices, 0 on it
    (`jnp.triu(jnp.full((t, t), -jnp.inf), 1)` as Whisper spells its causal mask,
    `jnp.log(jnp.tril(ones))` as Mistral's reference does), read in the casts' types;
    else `None`."""
    numbers = band_mask.two_numbers(graph, var)
    if numbers is None:
        return None
    low, high = sorted(_cast(v, [var.aval.dtype, *reversed(dtypes)]) for v in numbers)
    return low if high == 0.0 and low < 0.0 else None


def _filled(graph: Graph, var: Any) -> Any:
    """The number every element of `var` holds, where it is a constant broadcast (and
    cast, the casts applied) to its shape (`jnp.full(shape, 0.0).astype(dtype)`)."""
    dtypes = []
    while (eqn := graph.producer(var, "broadcast_in_dim", "convert_element_type")) is not None:
        if eqn.primitive.name == "convert_element_type":
            dtypes.append(var.aval.dtype)
        var = eqn.invars[0]
    value = scalar_constant(graph, var)
    return None if value is None else _cast(value, [var.aval.dtype, *reversed(dtypes)])


def _cast(value: Any, dtypes: list[Any]) -> float:
    for dtype in dtypes:
        value = np.asarray(value).astype(dtype)
    return float(value)


def hidden_row_gradient(query: Any, key: Any, value: Any, bias: Any, scale: float) -> Any:
    """`(*batch, T, heads, Hv)` zeros whose gradient is what autodiff of the plain
    attention gives a row an additive mask hides whole: there the probabilities are
    uniform, and the logits `x = scale * q . k + bias` move the output by the softmax's
    gradient at uniform probabilities, `sum_j (x_j - mean(x)) (v_j - mean(v)) / S`
    (the values' own gradient is the mean's). Computed in the backward alone, through
    `K^T (V - mean(V))` (one small matrix per head), and for the bias (`(*batch, heads,
    T, S)`, or `None`) one product as large as the bias. Operands in the op's layout,
    `(*batch, seq, heads, head_dim)`, key and value with fewer heads (GQA)."""
    return _linearized(scale, query, key, value, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linearized(scale: float, query: Any, key: Any, value: Any, bias: Any) -> Any:
    return jnp.zeros((*query.shape[:-1], value.shape[-1]), value.dtype)


def _linearized_fwd(scale: float, query: Any, key: Any, value: Any, bias: Any
                    ) -> tuple[Any, Any]:
    return _linearized(scale, query, key, value, bias), (query, key, value, bias)


def _linearized_bwd(scale: float, saved: Any, cotangent: Any) -> tuple[Any, ...]:
    query, key, value, bias = saved
    kv_heads, keys = key.shape[-2], key.shape[-3]
    groups = query.shape[-2] // kv_heads
    v = value.astype(jnp.float32)
    centered = (v - jnp.mean(v, axis=-3, keepdims=True)) / keys
    g = cotangent.astype(jnp.float32).reshape(*cotangent.shape[:-2], kv_heads, groups,
                                              cotangent.shape[-1])
    q = query.astype(jnp.float32).reshape(*query.shape[:-2], kv_heads, groups,
                                          query.shape[-1])
    moments = jnp.einsum("...skh,...skd->...khd", key.astype(jnp.float32), centered)
    dq = scale * jnp.einsum("...tkgd,...khd->...tkgh", g, moments)
    dk = scale * jnp.einsum("...khd,...skd->...skh",
                            jnp.einsum("...tkgh,...tkgd->...khd", q, g), centered)
    dbias = None
    if bias is not None:
        dbias = jnp.einsum("...tkgd,...skd->...kgts", g, centered).reshape(bias.shape)
        dbias = dbias.astype(bias.dtype)
    return (dq.reshape(query.shape).astype(query.dtype), dk.astype(key.dtype),
            jnp.zeros_like(value), dbias)


_linearized.defvjp(_linearized_fwd, _linearized_bwd)


def data_mask_fill(graph: Graph, bias: Any) -> float | None:
    """The negative number `c` of a bias `m * c` or `(1 - m) * c` (alone or added to
    another bias) whose `m` is read as it is, numbers rather than a boolean cast (a
    padding mask of 0s and 1s from the data: the TensorFlow tutorial's `logits += mask *
    -1e9`, Keras 3's `Softmax` given a float mask), in the bias's dtype; else `None`.
    Such a bias hides keys like a mask's but is passed as a bias."""
    add = graph.producer(bias, "add")
    for term in (bias, *([] if add is None else add.invars)):
        product = graph.producer(term, "mul")
        for _, factor in ([] if product is None else (product.invars, product.invars[::-1])):
            value = _filled(graph, factor)
            if value is not None and value < 0:
                return _cast(value, [term.aval.dtype])
    return None


def keeps_hidden_logits(fill: float, dtype: Any, scale: float = 1.0) -> bool:
    """Whether a row that a bias of `fill` (added in `dtype`, not swallowing the logits,
    then multiplied by `scale` with them) hides whole keeps a softmax of its logits in
    plain JAX that the op does not compute: the fill rounds them by a unit or more
    (`spacing`), or the scaled fill lies at or below the floor the op's kernels hold
    logits at (where they average the values)."""
    return fill * scale <= KERNEL_FLOOR or spacing(fill, dtype) >= 1.0


def spacing(fill: float, dtype: Any) -> float:
    """The distance between neighbouring numbers of `dtype` at `fill`: what a sum with the
    fill rounds the logits to (64 for `-1e9` in float32)."""
    if not math.isfinite(fill) or fill == 0:
        return 0.0
    exponent = math.frexp(abs(fill))[1] - 1
    return 2.0 ** (exponent - jnp.finfo(dtype).nmant)


def swallows(fill: float) -> bool:
    """Whether a fill hides its keys exactly when added to logits (`-inf`, or a number
    that absorbs them)."""
    return fill == -math.inf or fill <= SWALLOWING_FILL
