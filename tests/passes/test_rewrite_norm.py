"""`optimize` rewrites LayerNorm and RMSNorm written in `jnp` into the `layer_norm` op
where `implementation=None` picks a kernel for it, and leaves near-misses as written.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: values and
gradients of the rewritten program (the op's `xla` path and its VJP) are compared with
`jax.jit` of the user's function, in float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from _rewriting import (
    REWRITTEN,
    assert_gradients_match_jit,
    h200_plan,
    op_names,
    outcomes,
    weighted,
)
from conftest import assert_close, calibrate, random_normal

B, T, D = 2, 6, 32


def rms_rsqrt(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    return (normed * scale).astype(x.dtype)


def rms_sqrt_no_keepdims(x, scale):
    variance = jnp.mean(x * x, axis=-1)
    return x / jnp.sqrt(variance[..., None] + 1e-5) * scale


def rms_gemma(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * (1 / jnp.sqrt(jnp.mean(x32 ** 2, axis=-1, keepdims=True) + 1e-6))
    return (normed * (1 + scale)).astype(x.dtype)


def rms_no_scale(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def layer_norm_var(x, scale, offset):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    variance = jnp.var(x32, axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + offset).astype(x.dtype)


def layer_norm_spelled_out(x, scale, offset):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return scale * ((x - mean) / jnp.sqrt(variance + 1e-5)) + offset


def layer_norm_scale_before_the_divisor(x, scale, offset):
    """As PyTorch ports write it: the scale multiplied in before the division."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    return scale * (x - mean) / jnp.sqrt(variance + 1e-5) + offset


def rms_scale_before_rsqrt(x, scale):
    return (scale * x) * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def layer_norm_flax(x, scale, offset):
    """`flax.linen.LayerNorm(use_fast_variance=False)`: the scale folded into the
    reciprocal standard deviation."""
    mean = jnp.mean(x, axis=-1)
    variance = jnp.mean(jax.lax.square(x - jnp.expand_dims(mean, -1)), axis=-1)
    y = x - jnp.expand_dims(mean, -1)
    factor = jnp.expand_dims(jax.lax.rsqrt(variance + 1e-6), -1) * scale.reshape(1, 1, -1)
    return y * factor + offset.reshape(1, 1, -1)


def rms_gemma_reference(x, scale):
    """Gemma's reference RMSNorm: the scale given leading unit axes before `1 + scale`."""
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed = x * jax.lax.rsqrt(variance + 1e-6)
    scale = jnp.expand_dims(scale, range(x.ndim - 1))
    return normed * (1 + scale)


def rms_power(x, scale):
    return x * (jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) ** -0.5 * scale


def rms_reciprocal(x, scale):
    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * scale


def equinox_layer_norm(x, weight, bias):
    """`equinox.nn.LayerNorm`, one row at a time under the user's `jax.vmap`: statistics
    over the whole row, the variance clipped at zero."""
    def one(x):
        mean = jnp.mean(x, keepdims=True)
        variance = jnp.maximum(0.0, jnp.var(x, keepdims=True))
        out = (x - mean) * jax.lax.rsqrt(variance + 1e-5)
        return bias + weight * out

    return jax.vmap(jax.vmap(one))(x)


