"""Upstream Tokamax's gated-linear-unit cases (`GatedLinearUnitTestBase`, the api test,
the explicit-VJP test) run through `tokamax_pass.gated_linear_unit`, with upstream's
shapes and tolerances; the reference is float32 at `Precision.HIGHEST`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from compat._upstream import NONE_ON_CPU, assert_trees_all_close, random_arrays

HIGHEST = jax.lax.Precision.HIGHEST


def _reference(x, weights, activation=None):
    w, v = weights if isinstance(weights, tuple) else jnp.unstack(weights, axis=1)
    gates = jnp.matmul(x, w, precision=HIGHEST)
    projection = jnp.matmul(x, v, precision=HIGHEST)
    return projection * (gates if activation is None else activation(gates))


GLU_CASES = {
    "sigmoid": dict(activation="sigmoid"),
    "tanh": dict(activation="tanh"),
    "batch": dict(batch=(2, 3)),
    "tuple_weights": dict(use_tuple_weights=True),
}
# XLA:CPU runs the weight gradient's bfloat16 GEMM over the (2, 3, 256) leading dims with
# about 8x the error of the same GEMM over 1536 flattened rows, past upstream's tolerance
# at 1-2% of the elements (tests/compat/README.md).
BATCHED_WEIGHT_GRADIENT_ON_CPU = pytest.mark.xfail(
    strict=True, reason="XLA:CPU bfloat16 weight-gradient GEMM over leading batch dims")
CASE_PARAMS = [pytest.param(name, marks=BATCHED_WEIGHT_GRADIENT_ON_CPU) if name == "batch"
               else name for name in sorted(GLU_CASES)]


@pytest.mark.parametrize("implementation", ["xla", NONE_ON_CPU])
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_gated_linear_unit(implementation, case):
    """Upstream's `test_gated_linear_unit` (m = n = 256, k = 64, bfloat16 against float32):
    values within atol 0.1, rtol 0.02; gradients within atol 2, rtol 0.2."""
    spec = GLU_CASES[case]
    batch, m, n, k = spec.get("batch", ()), 256, 256, 64
    activation = getattr(jax.nn, spec["activation"]) if "activation" in spec else None
    x, w, dout = random_arrays(0, ((*batch, m, k), jnp.bfloat16), ((k, 2, n), jnp.bfloat16),
                               ((*batch, m, n), jnp.bfloat16))
    x_ref, w_ref = x.astype(jnp.float32), w.astype(jnp.float32)
    if spec.get("use_tuple_weights"):
        w, w_ref = tuple(jnp.unstack(w, axis=1)), tuple(jnp.unstack(w_ref, axis=1))
    f = functools.partial(tokamax.gated_linear_unit, activation=activation,
                          implementation=implementation)
    f_ref = functools.partial(_reference, activation=activation)
    expected, pullback_ref = jax.vjp(f_ref, x_ref, w_ref)
    actual, pullback = jax.vjp(f, x, w)
    assert_trees_all_close(actual, expected, atol=0.1, rtol=0.02)
    assert_trees_all_close(pullback(dout), pullback_ref(dout.astype(jnp.float32)),
                           atol=2.0, rtol=0.2)


@pytest.mark.parametrize("implementation", ["xla", None])
@pytest.mark.parametrize("use_tuple_weights", [True, False])
def test_basic_api(implementation, use_tuple_weights):
    """Upstream's api `test_basic_api`: silu GLU under `jit` matches `implementation="xla"`."""
    lhs, rhs = random_arrays(1, ((128, 64), jnp.bfloat16), ((64, 2, 128), jnp.bfloat16))
    if use_tuple_weights:
        rhs = tuple(jnp.unstack(rhs, axis=1))

    def glu(impl):
        return jax.jit(lambda x, w: tokamax.gated_linear_unit(
            x, w, activation=jax.nn.silu, implementation=impl))

    assert_trees_all_close(glu(implementation)(lhs, rhs), glu("xla")(lhs, rhs),
                           atol=0.1, rtol=0.02)


# Upstream compares its explicit VJP with autodiff of the same op, bit for bit in
# bfloat16; ours takes the activation's gradient in float32 and rounds once, so bfloat16
# gradients differ from autodiff of the bfloat16 expression by one bfloat16 ulp.
ONE_BF16_ULP = pytest.mark.xfail(strict=True, reason="bfloat16 gradient within one ulp")


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=ONE_BF16_ULP),
                                   jnp.float32, jnp.float64])
@pytest.mark.parametrize("precision", [jax.lax.Precision.HIGH, HIGHEST])
@pytest.mark.parametrize("batch_dim", [(), (2, 3, 1)])
def test_explicit_vjp(dtype, precision, batch_dim):
    """Upstream's `test_explicit_vjp`: swish GLU value and gradients against autodiff of
    the plain expression, in x64 (atol 1e-9 for float64, 2e-6 otherwise)."""
    with jax.enable_x64(True):
        x, w, do = random_arrays(2, ((*batch_dim, 2, 3), dtype), ((3, 2, 5), dtype),
                                 ((*batch_dim, 2, 5), dtype))
        f = functools.partial(tokamax.gated_linear_unit, activation=jax.nn.swish,
                              precision=precision, implementation="xla")

        def f_ref(x, w):
            gates = jnp.matmul(x, w[:, 0], precision=precision)
            return jnp.matmul(x, w[:, 1], precision=precision) * jax.nn.swish(gates)

        out, pullback = jax.vjp(f, x, w)
        out_ref, pullback_ref = jax.vjp(f_ref, x, w)
        atol = 1e-9 if dtype == jnp.float64 else 2e-6
        assert_trees_all_close(out, out_ref, atol=atol)
        assert_trees_all_close(pullback(do), pullback_ref(do), atol=atol, rtol=1e-6)
