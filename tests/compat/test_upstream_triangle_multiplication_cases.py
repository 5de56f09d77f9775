"""Upstream Tokamax's triangle-multiplication cases (its api and base tests) run through
`tokamax_pass.triangle_multiplication`, with upstream's shapes and tolerances; the
reference is float32 at `Precision.HIGHEST` on the same (rounded) inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _triangle_multiplication_reference import random_arguments, reference
from compat._upstream import NONE_ON_CPU, as_float32, assert_trees_all_close

TRIANGLE_TYPES = ["incoming", "outgoing"]


@pytest.mark.parametrize("implementation", ["xla", NONE_ON_CPU])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("triangle_type", TRIANGLE_TYPES)
def test_triangle_multiplication(triangle_type, dtype, implementation):
    """Upstream's api `test_triangle_multiplication` (n = 128, c = h = 32, d = 64, under
    `jit`): within atol 0.15, rtol 0.05 in bfloat16, 1e-5 in float32. Its `"triton"` and
    `"mosaic"` cases skip themselves on CPU, as does its check of the op in the HLO."""
    arguments = random_arguments(0, (), n=128, c=32, h=32, d=64, dtype=dtype)
    out = jax.jit(lambda a: tokamax.triangle_multiplication(
        **a, triangle_type=triangle_type, implementation=implementation))(arguments)
    expected = jax.jit(lambda a: reference(**a, triangle_type=triangle_type))(
        as_float32(arguments))
    assert out.dtype == dtype
    bfloat16 = dtype == jnp.bfloat16
    assert_trees_all_close(out, expected, atol=0.15 if bfloat16 else 1e-5,
                           rtol=0.05 if bfloat16 else 1e-5)


def test_unsupported_implementation():
    """Upstream's `test_unsupported_implementation`: an unknown name is not implemented."""
    arguments = random_arguments(0, (), n=8, c=16, h=32, d=64)
    with pytest.raises(NotImplementedError):
        tokamax.triangle_multiplication(**arguments, triangle_type="incoming",
                                        implementation="unsupported")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("triangle_type", TRIANGLE_TYPES)
def test_base_triangle_multiplication(triangle_type, dtype):
    """Upstream's base `test_triangle_multiplication` (n = 8, c = 16, h = 32, d = 64,
    `Precision.HIGH`, the XLA op under `jit`): the output's shape and dtype; here its
    values too, within the api test's tolerances."""
    arguments = random_arguments(1, (), n=8, c=16, h=32, d=64, dtype=dtype)
    out = jax.jit(lambda a: tokamax.triangle_multiplication(
        **a, triangle_type=triangle_type, precision=jax.lax.Precision.HIGH,
        implementation="xla"))(arguments)
    assert out.shape == (8, 8, 64) and out.dtype == dtype
    expected = reference(**as_float32(arguments), triangle_type=triangle_type)
    bfloat16 = dtype == jnp.bfloat16
    assert_trees_all_close(out, expected, atol=0.15 if bfloat16 else 1e-5,
                           rtol=0.05 if bfloat16 else 1e-5)


@pytest.mark.parametrize("triangle_type", TRIANGLE_TYPES)
def test_base_triangle_multiplication_grad(triangle_type):
    """Upstream's base `test_triangle_multiplication_grad` (bfloat16, `Precision.HIGH`):
    the gradient of the output's sum by `x` has no NaN."""
    arguments = random_arguments(2, (), n=8, c=16, h=32, d=64, dtype=jnp.bfloat16)

    def loss(x):
        return jnp.sum(tokamax.triangle_multiplication(
            **{**arguments, "x": x}, triangle_type=triangle_type,
            precision=jax.lax.Precision.HIGH, implementation="xla"))

    grads = jax.grad(loss)(arguments["x"])
    assert grads.shape == arguments["x"].shape and grads.dtype == jnp.bfloat16
    assert not np.isnan(np.asarray(grads, np.float32)).any()
