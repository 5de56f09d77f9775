"""layer_norm(h, ..., residual=x): the pre-norm residual step `s = x + h; y = norm(s)`.

Beyond the base suite (`test_layer_norm_suite.py`, which runs the residual add on every
implementation): plain-JAX rounding of `s`, other axes, the XLA forward feeding the Triton
backward, the argument checks, the cuda lowering, the kernel margin that depends on the call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.layer_norm import api
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.layer_norm.pallas_triton import Config, PallasTritonLayerNorm
from tokamax_kernels.layer_norm.pallas_triton_vjp import Config as VjpConfig
from tokamax_kernels.layer_norm.pallas_triton_vjp import PallasTritonLayerNormVjp
from tokamax_pass import core
from tokamax_pass.core import selection

EPS = 1e-6
SHAPE = (3, 5, 40)

# The row in one block; rows looped in chunks that do not divide n, with row blocks that
# do not divide the row count (as tests/ops/layer_norm/test_triton_layer_norm.py).
TRITON = {
    "triton one_block": (
        Config(block_rows=4, block_n=64, rows_per_program=4, num_warps=4, num_stages=1),
        VjpConfig(block_rows=2, block_n=64, rows_per_program=8, num_warps=4, num_stages=2)),
    "triton chunked": (
        Config(block_rows=2, block_n=16, rows_per_program=4, num_warps=4, num_stages=2),
        VjpConfig(block_rows=4, block_n=16, rows_per_program=8, num_warps=4, num_stages=2)),
}
IMPLEMENTATIONS = ["xla", *TRITON]


def _op(name: str) -> LayerNorm:
    if name == "xla":
        return LayerNorm()
    fwd, bwd = TRITON[name]
    return PallasTritonLayerNorm(
        interpret=True, config=fwd, vjp=PallasTritonLayerNormVjp(interpret=True, config=bwd))


def reference(h, x, scale, offset, subtract_mean=True, axis=-1):
    """`(norm(x + h), x + h)` in float32 (the inputs cast first), for autodiff."""
    s = x.astype(jnp.float32) + h.astype(jnp.float32)
    mean = s.mean(axis, keepdims=True) if subtract_mean else 0.0
    centered = s - mean
    y = centered * jax.lax.rsqrt((centered * centered).mean(axis, keepdims=True) + EPS)
    shape = [1] * s.ndim
    shape[axis] = s.shape[axis]
    if scale is not None:
        y = y * scale.astype(jnp.float32).reshape(shape)
    if offset is not None:
        y = y + offset.astype(jnp.float32).reshape(shape)
    return y, s


def _inputs(dtype, shape=SHAPE, with_scale=True, with_offset=True):
    n = shape[-1]
    h = (2 * random_normal(0, shape) + 0.5).astype(dtype)
    x = (3 * random_normal(1, shape) - 1).astype(dtype)
    scale = (1 + 0.5 * random_normal(2, (n,))).astype(dtype) if with_scale else None
    offset = random_normal(3, (n,), dtype) if with_offset else None
    cotangents = (random_normal(4, shape), random_normal(5, shape))
    return h, x, {"scale": scale, "offset": offset}, cotangents


def _loss(fn, cotangents):
    """A scalar of both outputs, each weighted by its own random cotangent."""
    def loss(h, x, params):
        y, s = fn(h, x, params["scale"], params["offset"])
        return (jnp.sum(y.astype(jnp.float32) * cotangents[0])
                + jnp.sum(s.astype(jnp.float32) * cotangents[1]))
    return loss


def _check_against_reference(fn, h, x, params, cotangents, dtype, subtract_mean=True, axis=-1):
    y, s = fn(h, x, params["scale"], params["offset"])
    assert y.dtype == s.dtype == dtype and y.shape == s.shape == h.shape
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (h, x, params))
    with reference_precision():
        want_y, want_s = reference(*f32[:2], f32[2]["scale"], f32[2]["offset"],
                                   subtract_mean=subtract_mean, axis=axis)
        want = jax.grad(_loss(lambda h, x, sc, o: reference(
            h, x, sc, o, subtract_mean=subtract_mean, axis=axis), cotangents),
            argnums=(0, 1, 2))(*f32)
    assert_close(y, want_y, dtype)
    assert_close(s, want_s, dtype)
    got = jax.jit(jax.grad(_loss(fn, cotangents), argnums=(0, 1, 2)))(h, x, params)
    assert got[0].dtype == got[1].dtype == dtype
    assert_close(got[0], want[0], dtype)
    assert_close(got[1], want[1], dtype)
    for name in ("scale", "offset"):
        if params[name] is None:
            assert got[2][name] is None
        else:
            assert got[2][name].dtype == dtype
            assert_close(got[2][name], want[2][name], dtype)
    return got


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_sum_is_rounded_as_plain_jax_and_the_norm_is_of_that_sum(name):
    """`s` is bitwise `x + h` in bf16, and `y` the norm of that rounded `s`: its float32
    statistics (the family's residuals) are those of the rounded sum, not of the exact one."""
    h, x, params, _ = _inputs(jnp.bfloat16, (4, 64))
    op = _op(name)
    y, s = op(h, params["scale"], params["offset"], residual=x)
    assert s.dtype == jnp.bfloat16 and (s == x + h).all()
    with reference_precision():
        want = reference(s, jnp.zeros_like(s), params["scale"], params["offset"])[0]
    assert_close(y, want, scale_rtol=8e-3)  # one bf16 rounding of y
    kwargs = dict(axis=1, epsilon=EPS, subtract_mean=True, return_residuals=True)
    _, stats = op._fwd(h, None, None, residual=x, config=op.config, **kwargs)
    _, want_stats = LayerNorm()._fwd(x + h, None, None, config=None, **kwargs)
    for got, wanted in zip(stats, want_stats, strict=True):
        assert got.dtype == jnp.float32
        assert_close(got, wanted, scale_rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1])
