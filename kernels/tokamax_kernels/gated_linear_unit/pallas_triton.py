"""`PallasTritonGatedLinearUnit`: `activation(x @ w_gate) * (x @ w_up)` in one Triton kernel.

Each program owns a (`block_m`, `block_n`) output tile and walks K in `block_k`
steps, loading one x tile and the matching gate and up weight tiles, with two
float32 accumulators; the activation and the product are applied on the
accumulators, so the (M, N) pre-activations never reach memory. Fused (K, 2, N)
weights are read in place as a (K, 2N) matrix (gate at column j, up at N + j).
Edges that blocks do not divide are masked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _triton
from tokamax_kernels._triton import TritonKernel
from tokamax_kernels.gated_linear_unit._triton_common import (
    Config,
    check_triton_glu_inputs,
    dual_products,
    matmul_heuristics,
    matmul_search_space,
    tile_mask,
    weight_operands,
)
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp
from tokamax_pass.core import BoundArguments, Op, Target


def _fwd_kernel(x_ref, gate_ref, up_ref, out_ref, *, m: int, k: int, n: int, up_offset: int,
                activation: Callable[[Any], Any], config: Config, exact: bool) -> None:
    gate, up = dual_products(x_ref, gate_ref, up_ref, m=m, k=k, n=n, up_offset=up_offset,
                             config=config, exact=exact)
    out = activation(gate) * up
    i, j = pl.program_id(1), pl.program_id(0)
    plgpu.store(out_ref.at[pl.ds(i * config.block_m, config.block_m),
                           pl.ds(j * config.block_n, config.block_n)],
                out.astype(out_ref.dtype), mask=tile_mask(config, m, n))


def glu_forward(x: jax.Array, weights: Any, *, activation: Callable[[Any], Any], config: Config,
                interpret: bool = False) -> jax.Array:
    """The gated linear unit of `x` (..., K) -> (..., N) by the fused Triton kernel."""
    *lead, k = x.shape
    m = math.prod(lead)
    gate, up, up_offset = weight_operands(weights)
    n = gate.shape[1] - up_offset if up_offset else gate.shape[1]
    kernel = functools.partial(_fwd_kernel, m=m, k=k, n=n, up_offset=up_offset,
                               activation=activation, config=config,
                               exact=jnp.dtype(x.dtype) == jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(_triton.cdiv(n, config.block_n), _triton.cdiv(m, config.block_m)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=_triton.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="tokamax_glu_fwd",
    )(x.reshape(m, k), gate, up)
    return out.reshape(*lead, n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonGatedLinearUnit(TritonKernel, GatedLinearUnit):
    """The gated linear unit as one fused Pallas Triton kernel (f16/bf16/f32; CUDA).

    `interpret=True` runs the kernel in the Pallas interpreter (any platform; tests).
    """

    config_cls: ClassVar[type] = Config

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_triton_glu_inputs(ba)

    def _fwd(self, x: jax.Array, weights: Any, *, activation: Callable[[Any], Any],
             precision: Any, config: Config, return_residuals: bool,
             group_sizes: jax.Array | None = None) -> tuple[jax.Array, None]:
        del precision  # f16/bf16 products are exact in f32; f32 inputs run at full precision
        if group_sizes is not None:
            raise NotImplementedError("the Triton GLU runs dense calls only")
        return glu_forward(x, weights, activation=activation, config=config,
                           interpret=self.interpret), None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        x, weights = ba.arguments["x"], ba.arguments["weights"]
        n = weights[0].shape[1] if isinstance(weights, tuple) else weights.shape[2]
        return matmul_heuristics(Config, math.prod(x.shape[:-1]), n,
                                 jnp.dtype(x.dtype).itemsize)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return matmul_search_space(Config)

    def _default_vjp(self) -> Op:
        return PallasTritonGatedLinearUnitVjp(interpret=self.interpret)
