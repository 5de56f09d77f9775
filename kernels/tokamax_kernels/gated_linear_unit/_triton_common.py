"""Config, checks and matmul helpers that the Triton GLU kernel and its VJP share."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokamax_kernels import _triton
from tokamax_kernels._triton import MatmulConfig
from tokamax_pass.core import BoundArguments

# Output tile `block_m` x `block_n` over the rows of x and the columns of each weight.
Config = MatmulConfig


def weight_operands(weights: Any) -> tuple[jax.Array, jax.Array, int]:
    """`(gate matrix, up matrix, column offset of up)`: fused weights as one (K, 2N) view."""
    if isinstance(weights, tuple):
        return weights[0], weights[1], 0
    k, _, n = weights.shape
    fused = weights.reshape(k, 2 * n)
    return fused, fused, n


def dual_products(x_ref: Any, gate_ref: Any, up_ref: Any, *, m: int, k: int, n: int,
                  up_offset: int, config: Any, exact: bool) -> tuple[jax.Array, jax.Array]:
    """`(x @ w_gate, x @ w_up)` float32 tiles of this program (rows i, columns j)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    j, i = pl.program_id(0), pl.program_id(1)
    rows = i * bm + jnp.arange(bm)
    cols = j * bn + jnp.arange(bn)

    def step(kk: Any, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        ks = kk * bk + jnp.arange(bk)
        k_mask = ks < k
        a = plgpu.load(x_ref.at[pl.ds(i * bm, bm), pl.ds(kk * bk, bk)],
                       mask=(rows < m)[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & (cols < n)[None, :]
        wg = plgpu.load(gate_ref.at[pl.ds(kk * bk, bk), pl.ds(j * bn, bn)], mask=w_mask,
                        other=0.0)
        wu = plgpu.load(up_ref.at[pl.ds(kk * bk, bk), pl.ds(up_offset + j * bn, bn)],
                        mask=w_mask, other=0.0)
        return (acc[0] + plgpu.dot(a, wg, allow_tf32=not exact),
                acc[1] + plgpu.dot(a, wu, allow_tf32=not exact))

    zeros = jnp.zeros((bm, bn), jnp.float32)
    return jax.lax.fori_loop(0, _triton.cdiv(k, bk), step, (zeros, zeros))


def tile_mask(config: Any, m: int, n: int) -> jax.Array:
    j, i = pl.program_id(0), pl.program_id(1)
    rows = i * config.block_m + jnp.arange(config.block_m)
    cols = j * config.block_n + jnp.arange(config.block_n)
    return (rows < m)[:, None] & (cols < n)[None, :]


def check_triton_glu_inputs(ba: BoundArguments) -> None:
    """What the Triton GLU kernels cannot do (raised as `NotImplementedError`)."""
    if "group_sizes" in ba.arguments:
        raise NotImplementedError(
            "the Triton GLU has no grouped form (group_sizes); use implementation='xla', "
            "'mosaic_gpu', 'mosaic_tpu' (on a TPU) or None")
    x, weights = ba.arguments["x"], ba.arguments["weights"]
    parts = weights if isinstance(weights, tuple) else (weights,)
    _triton.require_triton_dtype("x", x)
    for w in parts:
        _triton.require_triton_dtype("weights", w)
        if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
            raise NotImplementedError(
                f"the Triton GLU needs weights of x's dtype {x.dtype}, got {w.dtype}")
    if 0 in x.shape or any(0 in w.shape for w in parts):
        raise NotImplementedError("the Triton GLU needs non-empty operands")
    if ba.vmap:
        raise NotImplementedError("the Triton GLU does not support jax.vmap")


def matmul_heuristics(config_cls: type, m: int, n: int, itemsize: int) -> Any:
    """H200 tiles for a dual-accumulator matmul (two f32 accumulators per program).

    128 x 128 x 64, 8 warps, 3 stages measured best at x 8192x4096, w 4096x2x4096 bf16
    (forward)."""
    def fit(size: int, most: int) -> int:
        return max(16, min(most, _triton.next_power_of_2(size)))

    return config_cls(block_m=fit(m, 128), block_n=fit(n, 128 if itemsize == 2 else 64),
                      block_k=64 if itemsize == 2 else 32, num_warps=8,
                      num_stages=3 if itemsize == 2 else 2)


def matmul_search_space(config_cls: type) -> set[Any]:
    space = itertools.product((64, 128), (64, 128), (32, 64), (4, 8), (2, 3, 4))
    return {config_cls(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in space}