def test_other_axes(axis):
    h, x, params, cotangents = _inputs(jnp.float32, with_scale=False, with_offset=False)
    n = SHAPE[axis]
    params = {"scale": random_normal(6, (n,)), "offset": random_normal(7, (n,))}
    _check_against_reference(
        lambda h, x, sc, o: api.layer_norm(h, sc, o, axis=axis, residual=x), h, x, params,
        cotangents, jnp.float32, axis=axis)


def test_xla_forward_residuals_feed_triton_backward():
    h, x, params, cotangents = _inputs(jnp.float32)
    op = LayerNorm(vjp=PallasTritonLayerNormVjp(interpret=True, config=TRITON["triton chunked"][1]))
    _check_against_reference(lambda h, x, sc, o: op(h, sc, o, residual=x), h, x, params,
                             cotangents, jnp.float32)


def test_without_a_residual_nothing_changes():
    """Same single output and the same bound arguments (and so cache keys) as before the
    option existed; a residual is an argument of its own key."""
    x = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
    plain = LayerNorm().bind(x, None, None)
    assert set(plain.arguments) == {"x", "scale", "offset", "axis", "epsilon", "subtract_mean"}
    assert "residual" not in plain.cache_key
    fused = LayerNorm().bind(x, None, None, residual=x)
    assert fused.arguments["residual"] == x and fused.cache_key != plain.cache_key
    assert "residual" in LayerNorm().similarity_arguments(fused.arguments)
    h, _, _, _ = _inputs(jnp.float32, (4, 64))
    out = api.layer_norm(h, None, None)
    assert isinstance(out, jax.Array)
    assert_close(out, reference(h, jnp.zeros_like(h), None, None)[0])


_X = jax.ShapeDtypeStruct((4, 64), jnp.float32)


