"""The layer_norm base suite: every implementation gets the same cases.

Implementations that need an accelerator run in Pallas interpret mode on CPU (the Triton
kernels at a config whose blocks hold the whole row and at one whose row chunks and row
blocks divide nothing; the Mosaic TPU kernels at 16-row blocks and at their heuristics).
Each case checks the outputs and the gradients of random cotangents against a float32
HIGHEST reference: layer norm and RMSNorm, bf16 and f32, with and without scale, offset and
the fused residual add (`y = norm(x + h)`, which also returns the sum), several shapes,
`vmap`, the float32 mean and rstd residuals, and bad input.

What only one implementation has (configs, heuristics, lowering, fallbacks) stays in its
own file beside this one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.layer_norm import (
    PallasMosaicTpuLayerNorm,
    PallasMosaicTpuLayerNormVjp,
    api,
)
from tokamax_kernels.layer_norm import _mosaic_tpu_common as mosaic_tpu
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import Config as TritonConfig
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import Config as TritonVjpConfig
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp

EPS = 1e-6
# 38 rows (no block of 4, 16 or 8 rows divides them) of 40 features (no 16-wide chunk
# divides them, and they are not a multiple of the TPU's 128 lanes).
SHAPE = (2, 19, 40)


def _triton(fwd: TritonConfig, bwd: TritonVjpConfig) -> Callable[[], LayerNorm]:
    return lambda: PallasTritonLayerNorm(
        interpret=True, config=fwd, vjp=PallasTritonLayerNormVjp(interpret=True, config=bwd))


def _mosaic_tpu(config: mosaic_tpu.Config | None) -> Callable[[], LayerNorm]:
    return lambda: PallasMosaicTpuLayerNorm(
        interpret=True, config=config,
        vjp=PallasMosaicTpuLayerNormVjp(interpret=True, config=config))


IMPLEMENTATIONS: dict[str, Callable[[], LayerNorm]] = {
    "xla": LayerNorm,
    "triton_one_block": _triton(
        TritonConfig(block_rows=4, block_n=64, rows_per_program=4, num_warps=4, num_stages=1),
        TritonVjpConfig(block_rows=2, block_n=64, rows_per_program=8, num_warps=4,
                        num_stages=2)),
    "triton_chunked": _triton(
        TritonConfig(block_rows=2, block_n=16, rows_per_program=4, num_warps=4, num_stages=2),
        TritonVjpConfig(block_rows=4, block_n=16, rows_per_program=8, num_warps=4,
                        num_stages=2)),
    "mosaic_tpu": _mosaic_tpu(mosaic_tpu.Config(block_rows=16)),
    "mosaic_tpu_heuristics": _mosaic_tpu(None),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One call's options: the dtype the op computes in and which optional inputs it has."""

    dtype: jnp.dtype
    subtract_mean: bool
    scale: bool
    offset: bool
    residual: bool

    @property
    def id(self) -> str:
        parts = ["ln" if self.subtract_mean else "rms", jnp.dtype(self.dtype).name]
        parts += [name for name in ("scale", "offset", "residual") if getattr(self, name)]
        return "-".join(parts)


def _every_pair_of_options() -> list[Case]:
    """Eight cases in which every pair of the five options takes all four value pairs (a
    two-level fractional factorial: residual = dtype xor mean, offset = dtype xor scale)."""
    cases = []
    for bf16, subtract_mean, scale in itertools.product((False, True), repeat=3):
        cases.append(Case(jnp.bfloat16 if bf16 else jnp.float32, subtract_mean, scale,
                          offset=bf16 != scale, residual=bf16 != subtract_mean))
    return cases


CASES = _every_pair_of_options()


def reference(x, scale, offset, residual, *, subtract_mean=True, axis=-1):
    """`norm(x + residual)` (and the sum, with a residual) in float32 from the inputs cast
    to float32; call it under HIGHEST precision."""
    s = x.astype(jnp.float32)
    if residual is not None:
        s = s + residual.astype(jnp.float32)
    mean = s.mean(axis, keepdims=True) if subtract_mean else 0.0
    centered = s - mean
    y = centered * jax.lax.rsqrt((centered * centered).mean(axis, keepdims=True) + EPS)
    shape = [1] * s.ndim
    shape[axis] = s.shape[axis]
    if scale is not None:
        y = y * scale.astype(jnp.float32).reshape(shape)
    if offset is not None:
        y = y + offset.astype(jnp.float32).reshape(shape)
    return (y, s) if residual is not None else y


def _inputs(case: Case, shape=SHAPE, seed=0) -> dict:
    """Random inputs for `case` at `shape`; the float32 arithmetic and the cast run in
    NumPy (as elementwise XLA would, with no program to compile for them)."""
    n = shape[-1]
    dtype = jnp.dtype(case.dtype)

    def normal(i, shape):
        return np.asarray(random_normal(seed + i, shape))

    return dict(
        x=jnp.asarray((3 * normal(0, shape) - 1).astype(dtype)),
        scale=jnp.asarray((1 + 0.5 * normal(1, (n,))).astype(dtype)) if case.scale else None,
        offset=random_normal(seed + 2, (n,), case.dtype) if case.offset else None,
        residual=jnp.asarray((2 * normal(3, shape) + 0.5).astype(dtype))
        if case.residual else None,
    )


