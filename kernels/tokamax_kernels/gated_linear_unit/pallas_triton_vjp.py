"""The gated-linear-unit gradient: a Triton kernel for the pre-activation gradients,
then two XLA matmuls.

With `g = x @ w_gate`, `u = x @ w_up` and cotangent `dy`:
`dg = dy * u * activation'(g)`, `du = dy * activation(g)`. The kernel recomputes
`g` and `u` tile by tile (the forward keeps no residuals) and writes `[dg | du]`
as one (M, 2N) array; then `dx = [dg | du] @ [w_gate | w_up]^T` and
`[dw_gate | dw_up] = x^T @ [dg | du]` are single cuBLAS matmuls with float32
accumulation (for fused weights the (K, 2N) view needs no copy).
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
from tokamax_pass.core import AutodiffVjp, BoundArguments, Op, Target, VjpOp


def _dgates_kernel(x_ref, gate_ref, up_ref, dy_ref, dgu_ref, *, m: int, k: int, n: int,
                   up_offset: int, activation: Callable[[Any], Any], config: Config,
                   exact: bool) -> None:
    gate, up = dual_products(x_ref, gate_ref, up_ref, m=m, k=k, n=n, up_offset=up_offset,
                             config=config, exact=exact)
    bm, bn = config.block_m, config.block_n
    i, j = pl.program_id(1), pl.program_id(0)
    mask = tile_mask(config, m, n)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)
    dy = plgpu.load(dy_ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)
    activated, activation_vjp = jax.vjp(activation, gate)
    (dgate,) = activation_vjp(dy * up)
    plgpu.store(dgu_ref.at[rows, cols], dgate.astype(dgu_ref.dtype), mask=mask)
    plgpu.store(dgu_ref.at[rows, pl.ds(n + j * bn, bn)], (dy * activated).astype(dgu_ref.dtype),
                mask=mask)


def glu_backward(x: jax.Array, weights: Any, dy: jax.Array, *, activation: Callable[[Any], Any],
                 precision: Any, config: Config, interpret: bool = False
                 ) -> tuple[jax.Array, Any]:
    """`(dx, dweights)` of the gated linear unit, dweights in the form of `weights`."""
    *lead, k = x.shape
    m = math.prod(lead)
    gate, up, up_offset = weight_operands(weights)
    n = dy.shape[-1]
    x2 = x.reshape(m, k)
    kernel = functools.partial(_dgates_kernel, m=m, k=k, n=n, up_offset=up_offset,
                               activation=activation, config=config,
                               exact=jnp.dtype(x.dtype) == jnp.float32)
    dgu = pl.pallas_call(
        kernel,
        grid=(_triton.cdiv(n, config.block_n), _triton.cdiv(m, config.block_m)),
        out_shape=jax.ShapeDtypeStruct((m, 2 * n), x.dtype),
        compiler_params=_triton.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="tokamax_glu_bwd_gates",
    )(x2, gate, up, dy.reshape(m, n))
    w2 = gate if up_offset else jnp.concatenate([gate, up], axis=1)  # (K, 2N)
    matmul = functools.partial(jax.lax.dot_general, precision=precision,
                               preferred_element_type=jnp.float32)
    dx = matmul(dgu, w2, (((1,), (1,)), ((), ()))).astype(x.dtype).reshape(x.shape)
    dw2 = matmul(x2, dgu, (((0,), (0,)), ((), ())))
    if isinstance(weights, tuple):
        return dx, (dw2[:, :n].astype(weights[0].dtype), dw2[:, n:].astype(weights[1].dtype))
    return dx, dw2.reshape(k, 2, n).astype(weights.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasTritonGatedLinearUnitVjp(TritonKernel, VjpOp):
    """The gated-linear-unit gradient (Triton pre-activation gradients + XLA matmuls)."""

    config_cls: ClassVar[type] = Config
    forward_family = GatedLinearUnit

    def reference_op(self) -> Op:
        return AutodiffVjp(forward=GatedLinearUnit())

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        super().check_supported(ba, target)
        check_triton_glu_inputs(ba)
        _triton.require_triton_dtype("dout", ba.arguments["dout"])

    def _fwd(self, residuals: Any, out: Any, dout: Any, *, config: Config,
             return_residuals: bool, x: jax.Array, weights: Any,
             activation: Callable[[Any], Any], precision: Any) -> tuple[dict[str, Any], None]:
        dx, dweights = glu_backward(x, weights, dout, activation=activation,
                                    precision=precision, config=config,
                                    interpret=self.interpret)
        return {"x": dx, "weights": dweights}, None

    def _get_heuristics_config(self, ba: BoundArguments) -> Config:
        dout = ba.arguments["dout"]
        return matmul_heuristics(Config, math.prod(dout.shape[:-1]), dout.shape[-1],
                                 jnp.dtype(dout.dtype).itemsize)

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[Config]:
        return matmul_search_space(Config)
