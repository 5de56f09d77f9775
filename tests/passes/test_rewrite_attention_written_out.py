"""`optimize` rewrites attention written out in plain JAX,
`softmax(scale * q @ k^T [+ bias] [soft cap] [masked]) @ v`, into the
`dot_product_attention` op where `implementation=None` picks a kernel for it, and leaves
near-misses as written.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: values and
gradients of the rewritten program (the op's `xla` path and its VJP) are compared with
`jax.jit` of the user's function, in float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import (
    HIGHEST,
    REWRITTEN,
    assert_gradients_match_jit,
    h200_plan,
    op_names,
    outcomes,
    weighted,
)
from conftest import assert_close, calibrate, random_normal

B, T, S, N, K, H = 2, 8, 10, 4, 2, 16


def einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=HIGHEST)


def matmul(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def einsum_scaled_after(q, k, v, mask):
    logits = einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(H)
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def einsum_ellipsis_flax_style(q, k, v, mask):
    q = q / np.sqrt(H)
    logits = einsum("...qhd,...khd->...hqk", q, k)
    logits = jnp.where(mask, logits, -1e10)
    return einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), v)


def matmul_heads_first_soft_cap(q, k, v, mask):
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # (B, N, T, H)
    logits = matmul(q * 0.3, jnp.swapaxes(k, -1, -2))
    logits = 20.0 * jnp.tanh(logits / 20.0)
    logits = jnp.where(mask, logits, -jnp.inf)
    return jnp.swapaxes(matmul(jax.nn.softmax(logits, axis=-1), v), 1, 2)


def grouped_query_by_repeat(q, k, v, mask):
    k, v = (jnp.repeat(a[:, :, :K], N // K, axis=2) for a in (k, v))
    logits = einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return einsum("bhqk,bkhd->bqhd", weights, v)


def with_bias(q, k, v, bias):
    logits = einsum("bqhd,bkhd->bhqk", q, k) * 0.25 + bias
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def bias_subtracted(q, k, v, bias):
    """`logits - bias`: the op's bias is `-bias` (a negation is exact)."""
    logits = einsum("bqhd,bkhd->bhqk", q, k) * 0.25 - bias
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def float_mask_flax_style(q, k, v, mask):
    """Flax's masks are float32 (`make_attention_mask(..., dtype=jnp.float32)`), and
    `jnp.where` keeps the keys where they are nonzero: the boolean they were cast from."""
    logits = einsum("...qhd,...khd->...hqk", q / np.sqrt(H), k)
    logits = jnp.where(mask.astype(jnp.float32), logits, jnp.finfo(jnp.float32).min)
    return einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits), v)


def bias_subtracted_before_the_scale(q, k, v, bias):
    """`(logits - bias) * scale`: the op's bias is `-bias * scale`."""
    logits = (einsum("bqhd,bkhd->bhqk", q, k) - bias) * 0.25
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def float_mask_argument(q, k, v, mask):
    """A float mask passed in (Flax's masks are built outside the attention), with
    values other than 0 and 1: `jnp.where` keeps the keys where it is nonzero."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -jnp.inf)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def integer_mask(q, k, v, mask):
    """A mask given as integers (an `attention_mask` of 0 and 1, here of 0 and 2): kept
    where nonzero."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -1e9)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def bias_before_the_scale(q, k, v, bias):
    logits = (einsum("bqhd,bkhd->bhqk", q, k) + bias) / np.sqrt(H)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def softmax_written_out_max_stopped(q, k, v, mask):
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -jnp.inf)
    weights = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return einsum("bhqk,bkhd->bqhd", weights, v)


def scaled_after_the_mask(q, k, v, mask):
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf) / np.sqrt(H)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def mask_given_to_the_softmax(q, k, v, mask):
    """`jax.nn.softmax(logits, where=mask)`: 0 for the keys the mask hides, and for every
    key of a row it hides whole (whose result is then 0)."""
    logits = einsum("bqhd,bkhd->bhqk", q, k) * H ** -0.5
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1, where=mask), v)


