"""`PallasMosaicTpuLayerNorm`: layer norm / RMSNorm over the last axis as a Pallas Mosaic
TPU kernel, with the pre-norm residual add fused when `residual=` is given.

The kernel is in `_mosaic_tpu_kernels.py`; this module flattens the call to
`(rows, n)`, checks what the kernel takes, and picks its row block per TPU generation
(`_mosaic_tpu_common.py`). The gradient is `PallasMosaicTpuLayerNormVjp`, from
the family's `(mean, rstd)` residuals (any forward's).

Nothing here has run on a TPU: it is tested in Pallas's interpreter on a CPU and lowered
for TPUs by `jax.export`; `implementation=None` runs it only where a measurement on a
TPU shows it faster than the XLA path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax

from tokamax_kernels._mosaic_tpu import MosaicTpuKernel
from tokamax_kernels.layer_norm._mosaic_tpu_common import (
    Config,
    check_inputs,
    fitting,
    float32_row,
    footprint,
    heuristics_config,
)
from tokamax_kernels.layer_norm._mosaic_tpu_kernels import layer_norm_forward
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu_vjp import PallasMosaicTpuLayerNormVjp
from tokamax_pass.core import BoundArguments, Op, Target


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuLayerNorm(MosaicTpuKernel, LayerNorm):
    """Layer norm / RMSNorm over the last axis on TPUs (bf16/f32, float32 statistics).

    `interpret=True` runs the kernel in the Pallas interpreter (any platform; tests).
    """

    config_cls: ClassVar[type] = Config
    # As for the Triton layer norm: XLA fuses a norm with its neighbours in a program
    # (the residual add before it, the gradient's add after it), which a kernel cannot,
    # so a kernel must win clearly alone to win in a model. Measured so on an H200, not
    # on a TPU: XLA's TPU fusion makes the same argument.
    kernel_margin: ClassVar[float] = 0.4

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_inputs(ba, self.config, backward=False)

    def _fwd(self, x: jax.Array, scale: jax.Array | None, offset: jax.Array | None, *,
             axis: int, epsilon: float, subtract_mean: bool, config: Config,
             return_residuals: bool, residual: jax.Array | None = None) -> tuple[Any, Any]:
        del axis  # the last one (check_supported)
        *lead, n = x.shape
        rows = math.prod(lead)
        fp = footprint(dict(x=x, scale=scale, offset=offset, residual=residual),
                       backward=False)
        block_rows = fp.block_rows(config)
        y, s, mean, rstd = layer_norm_forward(
            x.reshape(rows, n), None if residual is None else residual.reshape(rows, n),
            float32_row(scale), float32_row(offset), epsilon=epsilon,
            subtract_mean=subtract_mean, block_rows=block_rows,
            vmem_bytes=fp.vmem_bytes(block_rows), interpret=self.pallas_interpret())
        y = y.reshape(x.shape)
        out = y if s is None else (y, s.reshape(x.shape))
        residuals = (mean.reshape(lead), rstd.reshape(lead)) if return_residuals else None
        return out, residuals

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        return heuristics_config(ba, backward=False)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return set(fitting(ba, backward=False).values())

    def _default_vjp(self) -> Op:
        return PallasMosaicTpuLayerNormVjp(interpret=self.interpret)