def _loss(fn, cotangents):
    """A scalar of every output (y, and the sum with a residual), each weighted by its own
    random cotangent, with the outputs themselves as `has_aux` auxiliary data (so one
    program gives the outputs and the gradients)."""
    def loss(inputs):
        out = fn(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        return sum(jnp.sum(o.astype(jnp.float32) * c)
                   for o, c in zip(outs, cotangents, strict=True)), out
    return loss


@functools.partial(jax.jit, static_argnames=("subtract_mean", "axis"))
def _reference_value_and_grad(inputs, cotangents, *, subtract_mean, axis):
    """`_loss`'s value (with the outputs) and gradients for the reference at the inputs
    cast to float32, in one compiled program shared by every implementation's case (call
    it under HIGHEST precision)."""
    def theirs(a):
        return reference(a["x"], a["scale"], a["offset"], a["residual"],
                         subtract_mean=subtract_mean, axis=axis)

    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), inputs)
    return jax.value_and_grad(_loss(theirs, cotangents), has_aux=True)(f32)


def _check(op: LayerNorm, case: Case, inputs: dict, *, axis=-1, seed=10) -> None:
    """Outputs and gradients of `op` on `inputs` against the float32 HIGHEST reference."""
    shape = inputs["x"].shape

    def ours(a):
        return op(a["x"], a["scale"], a["offset"], axis=axis, epsilon=EPS,
                  subtract_mean=case.subtract_mean, residual=a["residual"])

    cotangents = [random_normal(seed + i, shape) for i in range(1 + case.residual)]
    # One compiled program for the outputs and the gradients (the forward is not compiled
    # a second time on its own).
    (_, out), grads = jax.jit(jax.value_and_grad(_loss(ours, cotangents), has_aux=True))(
        inputs)
    with reference_precision():
        (_, want), want_grads = _reference_value_and_grad(
            inputs, cotangents, subtract_mean=case.subtract_mean, axis=axis)
    for got, expected in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        assert got.dtype == case.dtype and got.shape == shape
        assert_close(got, expected, case.dtype)
    for name, value in inputs.items():
        if value is None:
            assert grads[name] is None, name
        else:
            assert grads[name].dtype == case.dtype, name
            assert_close(grads[name], want_grads[name], case.dtype)
    if case.residual:  # d residual and d x are one gradient, that of the sum
        np.testing.assert_array_equal(np.asarray(grads["x"]), np.asarray(grads["residual"]))


@pytest.mark.exhaustive
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_and_gradients_match_reference(implementation, case):
    _check(IMPLEMENTATIONS[implementation](), case, _inputs(case))


SHAPES = {"rows-and-features-tile": (2, 8, 64), "rank-2": (5, 40), "rank-4": (2, 2, 3, 136)}


# XLA's implementation is plain jnp with no blocking: one shape (rank 4, the most general)
# checks it; the kernels, whose blocks and chunks depend on the shape, take all three.
@pytest.mark.parametrize("implementation,shape", [
    (implementation, shape) for implementation in IMPLEMENTATIONS for shape in SHAPES
    if implementation != "xla" or shape == "rank-4"])
def test_shapes(implementation, shape):
    shape = SHAPES[shape]
    case = Case(jnp.float32, subtract_mean=True, scale=True, offset=True, residual=True)
    _check(IMPLEMENTATIONS[implementation](), case, _inputs(case, shape, seed=20))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_mean_and_rstd_residuals_are_float32_statistics_of_the_sum(implementation):
    op = IMPLEMENTATIONS[implementation]()
    x, residual = random_normal(30, SHAPE), random_normal(31, SHAPE)
    for subtract_mean in (True, False):
        _, (mean, rstd) = api.FAMILY(op, x, None, None, epsilon=EPS,
                                     subtract_mean=subtract_mean, residual=residual,
                                     return_residuals=True)
        s = np.asarray(x, np.float64) + np.asarray(residual, np.float64)
        want_mean = s.mean(axis=-1) if subtract_mean else np.zeros(SHAPE[:-1])
        centered = s - want_mean[..., None]
        assert mean.dtype == rstd.dtype == jnp.float32 and mean.shape == SHAPE[:-1]
        assert_close(mean, want_mean, scale_rtol=1e-5)
        assert_close(rstd, 1 / np.sqrt((centered**2).mean(axis=-1) + EPS), scale_rtol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_of_forward_and_grad(implementation):
    """A batch of rows with its own scale each; the kernels batch (one more grid axis)."""
    op = IMPLEMENTATIONS[implementation]()
    x, residual = random_normal(40, (3, 19, 40)), random_normal(41, (3, 19, 40))
    scales = jnp.asarray(1 + np.asarray(random_normal(42, (3, 40))))
    offset = random_normal(43, (40,))
    cotangents = (random_normal(44, x.shape), random_normal(45, x.shape))

    def total(fn, x, residual, scales):
        y, s = jax.vmap(lambda x, r, sc: fn(x, sc, offset, residual=r))(x, residual, scales)
        return jnp.sum(y * cotangents[0]) + jnp.sum(s * cotangents[1])

    def plain(x, scale, offset, *, residual):
        return reference(x, scale, offset, residual)

    # One compiled program each for the op's value and gradients and the reference's.
    got = jax.jit(jax.value_and_grad(lambda *a: total(op, *a), argnums=(0, 1, 2)))(
        x, residual, scales)
    with reference_precision():
        want = jax.jit(jax.value_and_grad(lambda *a: total(plain, *a), argnums=(0, 1, 2)))(
            x, residual, scales)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_input_raises_value_errors_naming_the_argument(implementation):
    op = IMPLEMENTATIONS[implementation]()
    x = random_normal(50, (4, 64))
    with pytest.raises(ValueError, match=r"scale must have shape \(64,\)"):
        op(x, jnp.ones((63,)), None)
    with pytest.raises(ValueError, match=r"offset must have shape \(64,\)"):
        op(x, None, jnp.ones((64, 1)))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        op(x, None, None, residual=jnp.ones((4, 32)))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        op(jnp.ones((4, 64), jnp.int32), None, None)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
        op(x, None, None, epsilon=-1.0)
