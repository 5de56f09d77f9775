"""`PallasMosaicGpuGatedLinearUnit`: the grouped gated linear unit (MoE expert GEMMs) as one
Hopper Mosaic GPU kernel, the activation fused into the ragged dot's epilogue.

The kernel (`_mosaic_gpu_kernel.py`) is the Mosaic ragged dot's forward with a gate and
an up accumulator per output tile; only the (M, N) output reaches memory, plus the
pre-activations when the call is differentiated (the residuals the gradient reads, as
autodiff of the plain expression keeps them). The gradient,
`PallasMosaicGpuGatedLinearUnitVjp`, runs its GEMMs as Mosaic ragged dots. Only grouped
calls (`group_sizes`): the dense GLU has the Triton kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.extend
import jax.numpy as jnp

from tokamax_kernels.gated_linear_unit._grouped import gate_up_weights
from tokamax_kernels.gated_linear_unit._mosaic_gpu_kernel import glu_rows
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu_vjp import (
    PallasMosaicGpuGatedLinearUnitVjp,
)
from tokamax_kernels.ragged_dot import _mosaic_gpu_common as common
from tokamax_kernels.ragged_dot._mosaic_gpu_rows_kernel import ROW_ALIGN
from tokamax_pass.core import BoundArguments, Op, Target

Config = common.Config

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Smallest tiles the kernel runs: contraction step, output rows, output columns per CTA.
_MIN_TILE_K, _MIN_TILE_M, _MIN_CTA_N = 64, 64, 2 * 64
# Float32 accumulator elements a compute warpgroup (128 threads) may hold: gate and up
# tiles at 128 registers a thread, leaving room for the epilogue under the 232 it gets.
_MAX_ACC_ELEMS = 2 * 128 * 64
# Primitives an activation may not use in the epilogue: Mosaic GPU (jax 0.11.2,
# warpgroup semantics) cannot lower them (erf: exact gelu; custom_jvp: jax.nn.relu).
_UNLOWERABLE = frozenset({"erf", "erfc", "erf_inv", "custom_jvp_call", "custom_vjp_call"})


def _smem_bytes(config: Config, itemsize: int) -> int:
    """SMEM of the pipeline stages (an x tile, a gate and an up tile) and the epilogue."""
    stage = (config.tile_m * config.tile_k + 2 * config.tile_k * config.cta_n) * itemsize
    epilogue = common.NUM_COMPUTE_WGS * config.tile_m * config.epi_n * itemsize
    return config.num_stages * stage + epilogue


def _fits(config: Config, m: int, k: int, n: int, itemsize: int) -> bool:
    return (k % config.tile_k == 0 and n % config.cta_n == 0 and m >= config.tile_m
            and 2 * config.tile_m * config.tile_n <= _MAX_ACC_ELEMS
            and _smem_bytes(config, itemsize) <= common.SMEM_BUDGET_BYTES)


def _problem(ba: BoundArguments) -> tuple[int, int, int, int]:
    """`(M, K, N, itemsize)` of a grouped call."""
    x, weights = ba.arguments["x"], ba.arguments["weights"]
    n = weights[0].shape[2] if isinstance(weights, tuple) else weights.shape[3]
    return x.shape[0], x.shape[1], n, jnp.dtype(x.dtype).itemsize


def _primitives(jaxpr: Any) -> set[str]:
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found |= _primitives(sub)
    return found


def check_activation(activation: Callable[[Any], Any]) -> None:
    """`NotImplementedError` unless `activation` is elementwise float32 code the epilogue
    can lower."""
    tile = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    try:
        closed = jax.make_jaxpr(activation)(tile)
    except Exception as e:  # noqa: BLE001 - any failure to trace means: not here
        raise NotImplementedError(f"the Mosaic GPU GLU could not trace activation "
                                  f"{activation!r}: {e}") from None
    outs = closed.out_avals
    if len(outs) != 1 or outs[0].shape != tile.shape or outs[0].dtype != tile.dtype:
        raise NotImplementedError(f"the Mosaic GPU GLU needs an elementwise activation "
                                  f"(float32 in, same shape out), got {outs}")
    bad = _primitives(closed.jaxpr) & _UNLOWERABLE
    if bad:
        raise NotImplementedError(
            f"the Mosaic GPU GLU epilogue cannot lower {sorted(bad)} in activation "
            f"{activation!r} (exact gelu, jax.nn.relu); use gelu(approximate=True), "
            "jnp.maximum(x, 0), or implementation='xla'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuGatedLinearUnit(GatedLinearUnit):
    """The grouped gated linear unit on Hopper GPUs (bf16/f16, float32 accumulation)."""

    config_cls: ClassVar[type] = Config
    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})
    slow_lowering: ClassVar[bool] = True
    grouped: ClassVar[bool] = True

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        if "group_sizes" not in ba.arguments:
            raise NotImplementedError(
                "the Mosaic GPU GLU runs grouped calls (group_sizes) only; the dense GLU has "
                "implementation='triton' or 'xla'")
        if target is not None and not target.is_hopper:
            raise NotImplementedError(
                f"the Mosaic GPU GLU needs a Hopper GPU (H100/H200), not {target.device_kind!r}")
        x = ba.arguments["x"]
        if jnp.dtype(x.dtype) not in _DTYPES:
            raise NotImplementedError(f"the Mosaic GPU GLU needs bf16 or f16 inputs, got {x.dtype}")
        m, k, n, itemsize = _problem(ba)
        if m % ROW_ALIGN or m < _MIN_TILE_M:
            raise NotImplementedError(
                f"the Mosaic GPU GLU needs M (rows of x, {m}) a multiple of {ROW_ALIGN} and at "
                f"least {_MIN_TILE_M}")
        if k % _MIN_TILE_K:
            raise NotImplementedError(
                f"the Mosaic GPU GLU needs K ({k}) a multiple of {_MIN_TILE_K}")
        if n % _MIN_CTA_N:
            raise NotImplementedError(
                f"the Mosaic GPU GLU needs N ({n}) a multiple of {_MIN_CTA_N}")
        check_activation(ba.arguments["activation"])
        if self.config is not None and not _fits(self.config, m, k, n, itemsize):
            raise NotImplementedError(f"{self.config} does not fit the GLU {m}x{k}x{n}")

    def _fwd(self, x: jax.Array, weights: Any, *, activation: Callable[[Any], Any],
             precision: Any, config: Config, return_residuals: bool,
             group_sizes: jax.Array | None = None) -> tuple[jax.Array, Any]:
        del precision  # bf16/f16 operands, float32 accumulation
        if group_sizes is None:
            raise NotImplementedError("the Mosaic GPU GLU runs grouped calls only")
        w_gate, up_offset, w_up = gate_up_weights(weights)
        n = w_gate.shape[2] - up_offset
        out, *residuals = glu_rows(x, w_gate, w_up, group_sizes, up_offset=up_offset, n=n,
                                   activation=activation, config=config,
                                   residuals=return_residuals)
        if not return_residuals:
            return out, None
        return out, tuple(residuals) if isinstance(weights, tuple) else residuals[0]

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        """128 x 128 CTA tiles (two warpgroups of 128 x 64, a gate and an up accumulator
        each: the register file's limit), 64-deep steps, as many stages as SMEM holds.
        Where nothing was measured, `None` runs this kernel where the ragged dot it is
        predicted as (`roofline.py`) is predicted faster than XLA's;
        the config itself was timed at the model suite's MoE shapes only."""
        m, k, n, itemsize = _problem(ba)
        tile_m = 128 if m >= 128 else 64
        for stages in (4, 3, 2):
            config = Config(tile_m=tile_m, tile_n=64, tile_k=64, num_stages=stages, epi_n=64,
                            grid_minor_dim=1, grid_tile_width=8)
            if _fits(config, m, k, n, itemsize):
                return config
        raise NotImplementedError(f"no Mosaic GPU GLU config fits {ba!r}")

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        m, k, n, itemsize = _problem(ba)
        space = itertools.product((64, 128), (64, 128), (64, 128), (2, 3, 4, 5, 6), (0, 1),
                                  (1, 4, 8, 16))
        configs = set()
        for tm, tn, tk, stages, minor, width in space:
            config = Config(tile_m=tm, tile_n=tn, tile_k=tk, num_stages=stages, epi_n=64,
                            grid_minor_dim=minor, grid_tile_width=width)
            if _fits(config, m, k, n, itemsize):
                configs.add(config)
        return configs

    def _default_vjp(self) -> Op:
        return PallasMosaicGpuGatedLinearUnitVjp()
