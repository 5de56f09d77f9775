"""The ragged_dot base suite: every implementation gets the same cases.

Implementations that need an accelerator run in Pallas interpret mode on CPU (the Triton
kernel at 16-row tiles that straddle group boundaries, the Mosaic TPU kernels at 16-row
blocks and at their heuristics); the Mosaic GPU kernels lower for an H200
(`test_mosaic_gpu_ragged_dot.py`) and run on the device. Each case checks the output and the
gradients of a random cotangent against a per-group float32 HIGHEST reference: uneven and
empty groups, rows past the sizes' sum, one group, every group empty, bf16 and f32, `vmap`
over every operand (or a clear refusal where the kernel has no batched form), and bad input.

What only one implementation has (configs, heuristics, tiles, lowering) stays in its own
file beside this one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import Config as MosaicTpuConfig
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import Config as TritonConfig
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot

HIGHEST = jax.lax.Precision.HIGHEST
# 44 rows: no 16-row block divides them; K = 256 is two 128-deep TPU steps; N = 192 leaves a
# partial 128-wide TPU column tile.
M, K, N = 44, 256, 192

IMPLEMENTATIONS: dict[str, Callable[[], RaggedDot]] = {
    "xla": RaggedDot,
    "triton": lambda: PallasTritonRaggedDot(interpret=True, config=TritonConfig(
        block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2)),
    "mosaic_tpu": lambda: PallasMosaicTpuRaggedDot(
        interpret=True, config=MosaicTpuConfig(block_m=16, block_k=128, block_n=128)),
    "mosaic_tpu_heuristics": lambda: PallasMosaicTpuRaggedDot(interpret=True),
}
# The Triton kernel has no batched form: under `vmap` it refuses, naming `vmap`.
WITHOUT_VMAP = {"triton"}

# Uneven with an empty group inside and rows past the sum; empty first and last groups; one
# group of every row; every group empty (all rows past the sum).
GROUP_SIZES = {
    "uneven": [5, 0, 20, 3],
    "empty_ends": [0, 17, 27, 0],
    "one_group": [M],
    "all_empty": [0, 0],
}
CASES = [(name, jnp.float32) for name in GROUP_SIZES] + [("uneven", jnp.bfloat16)]


def reference(lhs, rhs, sizes):
    """Per-group float32 matmuls at HIGHEST precision from concrete sizes; zero rows past
    the sum."""
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out = out.at[start:start + size].set(
            jnp.matmul(lhs[start:start + size], rhs[g], precision=HIGHEST))
        start += size
    return out


def _loss(fn, lhs, rhs, cotangent):
    """The cotangent-weighted sum of `fn`'s output, with the output as auxiliary data."""
    out = fn(lhs, rhs)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out


@functools.cache
def _output_and_grads(implementation: str):
    """One jitted program per implementation for the output and both gradients, with the
    group sizes an argument: cases with the same shapes and dtype (uneven and empty_ends)
    reuse one compilation, as a model's changing sizes would."""
    op = IMPLEMENTATIONS[implementation]()

    def run(lhs, rhs, group_sizes, cotangent):
        (_, out), grads = jax.value_and_grad(
            lambda a, b: _loss(lambda a, b: op(a, b, group_sizes), a, b, cotangent),
            argnums=(0, 1), has_aux=True)(lhs, rhs)
        return out, grads
    return jax.jit(run)


def _check(implementation: str, lhs, rhs, sizes, dtype, seed=2) -> None:
    """Output and gradients of the implementation against the per-group reference, with the
    zeros the family promises: rows past the sum, and the weights' gradient of empty
    groups."""
    group_sizes = jnp.asarray(sizes, jnp.int32)
    cotangent = random_normal(seed, (M, N))
    out, (dlhs, drhs) = _output_and_grads(implementation)(lhs, rhs, group_sizes, cotangent)
    f32 = (lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    with reference_precision():
        (_, want), (want_dlhs, want_drhs) = jax.value_and_grad(
            lambda a, b: _loss(lambda a, b: reference(a, b, sizes), a, b, cotangent),
            argnums=(0, 1), has_aux=True)(*f32)
    assert out.shape == (M, N) and out.dtype == dtype
    assert dlhs.dtype == drhs.dtype == dtype
    assert_close(out, want, dtype)
    assert_close(dlhs, want_dlhs, dtype)
    assert_close(drhs, want_drhs, dtype)
    past = sum(sizes)
    np.testing.assert_array_equal(np.asarray(out[past:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dlhs[past:], np.float32), 0.0)
    for g, size in enumerate(sizes):
        if size == 0:
            np.testing.assert_array_equal(np.asarray(drhs[g], np.float32), 0.0)


@pytest.mark.parametrize("case, dtype", CASES,
                         ids=[f"{c}-{jnp.dtype(d).name}" for c, d in CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_and_gradients_match_the_per_group_reference(implementation, case, dtype):
    sizes = GROUP_SIZES[case]
    lhs = random_normal(0, (M, K), dtype)
    rhs = random_normal(1, (len(sizes), K, N), dtype)
    _check(implementation, lhs, rhs, sizes, dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_of_forward_and_grad_with_sizes_per_entry(implementation):
    op = IMPLEMENTATIONS[implementation]()
    batch_sizes = [[5, 0, 20, 3], [0, 44, 0, 0]]
    lhs, rhs = random_normal(10, (2, M, K)), random_normal(11, (2, 4, K, N))
    sizes = jnp.asarray(batch_sizes, jnp.int32)
    cotangent = random_normal(12, (2, M, N))

    def loss(a, b, s):
        return jnp.sum(jax.vmap(op)(a, b, s) * cotangent)

    if implementation in WITHOUT_VMAP:
        with pytest.raises(NotImplementedError, match="does not support jax.vmap"):
            jax.vmap(op)(lhs, rhs, sizes)
        return
    out = jax.vmap(op)(lhs, rhs, sizes)
    dlhs, drhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs, sizes)
    for i, entry in enumerate(batch_sizes):
        with reference_precision():
            want, vjp = jax.vjp(lambda a, b, e=entry: reference(a, b, e), lhs[i], rhs[i])
            want_dlhs, want_drhs = vjp(cotangent[i])
        assert_close(out[i], want)
        assert_close(dlhs[i], want_dlhs)
        assert_close(drhs[i], want_drhs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_input_raises_value_errors_naming_the_argument(implementation):
    op = IMPLEMENTATIONS[implementation]()
    lhs, rhs = random_normal(20, (M, K)), random_normal(21, (3, K, N))
    sizes = jnp.asarray([4, 4, 4], jnp.int32)
    with pytest.raises(ValueError, match="K mismatch"):
        op(lhs, random_normal(22, (3, K + 1, N)), sizes)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(3,\)"):
        op(lhs, rhs, jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be an integer"):
        op(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="lhs must have rank 2"):
        op(lhs[None], rhs, sizes)
    with pytest.raises(ValueError, match="more than the 44 rows"):
        op(lhs, rhs, jnp.asarray([20, 20, 20], jnp.int32))