def softmax_in_log_space(q, k, v, mask):
    """The probabilities as the exponential of `jax.nn.log_softmax`."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -jnp.inf)
    return einsum("bhqk,bkhd->bqhd", jnp.exp(jax.nn.log_softmax(logits, axis=-1)), v)


def softmax_in_log_space_finite_fill(q, k, v, mask):
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -1e30)
    return einsum("bhqk,bkhd->bqhd", jnp.exp(jax.nn.log_softmax(logits, axis=-1)), v)


SPELLINGS = [einsum_scaled_after, einsum_ellipsis_flax_style, matmul_heads_first_soft_cap,
             grouped_query_by_repeat, with_bias, softmax_written_out_max_stopped,
             scaled_after_the_mask, bias_before_the_scale, bias_subtracted,
             bias_subtracted_before_the_scale, float_mask_flax_style, float_mask_argument,
             integer_mask, mask_given_to_the_softmax, softmax_in_log_space]


def operands(f, seed=0, hide_a_row=False):
    q = random_normal(seed, (B, T, N, H))
    k, v = random_normal(seed + 1, (B, S, N, H)), random_normal(seed + 2, (B, S, N, H))
    if f in (with_bias, bias_before_the_scale, bias_subtracted, bias_subtracted_before_the_scale,
             logits_subtracted_from_bias):
        return q, k, v, random_normal(seed + 3, (B, N, T, S))
    mask = np.array(jax.random.bernoulli(jax.random.key(seed + 3), 0.7, (B, 1, T, S)))
    mask[:, :, :, 0] = True  # every row sees a key ...
    if hide_a_row:
        mask[0, 0, 3, :] = False  # ... but this one
    if f is integer_mask:
        return q, k, v, jnp.asarray(mask, jnp.int32) * 2
    if f is float_mask_argument:  # kept keys 0.5 or -2, hidden ones 0 (-0.0 for some)
        kept = np.where(np.arange(S) % 2, 0.5, -2.0)
        return q, k, v, jnp.asarray(np.where(mask, kept, np.where(np.arange(T)[:, None] % 2,
                                                                   -0.0, 0.0)), jnp.float32)
    return q, k, v, jnp.asarray(mask)


@pytest.mark.parametrize("f", SPELLINGS, ids=lambda f: f.__name__)
def test_values_and_gradients_match_jit(rewritten, f):
    args = operands(f)
    cotangent = random_normal(9, (B, T, N, H))
    loss = weighted(f, cotangent)
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    expected = jax.jit(jax.value_and_grad(loss, argnums=floats))(*args)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert op_names(optimized, *args) == ["DotProductAttention"]
    assert_close(optimized(*args), jax.jit(f)(*args))
    value, grads = jax.value_and_grad(weighted(optimized, cotangent), argnums=floats)(*args)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def softmax_in_float32_scale_by_sqrt(q, k, v, mask):
    """As Flax's `force_fp32_for_softmax` and most hand-written models: the scale computed
    with jnp, the logits cast to float32 for the softmax, the probabilities cast back."""
    logits = einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.where(mask, logits, -1e10).astype(jnp.float32)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return einsum("bhqk,bkhd->bqhd", weights, v)


def logits_cast_to_float32_before_the_scale(q, k, v, mask):
    """The product's bfloat16 logits cast to float32 first, then scaled and masked."""
    logits = einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(H)
    logits = jnp.where(mask, logits, -1e10)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)


def logits_cast_to_float32_before_a_bias(q, k, v, bias):
    logits = einsum("bqhd,bkhd->bhqk", q * 0.25, k).astype(jnp.float32) + bias
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)


def scaled_in_bfloat16_before_a_float32_bias(q, k, v, bias):
    """bfloat16 logits scaled in bfloat16, then widened by the float32 bias they meet."""
    logits = einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(H).astype(q.dtype)
    logits = logits + bias.astype(jnp.float32)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)


