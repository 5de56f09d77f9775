"""The triangle multiplicative update: argument checks and the XLA implementation.

Supplementary Algorithms 11 (outgoing edges) and 12 (incoming edges) of AlphaFold 2
(Jumper et al. 2021), as upstream Tokamax computes them, written with this library's
ops: the two layer norms are `layer_norm` calls and the gated input projections one
`gated_linear_unit` call, so each is found, tuned and differentiated as its own op.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _validation as v
from tokamax_kernels.gated_linear_unit import gated_linear_unit
from tokamax_kernels.layer_norm import layer_norm
from tokamax_kernels.ragged_dot.base import canonical_precision

OP = "triangle_multiplication"

# `out[i, j] = sum_k left[., k] * right[., k]` over the third node k, per channel h.
# Incoming pairs left's column j with right's column i, as upstream Tokamax does.
_EQUATIONS = {
    "outgoing": "...ikh,...jkh->...ijh",
    "incoming": "...kjh,...kih->...ijh",
}


def check_arguments(x: Any, mask: Any, projection_in_weights: Any, gate_in_weights: Any,
                    projection_out_weights: Any, gate_out_weights: Any,
                    layernorm_in_scale: Any, layernorm_in_offset: Any,
                    layernorm_out_scale: Any, layernorm_out_offset: Any,
                    triangle_type: Any, *, precision: Any, epsilon: Any) -> None:
    """`ValueError` naming the first argument of the wrong shape, dtype or value."""
    v.require_rank("x", x, range(3, 64), op=OP)
    v.require_float("x", x, op=OP)
    *_, n, n2, c = x.shape
    if n != n2:
        raise ValueError(f"{OP}: x must be a pair representation (..., N, N, C), got shape "
                         f"{tuple(x.shape)}")
    v.require_array("mask", mask, op=OP)
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.floating)):
        raise ValueError(f"{OP}: mask must be a bool or floating-point array, got {mask.dtype}")
    v.require_shape("mask", mask, tuple(x.shape[:-1]), op=OP, why="x's shape without C")
    v.require_rank("projection_in_weights", projection_in_weights, (3,), op=OP)
    h = projection_in_weights.shape[-1]
    v.require_rank("projection_out_weights", projection_out_weights, (2,), op=OP)
    d = projection_out_weights.shape[-1]
    shapes = {
        "projection_in_weights": ((c, 2, h), "(C, 2, H), C = x's last axis"),
        "gate_in_weights": ((c, 2, h), "(C, 2, H), as projection_in_weights"),
        "projection_out_weights": ((h, d), "(H, D)"),
        "gate_out_weights": ((c, d), "(C, D), D = projection_out_weights' last axis"),
        "layernorm_in_scale": ((c,), "C"),
        "layernorm_in_offset": ((c,), "C"),
        "layernorm_out_scale": ((h,), "H"),
        "layernorm_out_offset": ((h,), "H"),
    }
    arrays = dict(projection_in_weights=projection_in_weights, gate_in_weights=gate_in_weights,
                  projection_out_weights=projection_out_weights,
                  gate_out_weights=gate_out_weights, layernorm_in_scale=layernorm_in_scale,
                  layernorm_in_offset=layernorm_in_offset,
                  layernorm_out_scale=layernorm_out_scale,
                  layernorm_out_offset=layernorm_out_offset)
    for name, (shape, why) in shapes.items():
        v.require_float(name, arrays[name], op=OP)
        v.require_shape(name, arrays[name], shape, op=OP, why=why)
    v.reject_traced("triangle_type", triangle_type, op=OP)
    if not isinstance(triangle_type, str) or triangle_type not in _EQUATIONS:
        raise ValueError(f"{OP}: triangle_type must be 'outgoing' or 'incoming', got "
                         f"{triangle_type!r}")
    canonical_precision(precision, op=OP)
    v.static_number("epsilon", epsilon, op=OP, minimum=0.0, inclusive=True)


def xla_triangle_multiplication(
        x: jax.Array, mask: jax.Array, projection_in_weights: jax.Array,
        gate_in_weights: jax.Array, projection_out_weights: jax.Array,
        gate_out_weights: jax.Array, layernorm_in_scale: jax.Array,
        layernorm_in_offset: jax.Array, layernorm_out_scale: jax.Array,
        layernorm_out_offset: jax.Array, triangle_type: str, *, precision: Any,
        epsilon: float, implementation: str | None) -> jax.Array:
    """The update of `x` (..., N, N, C) -> (..., N, N, D), in the dtype of its products.

    `implementation` goes to the nested `layer_norm` and `gated_linear_unit` calls. The
    GEMMs and the triangle einsum run in the inputs' dtype with `precision` (float32
    accumulation), the norms' statistics and the output gate in float32.
    """
    normed = layer_norm(x, layernorm_in_scale, layernorm_in_offset, epsilon=epsilon,
                        implementation=implementation)
    c, _, h = projection_in_weights.shape
    # sigmoid(normed @ gate) * (normed @ projection) for the left and right edges at once:
    # (C, 2, H) flattens to (C, 2H) as [left | right].
    edges = gated_linear_unit(
        normed, (gate_in_weights.reshape(c, 2 * h), projection_in_weights.reshape(c, 2 * h)),
        activation=jax.nn.sigmoid, precision=precision, implementation=implementation)
    edges = edges * mask[..., None].astype(edges.dtype)
    triangles = jnp.einsum(_EQUATIONS[triangle_type], edges[..., :h], edges[..., h:],
                           precision=precision)
    triangles = layer_norm(triangles, layernorm_out_scale, layernorm_out_offset,
                           epsilon=epsilon, implementation=implementation)
    out = jnp.matmul(triangles, projection_out_weights, precision=precision)
    gate = jnp.matmul(normed, gate_out_weights, precision=precision)
    wide = jnp.promote_types(out.dtype, jnp.float32)
    return (out.astype(wide) * jax.nn.sigmoid(gate.astype(wide))).astype(out.dtype)
