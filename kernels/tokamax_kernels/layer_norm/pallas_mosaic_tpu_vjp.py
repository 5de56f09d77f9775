"""`PallasMosaicTpuLayerNormVjp`: the layer norm's gradient as a Pallas Mosaic TPU kernel.

From the family's `(mean, rstd)` residuals (any forward's), one kernel writes dx and each
row block's column sums for dscale and doffset, which XLA adds up
(`_mosaic_tpu_kernels.py`). With a `residual`, the forward returned `(y, s)`: the
kernel normalizes `s` (the saved output: nothing is recomputed) and adds `ds` to dx as
it writes it, `dx + ds` being the one gradient of both `x` and `residual`.

Nothing here has run on a TPU (see `pallas_mosaic_tpu.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_kernels._mosaic_tpu import MosaicTpuKernel
from tokamax_kernels.layer_norm._mosaic_tpu_common import (
    DTYPES,
    Config,
    check_inputs,
    fitting,
    float32_row,
    footprint,
    heuristics_config,
)
from tokamax_kernels.layer_norm._mosaic_tpu_kernels import layer_norm_backward
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_pass.core import AutodiffVjp, BoundArguments, Op, Target, VjpOp


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuLayerNormVjp(MosaicTpuKernel, VjpOp):
    """The gradient of `LayerNorm` over the last axis on TPUs (bf16/f32).

    `interpret=True` runs the kernel in the Pallas interpreter (any platform; tests).
    """

    config_cls: ClassVar[type] = Config
    forward_family: ClassVar[type[Op] | None] = LayerNorm
    # See PallasMosaicTpuLayerNorm.kernel_margin.
    kernel_margin: ClassVar[float] = 0.4

    def reference_op(self) -> Op:
        return AutodiffVjp(forward=LayerNorm())

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_inputs(ba, self.config, backward=True)
        for dout in jax.tree.leaves(ba.arguments["dout"]):  # (dy, ds) with a residual
            if jnp.dtype(dout.dtype) not in DTYPES:
                raise NotImplementedError(
                    f"the Mosaic TPU layer norm takes bf16 and f32, not a cotangent of "
                    f"{dout.dtype}")

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Config,
             return_residuals: bool, x: jax.Array, scale: jax.Array | None,
             offset: jax.Array | None, axis: int, epsilon: float,
             subtract_mean: bool, residual: jax.Array | None = None
             ) -> tuple[dict[str, Any], None]:
        del return_residuals, axis, epsilon  # the last axis; rstd holds epsilon
        mean, rstd = residuals
        # With a residual the forward normalized s = x + residual, its second output.
        (normalized, dy, ds) = (x, dout, None) if residual is None else (out[1], *dout)
        *lead, n = x.shape
        rows = math.prod(lead)
        fp = footprint(dict(x=x, scale=scale, offset=offset, residual=residual),
                       backward=True)
        block_rows = fp.block_rows(config)
        dx, dscale, doffset = layer_norm_backward(
            normalized.reshape(rows, n), dy.reshape(rows, n),
            mean.astype(jnp.float32).reshape(rows, 1), rstd.astype(jnp.float32).reshape(rows, 1),
            float32_row(scale), None if ds is None else ds.reshape(rows, n),
            subtract_mean=subtract_mean, want_dscale=scale is not None,
            want_doffset=offset is not None, block_rows=block_rows,
            vmem_bytes=fp.vmem_bytes(block_rows), interpret=self.pallas_interpret())
        grads = {"x": dx.reshape(x.shape)}
        if residual is not None:
            grads["residual"] = grads["x"]
        if scale is not None and dscale is not None:  # asked for exactly with a scale
            grads["scale"] = dscale.astype(scale.dtype)
        if offset is not None and doffset is not None:
            grads["offset"] = doffset.astype(offset.dtype)
        return grads, None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        return heuristics_config(ba, backward=True)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return set(fitting(ba, backward=True).values())