def query_and_key_cast_to_float32(q, k, v, mask):
    """Flax's `dot_product_attention_weights(..., dtype=jnp.float32)` on bfloat16 q and k
    (Hugging Face's `attention_softmax_in_fp32`): both cast before the scale and the
    product, the probabilities cast back to the values' dtype."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    logits = einsum("...qhd,...khd->...hqk", q / jnp.sqrt(H).astype(jnp.float32), k)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits).astype(v.dtype), v)


@pytest.mark.parametrize("f", [softmax_in_float32_scale_by_sqrt,
                               logits_cast_to_float32_before_the_scale,
                               logits_cast_to_float32_before_a_bias,
                               scaled_in_bfloat16_before_a_float32_bias,
                               query_and_key_cast_to_float32], ids=lambda f: f.__name__)
def test_bfloat16_softmax_in_float32_with_a_computed_scale(rewritten, f):
    """The casts around the softmax (before or after the scale, mask or bias), of q and k
    before the product, and a scale spelled `1 / sqrt(d)` in jnp are read through; in
    bfloat16 the rewrite matches the float32 reference as plain JAX does."""
    biased = (logits_cast_to_float32_before_a_bias, scaled_in_bfloat16_before_a_float32_bias)
    args = operands(with_bias if f in biased else f)
    low = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *low) == [REWRITTEN]
    assert op_names(optimized, *low) == ["DotProductAttention"]
    assert_gradients_match_jit(f, optimized, random_normal(9, (B, T, N, H)), (0, 1, 2), low,
                               args, jnp.bfloat16)


def fill_scaled_to_minus_infinity(q, k, v, mask):
    """The largest finite fill doubled after the mask: `-inf`, as a fill of `-inf` is."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), jnp.finfo(jnp.float32).min)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits * 2.0, axis=-1), v)


@pytest.mark.parametrize("f", [einsum_scaled_after, matmul_heads_first_soft_cap,
                               fill_scaled_to_minus_infinity, softmax_in_log_space,
                               softmax_in_log_space_finite_fill], ids=lambda f: f.__name__)
def test_a_row_with_every_key_hidden_is_plain_jaxs(rewritten, f):
    """A finite fill averages the values there; `-inf` gives NaN."""
    args = operands(f, hide_a_row=True)
    expected = jax.jit(f)(*args)
    actual = tokamax.optimize(f)(*args)
    assert outcomes(tokamax.optimize(f), *args) == [REWRITTEN]
    assert np.array_equal(np.isnan(actual), np.isnan(expected))
    assert np.isnan(expected).any() == (
        f not in (einsum_scaled_after, softmax_in_log_space_finite_fill))
    assert_close(jnp.nan_to_num(actual), jnp.nan_to_num(expected))


@pytest.mark.parametrize("f", [einsum_scaled_after, matmul_heads_first_soft_cap,
                               fill_scaled_to_minus_infinity, softmax_in_log_space,
                               softmax_in_log_space_finite_fill], ids=lambda f: f.__name__)
def test_a_row_with_every_key_hidden_has_plain_jaxs_gradients(rewritten, f):
    """Autodiff of plain JAX multiplies the NaN probabilities of a row a fill of `-inf`
    hides whole into the values' gradient (every key and feature of that batch element
    and head, though the row's cotangent be zero): the rewrite's gradients are NaN where
    `jax.jit`'s are, and match them elsewhere."""
    args = operands(f, hide_a_row=True)
    cotangent = random_normal(9, (B, T, N, H))
    loss = jax.grad(weighted(f, cotangent), argnums=(0, 1, 2))
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    expected = jax.jit(loss)(*args)
    actual = jax.grad(weighted(optimized, cotangent), argnums=(0, 1, 2))(*args)
    for got, wanted in zip(actual, expected, strict=True):
        assert np.array_equal(np.isnan(got), np.isnan(wanted))
        assert_close(jnp.nan_to_num(got), jnp.nan_to_num(wanted))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_a_row_the_softmax_where_hides_whole_is_zero_as_in_jit(rewritten, dtype):
    """The op gives a row the softmax's `where=` hides whole zeros and no gradient, as
    `jax.nn.softmax` does; in bfloat16 the rewrite matches the float32 reference as plain
    JAX does."""
    f = mask_given_to_the_softmax
    args = operands(f, hide_a_row=True)
    low = tuple(a.astype(dtype) if a.dtype == jnp.float32 else a for a in args)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *low) == [REWRITTEN]
    actual = np.asarray(optimized(*low), np.float32)
    assert not np.any(actual[0, 3]) and not np.any(np.asarray(jax.jit(f)(*low))[0, 3])
    assert_close(actual, jax.jit(f)(*args), dtype)
    assert_gradients_match_jit(f, optimized, random_normal(9, (B, T, N, H)), (0, 1, 2), low,
                               args, dtype)