def keras_layer_normalization(x, gamma, beta):
    """Keras 3's `LayerNormalization` as its JAX backend computes it: the statistics of the
    upcast input (`ops.moments`), the centering distributed over the factor,
    `x * inv + (-mean * inv + beta)`, the result cast back."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, [2], keepdims=True)
    variance = jnp.var(x32, axis=[2], keepdims=True)
    inv = jax.lax.rsqrt(variance + 1e-3) * gamma.astype(x32.dtype)
    res = -mean * inv + beta.astype(x32.dtype)
    return (x32 * inv + res).astype(x.dtype)


SPELLINGS = [rms_power, rms_reciprocal, rms_rsqrt, rms_sqrt_no_keepdims, rms_gemma,
             rms_gemma_reference, rms_no_scale, layer_norm_var, layer_norm_spelled_out,
             layer_norm_scale_before_the_divisor, rms_scale_before_rsqrt, layer_norm_flax,
             equinox_layer_norm, keras_layer_normalization]


def operands(f, dtype=jnp.float32, seed=0):
    x = random_normal(seed, (B, T, D), dtype)
    vectors = [random_normal(seed + 1 + i, (D,)) for i in range(f.__code__.co_argcount - 1)]
    return (x, *vectors)


def check_values_and_gradients(f, args, cotangent, dtype=jnp.float32):
    argnums = tuple(range(len(args)))
    loss = weighted(f, cotangent)
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(jax.value_and_grad(loss, argnums=argnums))(*args)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert op_names(optimized, *args) == ["LayerNorm"]
    out = optimized(*args)
    assert out.dtype == jax.jit(f)(*args).dtype
    assert_close(out, jax.jit(f)(*args), dtype)
    value, grads = jax.value_and_grad(weighted(optimized, cotangent), argnums=argnums)(*args)
    assert_close(value, expected[0], dtype)
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted, dtype)


@pytest.mark.parametrize("f", SPELLINGS, ids=lambda f: f.__name__)
def test_values_and_gradients_match_jit(rewritten, f):
    check_values_and_gradients(f, operands(f), random_normal(9, (B, T, D)))


@pytest.mark.parametrize("f", [f for f in SPELLINGS if f is not rms_no_scale],
                         ids=lambda f: f.__name__)
def test_the_scale_and_offset_go_into_the_op(rewritten, f):
    """Not multiplied in after it: the op fuses them, and its gradient is theirs."""
    args = operands(f)
    (row,) = tokamax.optimize(f).plan(*args)
    vectors = {"scale", "offset"} if len(args) == 3 else {"scale"}
    assert {a.split("=")[0] for a in row.arguments.split(", ")} == {"x"} | vectors


@pytest.mark.parametrize("f", [layer_norm_var, keras_layer_normalization],
                         ids=lambda f: f.__name__)
def test_bfloat16_input_with_float32_statistics(rewritten, f):
    args = operands(f, jnp.bfloat16)
    check_values_and_gradients(f, args, random_normal(9, (B, T, D)), jnp.bfloat16)


def rms_flax_float32_output(x, scale):
    """`flax.linen.RMSNorm` with float32 parameters: the input upcast, the result left in
    float32 (the promotion of the input's and the parameters' dtypes)."""
    x32 = jnp.asarray(x, jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jax.lax.square(x32), axis=-1, keepdims=True) + 1e-6)
    return normed * scale


def rms_flax_normalize(x, scale):
    """`flax.linen.RMSNorm` as Flax computes it: the statistics of the upcast input, then
    the normalization LayerNorm shares, `x - mean` with a mean of `jnp.zeros_like`."""
    variance = jnp.mean(jax.lax.square(jnp.asarray(x, jnp.float32)), axis=(2,))
    mean = jnp.zeros_like(variance).reshape(B, T, 1)
    y = x - mean
    factor = jax.lax.rsqrt(variance.reshape(B, T, 1) + 1e-6) * scale.reshape(1, 1, -1)
    return jnp.asarray(y * factor, jnp.float32)


def layer_norm_float32_output(x, scale, offset):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    factor = jax.lax.rsqrt(jnp.var(x32, axis=-1, keepdims=True) + 1e-5)
    return (x32 - mean) * factor * scale + offset


@pytest.mark.parametrize("f", [rms_flax_float32_output, layer_norm_float32_output],
                         ids=lambda f: f.__name__)
def test_bfloat16_input_left_in_float32(rewritten, f):
    """The norm of the upcast input, kept in float32: the op normalizes the upcast, so
    its float32 result is the expression's, not a bfloat16 rounding of it."""
    args = operands(f, jnp.bfloat16)
    assert jax.jit(f)(*args).dtype == jnp.float32
    check_values_and_gradients(f, args, random_normal(9, (B, T, D)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_flax_rms_norm_subtracting_a_mean_of_zeros(rewritten, dtype):
    """`x - zeros` is `x`: the op normalizes the (upcast) input. Flax upcasts a bfloat16
    input twice (for the statistics, and in `x - mean`), so plain JAX's gradient sums
    the two uses' bfloat16 cotangents, rounding twice where the op rounds once: bfloat16
    tolerances there, float32's for a float32 input."""
    args = operands(rms_flax_normalize, dtype)
    assert jax.jit(rms_flax_normalize)(*args).dtype == jnp.float32
    check_values_and_gradients(rms_flax_normalize, args, random_normal(9, (B, T, D)), dtype)


def test_vmap_scan_and_remat_bodies(rewritten):
    x = random_normal(0, (B, T, D))
    scales = random_normal(1, (3, D))
    cotangent = random_normal(2, (B, T, D))

    def model(x, scales):
        def layer(h, scale):
            return jnp.tanh(jax.checkpoint(jax.vmap(rms_rsqrt, (0, None)))(h, scale)), None

        return (jax.lax.scan(layer, x, scales)[0] * cotangent).sum()

    optimized = tokamax.optimize(model)
    matches = optimized.plan(x, scales).matches
    assert [m.path for m in matches] == ["scan/checkpoint/layer_norm"]
    assert all(m.rewritten for m in matches)
    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, scales)
    value, grads = jax.value_and_grad(optimized, argnums=(0, 1))(x, scales)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def test_a_gradient_traced_inside_optimize_runs_the_op_and_its_vjp(rewritten):
    """The plain backward reads `rsqrt(var + eps)`: the norm is rewritten before JAX
    differentiates it, and the gradient is the op's."""
    args = operands(rms_rsqrt)
    loss = weighted(rms_rsqrt, random_normal(9, (B, T, D)))
    optimized = tokamax.optimize(jax.grad(loss, argnums=(0, 1)))
    assert [(m.path, m.outcome) for m in optimized.plan(*args).matches] == [
        ("vjp/layer_norm", REWRITTEN)]
    assert op_names(optimized, *args) == ["LayerNorm", "AutodiffVjp"]
    for actual, wanted in zip(optimized(*args), jax.jit(jax.grad(loss, argnums=(0, 1)))(*args),
                              strict=True):
        assert_close(actual, wanted)


def eps_outside_sqrt(x, scale):
    return x / (jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True)) + 1e-6) * scale


