"""layer_norm: the XLA reference against a float64 numpy reference (layer norm and RMSNorm) on
other axes, vmap, its residuals, metadata, argument checks and second-order gradients; the
cases every implementation shares are in `test_layer_norm_suite.py`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.layer_norm.base import LayerNorm

EPS = 1e-6
SHAPE = (3, 5, 16)


def reference(x, scale, offset, axis=-1, epsilon=EPS, subtract_mean=True, xp=np):
    """Layer norm in float64 numpy (or, with `xp=jnp`, float32 jnp for autodiff)."""
    dtype = np.float64 if xp is np else jnp.float32
    x = xp.asarray(x, dtype)
    mean = x.mean(axis=axis, keepdims=True) if subtract_mean else 0.0
    centered = x - mean
    y = centered / xp.sqrt((centered * centered).mean(axis=axis, keepdims=True) + epsilon)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    if scale is not None:
        y = y * xp.asarray(scale, dtype).reshape(shape)
    if offset is not None:
        y = y + xp.asarray(offset, dtype).reshape(shape)
    return y


def _params(n, dtype, with_scale, with_offset):
    scale = (1 + 0.5 * random_normal(1, (n,))).astype(dtype) if with_scale else None
    offset = random_normal(2, (n,), dtype) if with_offset else None
    return scale, offset


@pytest.mark.exhaustive
@pytest.mark.parametrize("axis", [0, 1, -2])
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_other_axes(axis, subtract_mean):
    x = random_normal(0, SHAPE)
    scale, offset = _params(SHAPE[axis], jnp.float32, True, True)
    out = tokamax.layer_norm(x, scale, offset, axis=axis, subtract_mean=subtract_mean,
                             epsilon=1e-3)
    want = reference(x, scale, offset, axis=axis, subtract_mean=subtract_mean, epsilon=1e-3)
    assert_close(out, want)
    dx, dscale = jax.grad(lambda x, s: jnp.sum(tokamax.layer_norm(
        x, s, offset, axis=axis, subtract_mean=subtract_mean, epsilon=1e-3) ** 2),
        argnums=(0, 1))(x, scale)
    want_dx, want_dscale = jax.grad(lambda x, s: jnp.sum(reference(
        x, s, offset, axis=axis, subtract_mean=subtract_mean, epsilon=1e-3, xp=jnp) ** 2),
        argnums=(0, 1))(x, scale)
    assert_close(dx, want_dx)
    assert_close(dscale, want_dscale)


def test_vmap_of_forward_and_grad():
    x = random_normal(0, SHAPE)
    scale, offset = _params(SHAPE[-1], jnp.float32, True, True)
    scales = jnp.stack([scale, 2 * scale, -scale])
    out = jax.vmap(lambda x, s: tokamax.layer_norm(x, s, offset))(x, scales)
    for i in range(SHAPE[0]):
        assert_close(out[i], reference(x[i], scales[i], offset))
    # Normalizing over axis 1 of each (3, 5) slice along axis 2 is axis 1 of the whole.
    out_axis1 = jax.vmap(lambda x: tokamax.layer_norm(x, None, None, axis=1), in_axes=2,
                         out_axes=2)(x)
    assert_close(out_axis1, reference(x, None, None, axis=1))
    dscales = jax.vmap(jax.grad(lambda s, x: jnp.sum(tokamax.layer_norm(x, s, offset) ** 3)))(
        scales, x)
    for i in range(SHAPE[0]):
        want = jax.grad(lambda s, xi=x[i]: jnp.sum(reference(xi, s, offset, xp=jnp) ** 3))(
            scales[i])
        assert_close(dscales[i], want)


def test_residuals_are_float32_mean_and_rstd():
    x = random_normal(0, SHAPE, jnp.bfloat16)
    for subtract_mean in (True, False):
        _, (mean, rstd) = LayerNorm()._fwd(x, None, None, axis=1, epsilon=EPS,
                                           subtract_mean=subtract_mean, config=None,
                                           return_residuals=True)
        xf = np.asarray(x, np.float64)
        want_mean = xf.mean(axis=1) if subtract_mean else np.zeros((3, 16))
        centered = xf - want_mean[:, None]
        assert mean.dtype == rstd.dtype == jnp.float32
        assert_close(mean, want_mean, scale_rtol=1e-5)
        assert_close(rstd, 1 / np.sqrt((centered**2).mean(axis=1) + EPS), scale_rtol=1e-5)


def test_metadata_parses_back():
    x = random_normal(0, SHAPE, jnp.bfloat16)
    scale, _ = _params(SHAPE[1], jnp.float32, True, False)
    text = jax.jit(lambda x, s: tokamax.layer_norm(x, s, None, axis=-2, epsilon=1e-5)).lower(
        x, scale).as_text()
    (payload,) = set(re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text))
    ba = tokamax.BoundArguments.from_json(payload.replace("\\22", '"'))
    assert type(ba.op) is LayerNorm
    assert ba.arguments["x"] == jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
    assert ba.arguments["scale"] == jax.ShapeDtypeStruct((SHAPE[1],), jnp.float32)
    assert ba.arguments["offset"] is None
    assert ba.arguments["axis"] == 1 and ba.arguments["epsilon"] == 1e-5


_X = jax.ShapeDtypeStruct(SHAPE, jnp.float32)


@pytest.mark.parametrize("args, kwargs, match", [
    ((_X, jnp.ones((15,)), None), {}, r"scale must have shape \(16,\)"),
    ((_X, None, jnp.ones((16, 1))), {}, r"offset must have shape \(16,\)"),
    ((_X, jnp.ones((16,)), None), {"axis": 0}, r"scale must have shape \(3,\)"),
    ((_X, jnp.ones((16,), jnp.int32), None), {}, "scale must be a floating-point"),
    ((_X, [1.0] * 16, None), {}, "scale must be an array"),
    ((_X, None, None), {"axis": 3}, "axis=3 is out of range"),
    ((_X, None, None), {"axis": -4}, "axis=-4 is out of range"),
    ((jnp.ones(SHAPE, jnp.int32), None, None), {}, "x must be a floating-point"),
    ((jnp.float32(1.0), None, None), {}, "x must have rank at least 1"),
    ((_X, None, None), {"epsilon": -1.0}, "epsilon must be a finite number >= 0"),
    ((_X, None, None), {"epsilon": float("inf")}, "epsilon must be a finite number >= 0"),
    ((_X, None, None), {"epsilon": "1e-6"}, "epsilon must be a real number"),
])
def test_bad_arguments_raise_value_errors_naming_them(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerNorm().bind(*args, **kwargs)


def test_public_function_raises_for_bad_input():
    with pytest.raises(ValueError, match="scale must have shape"):
        tokamax.layer_norm(jnp.ones((2, 4)), jnp.ones((3,)), None)


def test_second_order_gradient_matches_reference():
    x, scale = random_normal(40, (4, 16)), random_normal(41, (16,))

    def reference(x):
        centered = x - x.mean(-1, keepdims=True)
        y = centered * jax.lax.rsqrt((centered**2).mean(-1, keepdims=True) + 1e-6) * scale
        return jnp.sum(jnp.sin(y))

    def ours(x):
        return jnp.sum(jnp.sin(tokamax.layer_norm(x, scale, None)))

    def curvature(f):
        return jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)

    with reference_precision():
        assert_close(curvature(ours), curvature(reference), scale_rtol=1e-4)