def test_a_band_given_to_the_softmax_is_the_ops_causal_mask(rewritten):
    def f(q, k, v):
        return mask_given_to_the_softmax(q, k, v, jnp.tril(jnp.ones((T, S), bool)))

    args = operands(f)[:3]
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    (row,) = optimized.plan(*args)
    assert row.bound["arguments"]["is_causal"] and row.bound["arguments"]["mask"] is None
    assert_gradients_match_jit(f, optimized, random_normal(9, (B, T, N, H)), (0, 1, 2), args)


def test_vmap_scan_and_remat_bodies(rewritten):
    q, k, v, mask = operands(einsum_scaled_after)
    cotangent = random_normal(9, (B, T, N, H))

    def per_example(q, k, v, mask):
        return einsum_scaled_after(q[None], k[None], v[None], mask[None])[0]

    def model(q, k, v, mask):
        def layer(h, _):
            return jax.checkpoint(jax.vmap(per_example))(h, k, v, mask), None

        return (jax.lax.scan(layer, q, length=2)[0] * cotangent).sum()

    optimized = tokamax.optimize(model)
    matches = optimized.plan(q, k, v, mask).matches
    assert [m.path for m in matches] == ["scan/checkpoint/attention"]
    assert all(m.rewritten for m in matches)
    expected = jax.jit(jax.value_and_grad(model, argnums=(0, 1, 2)))(q, k, v, mask)
    value, grads = jax.value_and_grad(optimized, argnums=(0, 1, 2))(q, k, v, mask)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def fill_not_large_enough(q, k, v, mask):
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) * 0.25, -10.0)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def softmax_over_queries(q, k, v, mask):
    logits = einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-2), v)


def scale_from_the_data(q, k, v, mask):
    """A scalar made from q, not from numbers: no constant scale to read."""
    logits = einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.mean(q * q))
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def dropout(q, k, v, mask):
    logits = einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    kept = jax.random.bernoulli(jax.random.key(0), 0.9, logits.shape)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1) * kept / 0.9, v)


def mask_before_the_soft_cap(q, k, v, mask):
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), -1e10)
    logits = 20.0 * jnp.tanh(logits / 20.0)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def fill_scaled_out_of_reach(q, k, v, mask):
    """-1e9 hides a key; scaled by 1/4 after the mask it is a fill the op does not take."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), -1e9) / np.sqrt(H)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def soft_cap_under_a_scale_after_the_mask(q, k, v, mask):
    """The scale multiplies the capped logits: the op scales before it caps."""
    logits = 20.0 * jnp.tanh(einsum("bqhd,bkhd->bhqk", q, k) / 20.0)
    logits = jnp.where(mask, logits, -jnp.inf) * 0.3
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def bias_under_a_scale_after_the_mask(q, k, v, mask):
    """The scale multiplies the bias too: the op adds its bias after the scale."""
    bias = jnp.arange(S, dtype=q.dtype) / S
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k) + bias, -jnp.inf) * 0.3
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def divided_by_zero_after_the_mask(q, k, v, mask):
    """Not a scale (infinite logits): left as written, and `optimize` runs it."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf) / 0.0
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def negative_scale_after_the_mask(q, k, v, mask):
    """-inf times a negative number is +inf: the masked keys would win."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), -1e30) * -0.25
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def logits_subtracted_from_bias(q, k, v, bias):
    """`bias - logits`: the logits negated, no attention."""
    logits = bias - einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def logits_rounded_to_bfloat16(q, k, v, mask):
    """float32 logits rounded to bfloat16 and back: the op's float32 logits would not."""
    logits = einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.bfloat16) * 0.3
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits.astype(jnp.float32), axis=-1), v)