def statistics_in_bfloat16(x, scale):
    total = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(total / x.shape[-1] + 1e-6) * scale


def mean_rounded_to_bfloat16(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * scale


def unbiased_variance(x, scale, offset):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True, ddof=1)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + offset


def flax_fast_variance(x, scale, offset):
    """`flax.linen.LayerNorm`'s default variance, `max(0, mean(x^2) - mean^2)`: far from
    the op's two-pass one where |mean| >> std."""
    mean = jnp.mean(x, axis=-1)
    mean_of_squares = jnp.mean(jax.lax.square(x), axis=-1)
    variance = jnp.maximum(0.0, mean_of_squares - jax.lax.square(mean))
    factor = jnp.expand_dims(jax.lax.rsqrt(variance + 1e-6), -1) * scale.reshape(1, 1, -1)
    return (x - jnp.expand_dims(mean, -1)) * factor + offset.reshape(1, 1, -1)


def rms_minus_a_nonzero_constant(x, scale):
    """Flax's normalization with a mean of halves, not zeros: no RMSNorm."""
    variance = jnp.mean(jax.lax.square(x), axis=-1, keepdims=True)
    y = x - jnp.full_like(variance, 0.5)
    return y * (jax.lax.rsqrt(variance + 1e-6) * scale)


def variance_clipped_above_zero(x, scale, offset):
    """The variance clipped at a floor above zero, which changes small ones."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.maximum(1e-3, jnp.var(x, axis=-1, keepdims=True))
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + offset


def keras_rms_scaling(x, scale):
    """Keras 3.0's `LayerNormalization(rms_scaling=True)`: the variance, not the mean of
    squares, so no RMSNorm (and no LayerNorm: `x` is not centered)."""
    inv = jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-3)
    return x * inv * scale


def distributed_over_another_mean(x, scale, offset):
    """Keras's distributed centering with the mean of another row."""
    mean = jnp.mean(x[:, ::-1], axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-3) * scale
    return x * inv + (-mean * inv + offset)


