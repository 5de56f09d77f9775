"""The grouped gated linear unit (MoE expert GEMMs): checks, the XLA computation, and the
gradient that every grouped implementation shares.

Rows of `x` (M, K) come in consecutive groups (`group_sizes` (G,), as in a ragged dot);
group g multiplies its rows by its own weights: fused (G, K, 2, N) (`[:, :, 0]` gate,
`[:, :, 1]` up) or a pair `(w_gate, w_up)` of (G, K, N). Rows past `sum(group_sizes)`
give zeros. The residuals are the pre-activations in the inputs' dtype, as autodiff of
`act(gate) * up` keeps them: fused weights give one (M, 2N) array `[gate | up]` (the
ragged dot's own output), a pair gives `(gate, up)`. The gradient reads them (no GEMM
is recomputed) and runs its GEMMs as ragged dots of the `ragged_dot` family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_kernels import _validation as v
from tokamax_kernels.ragged_dot.base import xla_ragged_dot
from tokamax_pass.core import Op

_OP = "gated_linear_unit"


def check_grouped(x: Any, weights: Any, group_sizes: Any) -> None:
    """`ValueError` naming the argument when a grouped call's inputs do not fit together."""
    v.require_rank("x", x, (2,), op=_OP)
    if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
        raise ValueError(f"{_OP}: group_sizes must be an int32 array of shape (G,), got "
                         f"{type(group_sizes).__name__}")
    v.require_rank("group_sizes", group_sizes, (1,), op=_OP)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{_OP}: group_sizes must be an integer array (e.g. int32), got "
                         f"{group_sizes.dtype}")
    m, k = x.shape
    v.require_sizes_dtype_holds("group_sizes", group_sizes, m, op=_OP, rows_of="x")
    parts: tuple[Any, ...]
    if isinstance(weights, tuple):
        if len(weights) != 2:
            raise ValueError(f"{_OP}: weights must be one (G, K, 2, N) array or a pair "
                             f"(w_gate, w_up), got a sequence of {len(weights)}")
        for name, w in zip(("weights[0] (w_gate)", "weights[1] (w_up)"), weights, strict=True):
            _require_grouped(name, w, 3, "(G, K, N)")
        if weights[0].shape != weights[1].shape or weights[0].dtype != weights[1].dtype:
            raise ValueError(f"{_OP}: w_gate and w_up must have the same shape and dtype, got "
                             f"{weights[0].dtype}{tuple(weights[0].shape)} and "
                             f"{weights[1].dtype}{tuple(weights[1].shape)}")
        parts, expected = weights, f"({group_sizes.shape[0]}, {k}, N)"
    else:
        _require_grouped("weights", weights, 4, "(G, K, 2, N)")
        if weights.shape[2] != 2:
            raise ValueError(f"{_OP}: fused grouped weights must have shape (G, K, 2, N) "
                             f"([:, :, 0] gate, [:, :, 1] up), got {tuple(weights.shape)}")
        parts, expected = (weights,), f"({group_sizes.shape[0]}, {k}, 2, N)"
    for w in parts:
        if w.shape[0] != group_sizes.shape[0] or w.shape[1] != k:
            raise ValueError(f"{_OP}: with group_sizes of shape {tuple(group_sizes.shape)} "
                             f"and x of shape {tuple(x.shape)}, the weights must have shape "
                             f"{expected} (one matrix per group, K = the last axis of x), got "
                             f"{tuple(w.shape)}")
        if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
            raise ValueError(f"{_OP}: with group_sizes, x and the weights must have one dtype "
                             f"(the ragged dot's), got {x.dtype} and {w.dtype}; cast one")
    _check_concrete_sizes(group_sizes, m)


def _require_grouped(name: str, w: Any, rank: int, shape: str) -> None:
    if getattr(w, "ndim", None) != rank:
        raise ValueError(f"{_OP}: with group_sizes, {name} must be grouped, of shape {shape}, "
                         f"got shape {tuple(getattr(w, 'shape', ()))}; leave group_sizes out "
                         f"for one weight matrix shared by all rows")
    v.require_float(name, w, op=_OP)


def _check_concrete_sizes(group_sizes: Any, m: int) -> None:
    """Negative sizes or a total above M are errors when the sizes are known now (the
    total only against a known M: a symbolic one, under `jax.export`, cannot be compared)."""
    if isinstance(group_sizes, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"{_OP}: group_sizes must be >= 0, got {sizes.tolist()}")
    if isinstance(m, int) and int(sizes.sum()) > m:
        raise ValueError(f"{_OP}: group_sizes sum to {int(sizes.sum())}, more than the {m} "
                         f"rows of x")


def gate_up_weights(weights: Any) -> tuple[Any, int, Any]:
    """`(gate matrices, up column offset, up matrices)`: fused weights as one (G, K, 2N)
    view (free: a reshape) passed for both, the up columns starting at N."""
    if isinstance(weights, tuple):
        return weights[0], 0, weights[1]
    g, k, _, n = weights.shape
    both = weights.reshape(g, k, 2 * n)
    return both, n, both