@pytest.mark.parametrize("f", [fill_not_large_enough, softmax_over_queries, scale_from_the_data,
                               dropout, mask_before_the_soft_cap, logits_rounded_to_bfloat16,
                               fill_scaled_out_of_reach, soft_cap_under_a_scale_after_the_mask,
                               negative_scale_after_the_mask,
                               bias_under_a_scale_after_the_mask, logits_subtracted_from_bias],
                         ids=lambda f: f.__name__)
def test_near_misses_are_left_as_written(rewritten, f):
    args = operands(f)
    optimized = tokamax.optimize(f)
    assert not any(m.rewritten for m in optimized.plan(*args).matches)
    assert op_names(optimized, *args) == []
    assert_close(optimized(*args), jax.jit(f)(*args))


def softmax_where_beside_a_where_mask(q, k, v, mask):
    """A `jnp.where` mask of `-1e30` then the softmax's `where=`: a row the first hides
    whole among the keys `where=` keeps averages their values."""
    logits = jnp.where(mask, einsum("bqhd,bkhd->bhqk", q, k), -1e30)
    causal = jnp.tril(jnp.ones((T, S), bool))
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1, where=causal), v)


def test_a_softmax_where_beside_another_mask_is_left_as_written_with_its_reason(rewritten):
    f = softmax_where_beside_a_where_mask
    args = operands(f, hide_a_row=True)
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(*args).matches
    assert not match.rewritten and "softmax (where=) beside another mask" in match.reason
    assert op_names(optimized, *args) == []
    assert_close(optimized(*args), jax.jit(f)(*args))


def test_a_division_by_zero_after_the_mask_is_left_as_written(rewritten):
    args = operands(divided_by_zero_after_the_mask)
    optimized = tokamax.optimize(divided_by_zero_after_the_mask)
    assert not any(m.rewritten for m in optimized.plan(*args).matches)
    np.testing.assert_array_equal(np.asarray(optimized(*args)),
                                  np.asarray(jax.jit(divided_by_zero_after_the_mask)(*args)))


def float32_softmax_against_bfloat16_values(q, k, v):
    logits = einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.25
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def numpy_float64_scale_on_bfloat16_logits(q, k, v):
    """The NumPy scale promotes the logits, and so the probabilities, to float32."""
    logits = einsum("bqhd,bkhd->bhqk", q, k) * np.float64(0.25)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("f", [float32_softmax_against_bfloat16_values,
                               numpy_float64_scale_on_bfloat16_logits],
                         ids=lambda f: f.__name__)
def test_probabilities_wider_than_the_values_are_left_as_written(rewritten, f):
    """float32 probabilities against bfloat16 values: plain JAX multiplies them in float32
    (a float32 result); the op would round the probabilities to bfloat16."""
    q, k, v = (random_normal(i, (B, T, N, H)).astype(jnp.bfloat16) for i in range(3))
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(q, k, v).matches
    assert not match.rewritten and "wider than the values' bfloat16" in match.reason
    assert op_names(optimized, q, k, v) == []