def mean_moved_by_the_input(x, scale, offset):
    """Keras's distributed centering with `x` in place of the factor: `-mean * x`."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-3) * scale
    return x * inv + (-mean * x + offset)


def over_the_first_axis(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=0, keepdims=True) + 1e-6) * scale


def masked_variance(x, scale, offset):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True, where=jnp.arange(x.shape[-1]) < 20)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + offset


@pytest.mark.parametrize("f,dtype,reason", [
    (eps_outside_sqrt, jnp.float32, None),
    (over_the_first_axis, jnp.float32, None),
    (mean_rounded_to_bfloat16, jnp.bfloat16, None),
    (statistics_in_bfloat16, jnp.bfloat16, None),
    (unbiased_variance, jnp.float32, "the variance divides by n - 1"),
    (flax_fast_variance, jnp.float32, "the variance is Flax's fast one"),
    (masked_variance, jnp.float32, "the variance is masked"),
    (rms_minus_a_nonzero_constant, jnp.float32, None),
    (variance_clipped_above_zero, jnp.float32, None),
    (keras_rms_scaling, jnp.float32, None),
    (distributed_over_another_mean, jnp.float32, None),
    (mean_moved_by_the_input, jnp.float32, None),
], ids=lambda p: getattr(p, "__name__", ""))
def test_near_misses_are_left_as_written(rewritten, f, dtype, reason):
    args = operands(f, dtype)
    if f is over_the_first_axis:
        args = (args[0], random_normal(5, (B, T, D)))
    optimized = tokamax.optimize(f)
    matches = optimized.plan(*args).matches
    assert [m.reason for m in matches] == ([] if reason is None else [
        m.reason for m in matches if reason in m.reason and not m.rewritten])
    assert reason is None or matches
    assert op_names(optimized, *args) == []
    assert_close(optimized(*args), jax.jit(f)(*args), dtype)


def mean_broadcast_onto_the_features(x, scale, offset):
    """A `(B, T)` mean given its unit axis before the rows, `mean[:, None, :]`: with `T`
    equal to `D` it broadcasts, and feature `j` is centered by row `j`'s mean (a norm of
    those centered values, not LayerNorm of `x`)."""
    mean = jnp.mean(x, axis=-1)
    centered = x - mean[:, None, :]
    variance = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(variance + 1e-5) * scale + offset


def test_a_mean_broadcast_onto_the_features_is_not_the_rows(rewritten):
    args = (random_normal(0, (B, D, D)), random_normal(1, (D,)), random_normal(2, (D,)))
    f = mean_broadcast_onto_the_features
    assert_gradients_match_jit(f, tokamax.optimize(f), random_normal(3, (B, D, D)),
                               (0, 1, 2), args)


def scale_along_the_rows(x, scale):
    """The gain reshaped to `(D, 1)` scales axis -2, not the normalized one."""
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return normed * scale.reshape(-1, 1)


def offset_along_the_rows(x, scale, offset):
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return normed * scale + offset.reshape(-1, 1)


@pytest.mark.parametrize("f", [scale_along_the_rows, offset_along_the_rows],
                         ids=lambda f: f.__name__)
def test_a_vector_reshaped_onto_another_axis_is_not_the_norms(rewritten, f):
    """Square rows (`T == D`), where the shapes alone cannot tell the axes apart: the
    norm may be rewritten, the vector stays outside the op."""
    assert_values_and_gradients_match(f, random_normal(0, (B, D, D)))


def scale_rounded_to_bfloat16(x, scale):
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return normed * scale.astype(jnp.bfloat16).astype(jnp.float32)


def offset_rounded_to_bfloat16(x, scale, offset):
    normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return normed * scale + offset.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("f", [scale_rounded_to_bfloat16, offset_rounded_to_bfloat16],
                         ids=lambda f: f.__name__)
def test_a_vector_rounded_on_the_way_is_not_the_norms(rewritten, f):
    """A scale or offset rounded to bfloat16 and back: the op would take it unrounded."""
    assert_values_and_gradients_match(f, random_normal(0, (B, T, D)))


def assert_values_and_gradients_match(f, x):
    """`optimize(f)` against `jax.jit(f)` on `x` and random `(D,)` vectors."""
    vectors = [random_normal(1 + i, (D,)) for i in range(f.__code__.co_argcount - 1)]
    optimized = tokamax.optimize(f)
    assert_close(optimized(x, *vectors), jax.jit(f)(x, *vectors))
    cotangent = random_normal(9, x.shape)
    argnums = tuple(range(1 + len(vectors)))
    with jax.default_matmul_precision("highest"):
        expected = jax.grad(weighted(f, cotangent), argnums=argnums)(x, *vectors)
    for actual, wanted in zip(jax.grad(weighted(optimized, cotangent),
                                       argnums=argnums)(x, *vectors), expected, strict=True):
        assert_close(actual, wanted)


# --- selection: only where a kernel is chosen ------------------------------------------

X = jax.ShapeDtypeStruct((20000, 768), jnp.float32)
SCALE = jax.ShapeDtypeStruct((768,), jnp.float32)


def test_a_kernel_predicted_faster_replaces_the_norm(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonLayerNorm": 0.8, "LayerNorm": 0.05})
    plan = h200_plan(rms_rsqrt, X, SCALE)
    assert [row.op for row in plan] == ["PallasTritonLayerNorm"]
    assert [m.outcome for m in plan.matches] == ["rewritten: cuda triton"]
    assert plan.matches[0].source_line.endswith("(rms_rsqrt)")


def test_without_evidence_for_a_kernel_the_norm_stays(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonLayerNorm": 0.05, "LayerNorm": 0.8})
    plan = h200_plan(rms_rsqrt, X, SCALE)
    assert len(plan) == 0
    assert [m.outcome for m in plan.matches] == [
        "left alone: the plain path is chosen (cuda xla)"]


def test_rewrite_option_selects_the_pattern(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonLayerNorm": 0.8, "LayerNorm": 0.05})
    for option in (False, ("ragged_dot", "gated_linear_unit")):
        plan = h200_plan(rms_rsqrt, X, SCALE, rewrite=option)
        assert len(plan) == 0 and not plan.matches
    assert [row.op for row in h200_plan(rms_rsqrt, X, SCALE, rewrite=("layer_norm",))] == [
        "PallasTritonLayerNorm"]


def test_jit_and_custom_vjp_bodies(rewritten):
    x, scale = operands(rms_rsqrt)
    cotangent = random_normal(9, (B, T, D))

    @jax.custom_vjp
    def custom(x, scale):
        return rms_rsqrt(x, scale)

    def custom_fwd(x, scale):
        return rms_rsqrt(x, scale), (x, scale)

    def custom_bwd(saved, g):
        return jax.vjp(rms_rsqrt, *saved)[1](g)

    custom.defvjp(custom_fwd, custom_bwd)

    def model(x, scale):
        return ((jax.jit(rms_rsqrt)(x, scale) + custom(x, scale)) * cotangent).sum()

    optimized = tokamax.optimize(model)
    matches = optimized.plan(x, scale).matches
    assert [m.path for m in matches] == ["jit[rms_rsqrt]/layer_norm", "custom_vjp/layer_norm"]
    assert all(m.rewritten for m in matches)
    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, scale)
    value, grads = jax.value_and_grad(optimized, argnums=(0, 1))(x, scale)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)
