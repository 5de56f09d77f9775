"""Device tests: the Triton layer norm, ragged dot and GLU at benchmark shapes, forward and
gradient against float32 HIGHEST references, and bitwise-identical reruns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton import PallasTritonGatedLinearUnit
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import PallasTritonLayerNorm
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_kernels.ragged_dot.pallas_triton import PallasTritonRaggedDot

pytestmark = pytest.mark.gpu


def _normal(seed, shape, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(jnp.bfloat16)


def _rel_err(got, want):
    got, want = (jnp.asarray(a, jnp.float32) for a in (got, want))
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _check(op, ref, args, dout, tol=1e-2):
    """Forward + VJP of `op` against `ref` on float32 copies; a rerun is bitwise equal."""

    def run(fn, *a):
        out, pullback = jax.vjp(fn, *a)
        return out, pullback(dout.astype(out.dtype))

    got = jax.jit(lambda *a: run(op, *a))(*args)
    again = jax.jit(lambda *a: run(op, *a))(*args)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: run(ref, *a))(*(a.astype(jnp.float32) for a in args))
    for g, w, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(again),
                       strict=True):
        assert g.shape == w.shape
        assert _rel_err(g, w) < tol
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("n", [4096, 1024, 64, 20_000])
def test_layer_norm(subtract_mean, n):
    rows = {64: 32 * 2048 * 16, 20_000: 1024}.get(n, 65536)  # 64: the seed model's rows
    x = _normal(0, (rows, n))
    scale, offset = 1 + _normal(1, (n,), 0.1), _normal(2, (n,), 0.1)
    op = PallasTritonLayerNorm()
    _check(lambda *a: op(*a, subtract_mean=subtract_mean),
           lambda *a: LayerNorm()(*a, subtract_mean=subtract_mean),
           (x, scale, offset), _normal(3, (rows, n)))


@pytest.mark.parametrize("sizes", [[2070, 2092, 2015, 2002, 2059, 2064, 2064, 2018],
                                   [4000, 0, 3000, 100, 5000, 2000, 1000, 0]])
def test_ragged_dot(sizes):
    m, k, n = 16384, 4096, 4096
    group_sizes = jnp.asarray(sizes, jnp.int32)
    op = PallasTritonRaggedDot()
    _check(lambda a, b: op(a, b, group_sizes), lambda a, b: RaggedDot()(a, b, group_sizes),
           (_normal(0, (m, k)), _normal(1, (8, k, n), 1 / 64)), _normal(2, (m, n)))


def test_gated_linear_unit():
    m, k, n = 8192, 4096, 4096
    op = PallasTritonGatedLinearUnit()
    _check(op, GatedLinearUnit(), (_normal(0, (m, k)), _normal(1, (k, 2, n), 1 / 64)),
           _normal(2, (m, n)))


@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("n", [2048, 4096, 20_000])
def test_layer_norm_with_residual(subtract_mean, n):
    """`(y, s) = layer_norm(h, residual=x)`: both outputs and the one gradient of h and x,
    with random cotangents for y and s; `s` is bitwise plain JAX's `x + h`."""
    rows = {20_000: 1024}.get(n, 16384)
    h, x, dy, ds = (_normal(i, (rows, n)) for i in (0, 4, 3, 5))
    scale = 1 + _normal(1, (n,), 0.1).astype(jnp.float32)

    def run(op, h, x, scale):
        out, pullback = jax.vjp(
            lambda h, x, scale: op(h, scale, None, subtract_mean=subtract_mean, residual=x),
            h, x, scale)
        return out, pullback((dy.astype(out[0].dtype), ds.astype(out[1].dtype)))

    got = jax.jit(lambda *a: run(PallasTritonLayerNorm(), *a))(h, x, scale)
    again = jax.jit(lambda *a: run(PallasTritonLayerNorm(), *a))(h, x, scale)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: run(LayerNorm(), *a))(h.astype(jnp.float32),
                                                       x.astype(jnp.float32), scale)
    (y, s), (dh, dx, dscale) = got
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + h))
    np.testing.assert_array_equal(np.asarray(dh), np.asarray(dx))
    for g, w, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(again),
                       strict=True):
        assert g.shape == w.shape
        assert _rel_err(g, w) < 1e-2
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
