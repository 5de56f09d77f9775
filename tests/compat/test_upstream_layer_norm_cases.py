"""Upstream Tokamax's layer-norm cases (`NormalizationTestBase`, its api test), run through
`tokamax_pass.layer_norm`: the same shapes, vmaps, `scale_offset`s and tolerances."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from compat._upstream import NONE_ON_CPU, assert_trees_all_close

# Upstream runs its grid for the base op, `implementation="xla"` and "triton" (which
# falls back to "xla" on CPU); here each distinct CPU path runs once.
IMPLEMENTATIONS = ("xla", NONE_ON_CPU)
ATOL = {jnp.dtype(jnp.float32): 5e-7, jnp.dtype(jnp.bfloat16): 2e-3}


def _reference(x, scale, offset, *, axis, epsilon, scale_offset, subtract_mean):
    y = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = y.mean(axis, keepdims=True) if subtract_mean else 0.0
    variance = jnp.square(y - mean).mean(axis, keepdims=True)
    y = (y - mean) * jax.lax.rsqrt(variance + epsilon)
    other_axes = [i for i in range(x.ndim) if i != axis % x.ndim]
    if scale is not None:
        y = y * jnp.expand_dims(scale.astype(y.dtype) + scale_offset, other_axes)
    if offset is not None:
        y = y + jnp.expand_dims(offset.astype(y.dtype), other_axes)
    return y.astype(x.dtype)


def _inputs(x_shape, scale_shape, offset_shape):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], x_shape, jnp.float32)
    scale = None if scale_shape is None else jax.random.uniform(keys[1], scale_shape)
    offset = None if offset_shape is None else jax.random.uniform(keys[2], offset_shape)
    dy = jax.random.normal(keys[3], x.shape, x.dtype)
    return x, scale, offset, dy


def _vmapped(f, vmap_in_axes):
    for in_axes in vmap_in_axes:
        f = jax.vmap(f, in_axes=in_axes, out_axes=in_axes[0])
    return f


def _out_and_grads(f, x, scale, offset, dy):
    """`jax.vjp` of `f` at the inputs and its pullback of `dy`, in one compiled program
    (eagerly, every small op compiles on its own)."""
    @jax.jit
    def run(x, scale, offset, dy):
        out, pullback = jax.vjp(f, x, scale, offset)
        return out, pullback(dy)
    return run(x, scale, offset, dy)


@functools.cache
def _expected(x_shape, scale_shape, offset_shape, keywords, vmap_in_axes):
    """The reference's output and gradients, once per case (both implementations of a case
    compare against the same values)."""
    f_ref = _vmapped(functools.partial(_reference, **dict(keywords)), vmap_in_axes)
    return _out_and_grads(f_ref, *_inputs(x_shape, scale_shape, offset_shape))


def _check(implementation, x_shape, scale_shape, offset_shape, *, axis=-1, epsilon=1e-6,
           scale_offset=0.0, subtract_mean=True, vmap_in_axes=()):
    x, scale, offset, dy = _inputs(x_shape, scale_shape, offset_shape)
    keywords = dict(axis=axis, epsilon=epsilon, scale_offset=scale_offset,
                    subtract_mean=subtract_mean)
    f = _vmapped(functools.partial(tokamax.layer_norm, implementation=implementation,
                                   **keywords), vmap_in_axes)

    atol = ATOL[x.dtype] * math.sqrt(x.shape[axis])
    expected, (dx_ref, dscale_ref, doffset_ref) = _expected(
        x_shape, scale_shape, offset_shape, tuple(keywords.items()), vmap_in_axes)
    actual, (dx, dscale, doffset) = _out_and_grads(f, x, scale, offset, dy)
    assert_trees_all_close(actual, expected, atol=atol)
    assert_trees_all_close(dx, dx_ref, atol=atol)
    broadcast = math.prod(d for i, d in enumerate(x.shape) if i != axis % x.ndim)
    if scale is not None:
        assert_trees_all_close(dscale, dscale_ref, atol=ATOL[x.dtype] * 10 * math.sqrt(broadcast))
    if offset is not None:
        assert_trees_all_close(doffset, doffset_ref,
                               atol=ATOL[x.dtype] * 25 * math.sqrt(broadcast))


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [(64,), (128, 32), (8, 128, 32), (256, 42)])
@pytest.mark.parametrize(("use_scale_and_offset", "scale_offset"),
                         [(False, 0.0), (True, 0.0), (True, 1.0)])
def test_layer_norm(implementation, shape, use_scale_and_offset, scale_offset):
    params = (shape[-1],) if use_scale_and_offset else None
    _check(implementation, shape, params, params, scale_offset=scale_offset)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_layer_norm_axis(implementation, axis):
    shape = (24, 32, 40)
    _check(implementation, shape, (shape[axis],), (shape[axis],), axis=axis)


def _vmapped_param_shapes(shape, axis, vmap_in_axes):
    """Scale and offset shapes for `vmap_in_axes` over an input of `shape` (upstream's rule)."""
    inner = list(shape)
    sizes = []
    for in_axes in vmap_in_axes[::-1]:
        sizes.insert(0, inner.pop(in_axes[0]))
    scale_shape, offset_shape = [inner[axis]], [inner[axis]]
    for size, in_axes in zip(sizes, vmap_in_axes, strict=True):
        if in_axes[1] is not None:
            scale_shape.insert(in_axes[1], size)
        if in_axes[2] is not None:
            offset_shape.insert(in_axes[2], size)
    return tuple(scale_shape), tuple(offset_shape)


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("vmap_in_axes", [
    ((0, None, None),), ((0, 0, None),), ((1, None, 0),),
    ((0, None, None), (0, None, None))])
def test_layer_norm_vmap(implementation, axis, vmap_in_axes):
    shape = (24, 32, 40)
    scale_shape, offset_shape = _vmapped_param_shapes(shape, axis, vmap_in_axes)
    _check(implementation, shape, scale_shape, offset_shape, axis=axis,
           vmap_in_axes=vmap_in_axes)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [(128, 32), (8, 128, 32), (256, 42)])
