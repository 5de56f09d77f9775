"""The layer-norm family: argument checks and the XLA reference (layer norm and RMSNorm)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_kernels import _validation as v
from tokamax_pass.core import BoundArguments, NullConfig, Op

_OP = "layer_norm"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerNorm(Op[NullConfig]):
    """`(x - mean) * rsqrt(var + epsilon) * scale + offset` over `axis`, in float32.

    `subtract_mean=False` is RMSNorm. Residuals are `(mean, rstd)` in float32 with
    the normalized axis removed (`mean` is zero for RMSNorm); every implementation
    of the family returns them alike so forward and backward can be chosen apart.
    """

    def partition_rule(self, ba: BoundArguments) -> Any:
        """How a call splits over devices (`tokamax_pass.core.sharding`)."""
        from tokamax_kernels.layer_norm.sharding import partition_rule

        return partition_rule(ba)

    def similarity_arguments(self, arguments: Any) -> dict[str, Any]:
        """Rows x features in x's dtype: how leading axes split, the scale's and offset's
        presence and dtype, and epsilon do not change a norm's speed measurably."""
        x = arguments["x"]
        features = x.shape[arguments["axis"]]
        return {"x": jax.ShapeDtypeStruct((math.prod(x.shape) // max(features, 1), features),
                                          x.dtype),
                "subtract_mean": arguments["subtract_mean"]}

    def bind(self, x: Any, scale: Any = None, offset: Any = None, *, axis: int = -1,
             epsilon: float = 1e-6, subtract_mean: bool = True) -> BoundArguments:
        v.require_rank("x", x, range(1, 64), op=_OP)
        v.require_float("x", x, op=_OP)
        axis = v.canonical_axis(axis, x.ndim, op=_OP)
        for name, param in (("scale", scale), ("offset", offset)):
            if param is not None:
                v.require_array(name, param, op=_OP)
                v.require_float(name, param, op=_OP)
                v.require_shape(name, param, (x.shape[axis],), op=_OP,
                                why=f"the length of x along axis {axis}")
        if not float(epsilon) >= 0:
            raise ValueError(f"{_OP}: epsilon must be >= 0, got {epsilon}")
        return BoundArguments(self, dict(
            x=x, scale=scale, offset=offset, axis=axis, epsilon=float(epsilon),
            subtract_mean=bool(subtract_mean),
        ))

    def _fwd(self, x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
             axis: int, epsilon: float, subtract_mean: bool, config: NullConfig,
             return_residuals: bool) -> tuple[jax.Array, Any]:
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