def grouped_forward(x: jax.Array, weights: Any, group_sizes: jax.Array, *,
                    activation: Callable[[Any], Any], precision: Any
                    ) -> tuple[jax.Array, Any]:
    """`(out, residuals)` by `jax.lax.ragged_dot`, as the plain expression computes them:
    one (G, K, 2N) ragged dot for fused weights (two for a pair), then the activation in
    float32, cast back to x's dtype. The ragged dots are the `ragged_dot` family's XLA
    form, which runs under `jax.vmap` (JAX batches `jax.lax.ragged_dot` only when every
    operand is mapped)."""
    def ragged_dot(w: jax.Array) -> jax.Array:
        return xla_ragged_dot("forward", precision, None)(x, w, group_sizes)

    if isinstance(weights, tuple):
        gate, up = ragged_dot(weights[0]), ragged_dot(weights[1])
        residuals: Any = (gate, up)
    else:
        both, n, _ = gate_up_weights(weights)
        residuals = ragged_dot(both)
        gate, up = residuals[:, :n], residuals[:, n:]
    wide = jnp.promote_types(gate.dtype, jnp.float32)
    out = activation(gate.astype(wide)) * up.astype(wide)
    return out.astype(x.dtype), residuals


def split_residuals(residuals: Any) -> tuple[jax.Array, jax.Array]:
    if isinstance(residuals, tuple):
        return residuals
    n = residuals.shape[1] // 2
    return residuals[:, :n], residuals[:, n:]


def _gate_gradients(residuals: Any, dout: jax.Array, activation: Callable[[Any], Any]
                    ) -> tuple[jax.Array, jax.Array]:
    """`(dgate, dup)` in the residuals' dtype: one elementwise pass in float32."""
    gate, up = split_residuals(residuals)
    wide = jnp.promote_types(gate.dtype, jnp.float32)
    activated, activation_vjp = jax.vjp(activation, gate.astype(wide))
    dy = dout.astype(wide)
    (dgate,) = activation_vjp(dy * up.astype(wide))
    return dgate.astype(gate.dtype), (dy * activated).astype(gate.dtype)


def gradient_calls(dgates: Any, x: Any, weights: Any, group_sizes: Any, precision: Any
                   ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """The ragged dots of the gradient: `[(what, args, kwargs)]` for the `ragged_dot`
    family (`what`: "dx", or "dw" / "dw_gate" / "dw_up"). `dgates` is one (M, 2N) array
    `[dgate | dup]` for fused weights (one dlhs against the (G, K, 2N) view, one drhs),
    `(dgate, dup)` for a pair (two of each, as autodiff of the pair's expression runs)."""
    common = dict(precision=precision, preferred_element_type=x.dtype)
    if not isinstance(weights, tuple):
        g, k, _, n = weights.shape
        both = (jax.ShapeDtypeStruct((g, k, 2 * n), weights.dtype)
                if isinstance(weights, jax.ShapeDtypeStruct) else weights.reshape(g, k, 2 * n))
        return [("dx", (dgates, both, group_sizes), dict(common, variant="dlhs")),
                ("dw", (x, dgates, group_sizes), dict(common, variant="drhs"))]
    (w_gate, w_up), (dgate, dup) = weights, dgates
    return [("dx", (dgate, w_gate, group_sizes), dict(common, variant="dlhs")),
            ("dx", (dup, w_up, group_sizes), dict(common, variant="dlhs")),
            ("dw_gate", (x, dgate, group_sizes), dict(common, variant="drhs")),
            ("dw_up", (x, dup, group_sizes), dict(common, variant="drhs"))]


def abstract_gradient_calls(x: Any, weights: Any, group_sizes: Any, precision: Any
                            ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """`gradient_calls` on shapes only (what the gradient will run, for evidence): fused
    weights are viewed as (G, K, 2N) by shape, as reshaping the array itself is refused
    where its type carries a sharding over N (Explicit axes)."""
    m, n = x.shape[0], weights[0].shape[2] if isinstance(weights, tuple) else weights.shape[3]
    if isinstance(weights, tuple):
        dgates: Any = (jax.ShapeDtypeStruct((m, n), x.dtype),) * 2
    else:
        dgates = jax.ShapeDtypeStruct((m, 2 * n), x.dtype)
        weights = jax.ShapeDtypeStruct(weights.shape, weights.dtype)
    return gradient_calls(dgates, x, weights, group_sizes, precision)


def grouped_backward(ragged_dot: Op, residuals: Any, dout: jax.Array, *, x: jax.Array,
                     weights: Any, group_sizes: jax.Array, activation: Callable[[Any], Any],
                     precision: Any) -> dict[str, Any]:
    """`{"x": dx, "weights": dweights}` (dweights in the form of `weights`): `dgate` and
    `dup` elementwise from the residuals, then the ragged dots of `gradient_calls`, each
    a call of the `ragged_dot` op `ragged_dot` (tuned and cached as its own shape)."""
    dgate, dup = _gate_gradients(residuals, dout, activation)
    dgates = (dgate, dup) if isinstance(weights, tuple) else jnp.concatenate([dgate, dup], 1)
    results: dict[str, list[jax.Array]] = {}
    for what, args, kwargs in gradient_calls(dgates, x, weights, group_sizes, precision):
        results.setdefault(what, []).append(ragged_dot(*args, **kwargs))
    dx = sum(results["dx"][1:], results["dx"][0])
    if isinstance(weights, tuple):
        return {"x": dx, "weights": (results["dw_gate"][0], results["dw_up"][0])}
    return {"x": dx, "weights": results["dw"][0].reshape(weights.shape)}