def test_rms_norm(implementation, shape):
    _check(implementation, shape, (shape[-1],), None, subtract_mean=False)


@pytest.mark.parametrize("implementation", ["xla", None])
def test_basic_api_value_and_symbolic_export(implementation):
    """Upstream's `test_basic_api`: value and gradient under `jit`, and a serialized export
    whose leading dimension is symbolic reproduces them."""
    keys = jax.random.split(jax.random.key(0))
    x = jax.random.normal(keys[0], (128, 32), jnp.bfloat16)
    scale = jax.random.uniform(keys[1], (32,), jnp.bfloat16)
    offset = jax.random.uniform(keys[1], (32,), jnp.bfloat16)

    def value_and_grad(impl):
        return jax.jit(jax.value_and_grad(
            lambda x, s, o: jnp.sum(tokamax.layer_norm(x, s, o, implementation=impl))))

    norm_fn = value_and_grad(implementation)
    golden = value_and_grad("xla")(x, scale, offset)
    assert_trees_all_close(norm_fn(x, scale, offset), golden)

    (rows,) = jax.export.symbolic_shape("a")
    params = jax.ShapeDtypeStruct((32,), x.dtype)
    exported = jax.export.export(norm_fn, disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(
        jax.ShapeDtypeStruct((rows, 32), x.dtype), params, params)
    rehydrated = jax.export.deserialize(exported.serialize())
    assert_trees_all_close(jax.jit(rehydrated.call)(x, scale, offset), golden)


# Upstream's `test_bench` specs (AlphaFold pair activations, bfloat16 with float32 scale
# and offset): (x shape, axis).
BENCH_SPECS = {
    "alphafold_384res_64chan": ((384, 384, 64), -1),
    "alphafold_384res_128chan": ((384, 384, 128), -1),
    "alphafold_768res_128chan": ((768, 768, 128), -1),
    "alphafold_384res_128chan_axis0": ((128, 384, 384), 0),
    "alphafold_768res_128chan_axis0": ((128, 768, 768), 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCH_SPECS))
def test_bench(name):
    shape, axis = BENCH_SPECS[name]
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], shape, jnp.float32).astype(jnp.bfloat16)
    scale = jax.random.uniform(keys[1], (shape[axis],))
    offset = jax.random.uniform(keys[2], (shape[axis],))
    f = functools.partial(tokamax.layer_norm, axis=axis, implementation="xla")
    f_ref = functools.partial(_reference, axis=axis, epsilon=1e-6, scale_offset=0.0,
                              subtract_mean=True)
    atol = ATOL[x.dtype] * math.sqrt(shape[axis])
    expected, pullback_ref = jax.vjp(f_ref, x, scale, offset)
    actual, pullback = jax.vjp(f, x, scale, offset)
    assert_trees_all_close(actual, expected, atol=atol)
    dy = jax.random.normal(keys[3], shape, jnp.float32).astype(x.dtype)
    dx, dscale, doffset = pullback(dy)
    dx_ref, dscale_ref, doffset_ref = pullback_ref(dy)
    assert_trees_all_close(dx, dx_ref, atol=atol)
    broadcast = math.prod(d for i, d in enumerate(shape) if i != axis % len(shape))
    assert_trees_all_close(dscale, dscale_ref, atol=ATOL[x.dtype] * 10 * math.sqrt(broadcast))
    assert_trees_all_close(doffset, doffset_ref, atol=ATOL[x.dtype] * 25 * math.sqrt(broadcast))