def logits_product_into_bfloat16(q, k, v):
    """float32 q and k multiplied into bfloat16 logits (`preferred_element_type`): the
    product rounds them, the op's float32 logits would not."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.bfloat16,
                        precision=HIGHEST)
    return einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits.astype(jnp.float32) * 0.25), v)


def probabilities_rounded_to_bfloat16_and_back(q, k, v):
    """float32 probabilities rounded to bfloat16 and back against float32 values."""
    probabilities = jax.nn.softmax(einsum("bqhd,bkhd->bhqk", q, k) * 0.25, axis=-1)
    return einsum("bhqk,bkhd->bqhd", probabilities.astype(jnp.bfloat16).astype(jnp.float32), v)


def output_accumulated_into_float32(q, k, v):
    """bfloat16 probabilities and values multiplied into a float32 result: the op's is
    bfloat16."""
    logits = einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.25
    probabilities = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probabilities, v, preferred_element_type=jnp.float32,
                      precision=HIGHEST)


@pytest.mark.parametrize("f, dtype, reason", [
    (logits_product_into_bfloat16, jnp.float32, None),
    (probabilities_rounded_to_bfloat16_and_back, jnp.float32, "rounded to bfloat16"),
    (output_accumulated_into_float32, jnp.bfloat16, "second product's result is float32"),
], ids=lambda a: getattr(a, "__name__", None))
def test_products_and_probabilities_rounded_otherwise_are_left_as_written(
        rewritten, f, dtype, reason):
    """Where the user's products or casts round otherwise than the op (its logits float32,
    its probabilities and result in the values' dtype), the attention stays as written."""
    q, k, v = (random_normal(i, (B, T, N, H)).astype(dtype) for i in range(3))
    optimized = tokamax.optimize(f)
    matches = optimized.plan(q, k, v).matches
    assert not any(m.rewritten for m in matches)
    if reason is not None:
        (match,) = matches
        assert reason in match.reason
    assert op_names(optimized, q, k, v) == []


def products_at(first, second):
    def attention(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=first) * 0.25
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=second)

    return attention


def test_the_products_precision_is_the_ops(rewritten):
    """`precision=HIGHEST` on both products is the op's (float32 attention stays float32 on
    a GPU, where the default rounds to TF32); products of different precisions are left
    as written."""
    q, k, v = (random_normal(i, (B, T, N, H)) for i in range(3))
    with jax.default_matmul_precision("default"):
        (row,) = tokamax.optimize(products_at(HIGHEST, HIGHEST)).plan(q, k, v)
        assert row.bound["arguments"]["precision"]["name"] == "HIGHEST"
        (match,) = tokamax.optimize(products_at(HIGHEST, None)).plan(q, k, v).matches
    assert not match.rewritten and "precisions differ" in match.reason


def test_probabilities_used_elsewhere_are_named(rewritten):
    def also_returns_probabilities(q, k, v, mask):
        probabilities = jax.nn.softmax(einsum("bqhd,bkhd->bhqk", q, k) * 0.25, axis=-1)
        return einsum("bhqk,bkhd->bqhd", probabilities, v), probabilities

    args = operands(einsum_scaled_after)
    optimized = tokamax.optimize(also_returns_probabilities)
    (match,) = optimized.plan(*args).matches
    assert not match.rewritten and "used elsewhere" in match.reason


# --- selection: only where a kernel is chosen ------------------------------------------

Q = jax.ShapeDtypeStruct((4, 4096, 16, 128), jnp.bfloat16)


def causal_attention(q, k, v):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 128**0.5
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def test_a_kernel_predicted_faster_replaces_the_attention(calibration_dir):
    calibrate(calibration_dir, {"PallasMosaicGpuFlashAttention": 0.8,
                                "PallasTritonFlashAttention": 0.7, "DotProductAttention": 0.05})
    plan = h200_plan(causal_attention, Q, Q, Q)
    (match,) = plan.matches
    assert match.rewritten and match.implementation["cuda"] != "xla", match.outcome
    assert match.source_line.endswith("(causal_attention)")
    for option in (False, ("layer_norm",)):
        assert not h200_plan(causal_attention, Q, Q, Q, rewrite=option).matches


def test_integer_queries_and_keys_are_left_as_written(rewritten):
    """An int8 q . k into float32 logits: the op takes floats; `optimize` runs it."""
    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits * 0.1), v)

    q = jax.random.randint(jax.random.key(0), (B, T, N, H), -8, 8, jnp.int8)
    k = jax.random.randint(jax.random.key(1), (B, S, N, H), -8, 8, jnp.int8)
    v = random_normal(2, (B, S, N, H))
    optimized = tokamax.optimize(f)
    assert not any(m.rewritten for m in optimized.plan(q, k, v).matches)
    assert_close(optimized(q, k, v), jax.jit(f)(q, k, v))