@pytest.mark.parametrize("residual, match", [
    (jax.ShapeDtypeStruct((4, 32), jnp.float32), r"residual must have x's shape .*\[4, 32\]"),
    (jax.ShapeDtypeStruct((64,), jnp.float32), r"residual must have x's shape"),
    (jax.ShapeDtypeStruct((4, 64), jnp.bfloat16), r"residual must have x's shape and dtype "
                                                  r"float32\[4, 64\].*bfloat16"),
    ([[1.0] * 64] * 4, "residual must be an array"),
])
def test_bad_residual_raises_value_error_naming_it(residual, match):
    with pytest.raises(ValueError, match=match):
        LayerNorm().bind(_X, None, None, residual=residual)
    with pytest.raises(ValueError, match="residual"):
        api.layer_norm(jnp.ones((4, 64)), None, None, residual=residual)


def test_kernel_margins_hold_with_a_residual():
    """A Triton norm's forward measured alone must beat XLA's by 40%, and its gradient
    XLA's by 20%, with a residual or without (XLA fuses the norm with its neighbours in
    a model). XLA's norm gradient reruns only the row statistics, so it is ranked at its
    whole time alone: at the Llama shape the kernel's gradient, measured at 0.56 of it,
    runs; one within the margin does not."""
    x = jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16)
    for residual in (None, x):
        assert PallasTritonLayerNorm().kernel_margin_for(
            _bind(PallasTritonLayerNorm(), x, residual=residual)) == 0.4
        assert PallasTritonLayerNormVjp().kernel_margin_for(
            _bind(PallasTritonLayerNormVjp(), x, residual=residual)) == 0.2
    xla_vjp = core.AutodiffVjp(forward=LayerNorm())
    for residual in (None, x):
        forward = [_bind(PallasTritonLayerNorm(), x, residual=residual),
                   _bind(LayerNorm(), x, residual=residual)]
        assert selection.rank_with_evidence(forward, [0.066, 0.0864]) == [1]
        assert selection.rank_with_evidence(forward, [0.04, 0.0864]) == [0, 1]
        gradient = [_bind(PallasTritonLayerNormVjp(), x, residual=residual),
                    _bind(xla_vjp, x, residual=residual)]
        assert not xla_vjp.reruns_forward(gradient[1])
        assert selection.rank_with_evidence(gradient, [0.0877, 0.156]) == [0, 1]
        assert selection.rank_with_evidence(gradient, [0.13, 0.156]) == [1]


def _bind(op, x, residual=None):
    if isinstance(op, core.VjpOp):
        out = x if residual is None else (x, x)
        stats = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
        extra = {} if residual is None else {"residual": residual}
        return op.bind((stats, stats), out, out, x=x, scale=None, offset=None, axis=1,
                       epsilon=EPS, subtract_mean=False, **extra)
    return op.bind(x, None, None, subtract_mean=False, residual=residual)


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_one_forward_and_one_backward_call_and_no_extra_add(name):
    """The gradient of `h` and of `x` is one array from the VJP op: no add outside the two
    op calls (the sum `s`, and dS_total = norm_vjp(dy) + ds, happen inside them)."""
    h, x, params, _ = _inputs(jnp.float32, (4, 64))
    op = _op(name)

    def loss(h, x):
        y, s = op(h, params["scale"], None, residual=x)
        return jnp.sum(y) + jnp.sum(jnp.sin(s))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, x)
    names = [e.primitive.name for e in _equations(jaxpr.jaxpr)]
    assert names.count("tokamax_call") == 2
    full_size_adds = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name in ("add", "add_any")
                      and any(tuple(v.aval.shape) == h.shape for v in e.outvars)]
    assert full_size_adds == []


@pytest.mark.parametrize("subtract_mean", [True, False])
def test_lowers_for_cuda_with_grad(subtract_mean):
    def f(h, x, scale):
        def loss(h, x, scale):
            y, s = api.layer_norm(h, scale, None, subtract_mean=subtract_mean, residual=x,
                                  implementation="triton")
            return y.astype(jnp.float32).sum() + (s.astype(jnp.float32) ** 2).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(h, x, scale)

    args = (jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((2048,), jnp.float32))
    with core.targeting(H200):
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2  # forward + backward kernels
    assert "PallasTritonLayerNormVjp" in text and "residual" in text
