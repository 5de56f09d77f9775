"""The gated_linear_unit base suite: every implementation gets the same cases.

Implementations that need an accelerator run in Pallas interpret mode on CPU (the Triton
kernels at tiles whose row and column edges are masked, the Mosaic TPU kernel at 16-row
blocks and at its heuristics); the Mosaic GPU kernel runs in GPU interpret mode and lowers
for an H200 in `test_mosaic_gpu_glu.py`. Each case checks the output and the gradients of a
random cotangent against a float32 HIGHEST reference: fused and paired weights, swish and
gelu, bf16 and f32, `vmap` over x and over the weights (or a clear refusal where the
kernel has no batched form), and bad input.

What only one implementation has (configs, heuristics, lowering, grouped calls) stays in
its own file beside this one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest

from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.gated_linear_unit import (
    GatedLinearUnit,
    PallasMosaicTpuGatedLinearUnit,
)
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import Config as MosaicTpuConfig
from tokamax_kernels.gated_linear_unit.pallas_triton import Config as TritonConfig
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp

HIGHEST = jax.lax.Precision.HIGHEST
# 2 x 19 = 38 rows: no 16-row block divides them; K = 256 is two 128-deep steps; N = 384 is
# three 128-wide TPU column blocks and one and a half 256-wide Triton ones.
LEAD, K, N = (2, 19), 256, 384
_TRITON_TILES = TritonConfig(block_m=16, block_n=256, block_k=128, num_warps=4, num_stages=2)

IMPLEMENTATIONS: dict[str, Callable[[], GatedLinearUnit]] = {
    "xla": GatedLinearUnit,
    "triton": lambda: PallasTritonGatedLinearUnit(
        interpret=True, config=_TRITON_TILES,
        vjp=PallasTritonGatedLinearUnitVjp(interpret=True, config=_TRITON_TILES)),
    "mosaic_tpu": lambda: PallasMosaicTpuGatedLinearUnit(
        interpret=True, config=MosaicTpuConfig(block_m=16, block_n=128, block_k=128)),
    "mosaic_tpu_heuristics": lambda: PallasMosaicTpuGatedLinearUnit(interpret=True),
}
# The Triton kernels have no batched form: under `vmap` they refuse, naming `vmap`.
WITHOUT_VMAP = {"triton"}
ACTIVATIONS = {"swish": jax.nn.swish, "gelu": jax.nn.gelu}
# Every pair of the three options (fused, activation, dtype) takes all four value pairs in
# these four cases (a half fraction of the 2x2x2 product: dtype is bf16 when exactly one of
# paired weights and gelu is).
CASES = [(fused, activation, jnp.bfloat16 if fused == (activation == "gelu") else jnp.float32)
         for fused, activation in itertools.product((True, False), ACTIVATIONS)]


def reference(x, weights, activation):
    """`activation(x @ w_gate) * (x @ w_up)` in float32 at HIGHEST precision."""
    w_gate, w_up = (weights[:, 0], weights[:, 1]) if not isinstance(weights, tuple) else weights
    x, w_gate, w_up = (a.astype(jnp.float32) for a in (x, w_gate, w_up))
    return (activation(jnp.matmul(x, w_gate, precision=HIGHEST))
            * jnp.matmul(x, w_up, precision=HIGHEST))


def _inputs(dtype, fused: bool, lead=LEAD, seed=0):
    x = (2 * random_normal(seed, (*lead, K)) + 0.5).astype(dtype)
    w = (random_normal(seed + 1, (K, 2, N)) / 16).astype(dtype)
    return x, w if fused else (w[:, 0], w[:, 1])


@pytest.mark.exhaustive
@pytest.mark.parametrize("fused, activation, dtype", CASES, ids=[
    f"{'fused' if f else 'pair'}-{a}-{jnp.dtype(d).name}" for f, a, d in CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_and_gradients_match_reference(implementation, fused, activation, dtype):
    op, act = IMPLEMENTATIONS[implementation](), ACTIVATIONS[activation]
    x, weights = _inputs(dtype, fused)
    cotangent = random_normal(5, (*LEAD, N))

    def loss(fn, x, weights):  # the output rides along as auxiliary data
        out = fn(x, weights)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    ours = lambda x, w: op(x, w, activation=act)
    # One compiled program gives the output and the gradients.
    (_, out), grads = jax.jit(jax.value_and_grad(
        lambda *a: loss(ours, *a), argnums=(0, 1), has_aux=True))(x, weights)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (x, weights))
    with reference_precision():
        (_, want), want_grads = jax.value_and_grad(
            lambda *a: loss(lambda x, w: reference(x, w, act), *a), argnums=(0, 1),
            has_aux=True)(*f32)
    assert out.dtype == dtype and out.shape == (*LEAD, N)
    assert_close(out, want, dtype)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_x_and_over_the_weights(implementation):
    """Rows batched by `vmap` (the kernels see one more leading axis), and two weight sets
    under an outer `vmap` with a cotangent each."""
    op = IMPLEMENTATIONS[implementation]()
    x, weights = _inputs(jnp.float32, True, lead=(2, 19), seed=10)
    stacked = jnp.stack([weights, -0.5 * weights])
    cotangent = random_normal(12, (2, 2, 19, N))

    def total(fn):
        def over_rows(w, x):
            return jax.vmap(lambda row: fn(row, w))(x)
        return lambda w, x: jnp.sum(jax.vmap(over_rows, in_axes=(0, None))(w, x) * cotangent)

    ours = lambda x, w: op(x, w, activation=jax.nn.swish)
    if implementation in WITHOUT_VMAP:
        with pytest.raises(NotImplementedError, match="does not support jax.vmap"):
            total(ours)(stacked, x)
        return
    got = jax.value_and_grad(total(ours), argnums=(0, 1))(stacked, x)
    with reference_precision():
        want = jax.value_and_grad(total(lambda x, w: reference(x, w, jax.nn.swish)),
                                  argnums=(0, 1))(stacked, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_input_raises_value_errors_naming_the_argument(implementation):
    op = IMPLEMENTATIONS[implementation]()
    x, weights = _inputs(jnp.float32, True, lead=(4,), seed=20)
    with pytest.raises(ValueError, match=r"fused weights must have shape \(256, 2, N\)"):
        op(x, weights[1:])
    with pytest.raises(ValueError, match="same shape and dtype"):
        op(x, (weights[:, 0], weights[:, 1, 1:]))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        op(x.astype(jnp.int32), weights)
    with pytest.raises(ValueError, match="activation must be callable"):
        op(x, weights, activation="relu")
