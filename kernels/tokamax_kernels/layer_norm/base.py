"""The layer-norm family: argument checks and the XLA reference (layer norm and RMSNorm),
optionally fused with the pre-norm residual add (`residual=`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _validation as v
from tokamax_pass.core import BoundArguments, Op

_OP = "layer_norm"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerNorm(Op[Any]):
    """`(x - mean) * rsqrt(var + epsilon) * scale + offset` over `axis`, in float32.

    `subtract_mean=False` is RMSNorm. Residuals are `(mean, rstd)` in float32 with
    the normalized axis removed (`mean` is zero for RMSNorm); every implementation
    of the family returns them alike so forward and backward can be chosen apart.

    With `residual` (an array like `x`), the call is a transformer's pre-norm residual
    step: `s = residual + x` in `x`'s dtype, as plain JAX rounds it, and the output is
    `(norm(s), s)`; the residuals are then `s`'s statistics. Without one, `residual` is
    left out of the bound arguments altogether, so such calls keep their cache keys.
    """

    # Autodiff of the norm recomputes only the row statistics (one read of `x`); the
    # gradient's own passes over `x`, `dout` and `dx` and its column sums for the scale
    # and offset are most of its work, so its time alone is what it costs in a program.
    autodiff_reruns_products = False

    def partition_rule(self, ba: BoundArguments) -> Any:
        """How a call splits over devices (`tokamax_pass.core.sharding`)."""
        from tokamax_kernels.layer_norm.sharding import partition_rule

        return partition_rule(ba)

    def similarity_arguments(self, arguments: Any) -> dict[str, Any]:
        """Rows x features in x's dtype: how leading axes split, the scale's and offset's
        presence and dtype, and epsilon do not change a norm's speed measurably; a
        residual does."""
        x = arguments["x"]
        features = x.shape[arguments["axis"]]
        found = {"x": jax.ShapeDtypeStruct((math.prod(x.shape) // max(features, 1), features),
                                           x.dtype),
                 "subtract_mean": arguments["subtract_mean"]}
        if arguments.get("residual") is not None:  # a second input and output to move
            found["residual"] = True
        return found

    def bind(self, x: Any, scale: Any = None, offset: Any = None, *, axis: int = -1,
             epsilon: float = 1e-6, subtract_mean: bool = True,
             residual: Any = None) -> BoundArguments:
        v.require_rank("x", x, range(1, 64), op=_OP)
        v.require_float("x", x, op=_OP)
        axis = v.canonical_axis(axis, x.ndim, op=_OP)
        for name, param in (("scale", scale), ("offset", offset)):
            if param is not None:
                v.require_array(name, param, op=_OP)
                v.require_float(name, param, op=_OP)
                v.require_shape(name, param, (x.shape[axis],), op=_OP,
                                why=f"the length of x along axis {axis}")
        epsilon = v.static_number("epsilon", epsilon, op=_OP, minimum=0.0, inclusive=True)
        arguments = dict(x=x, scale=scale, offset=offset, axis=axis, epsilon=epsilon,
                         subtract_mean=v.require_bool("subtract_mean", subtract_mean, op=_OP))
        if residual is not None:
            _check_residual(x, residual)
            arguments["residual"] = residual
        return BoundArguments(self, arguments)

    def _fwd(self, x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
             axis: int, epsilon: float, subtract_mean: bool, config: Any,
             return_residuals: bool, residual: jax.Array | None = None) -> tuple[Any, Any]:
        if residual is None:
            return _normalized(x, scale, offset, axis, epsilon, subtract_mean)
        s = x + residual
        y, residuals = _normalized(s, scale, offset, axis, epsilon, subtract_mean)
        return (y, s), residuals


def _check_residual(x: Any, residual: Any) -> None:
    v.require_array("residual", residual, op=_OP)
    if tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype:
        raise ValueError(
            f"{_OP}: residual must have x's shape and dtype {x.dtype}{list(x.shape)} (it is "
            f"added to x before the norm), got {residual.dtype}{list(residual.shape)}; cast or "
            "reshape it, or add it yourself and pass residual=None")


def _normalized(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, axis: int,
                epsilon: float, subtract_mean: bool) -> tuple[jax.Array, Any]:
    """`(y, (mean, rstd))`: `x` normalized over `axis` in float32, `y` in `x`'s dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=axis, keepdims=True) if subtract_mean else jnp.zeros_like(
        jnp.sum(xf, axis=axis, keepdims=True))
    centered = xf - mean
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=axis, keepdims=True) + epsilon)
    y = centered * rstd
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    if scale is not None:
        y = y * scale.astype(jnp.float32).reshape(shape)
    if offset is not None:
        y = y + offset.astype(jnp.float32).reshape(shape)
    residuals = (jnp.squeeze(mean, axis), jnp.squeeze(rstd, axis))
    return y.astype(x.dtype), residuals
