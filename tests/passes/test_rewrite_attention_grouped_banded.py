"""`optimize` rewrites attention written as Gemma-2's is when `jax.nn` cannot take its
soft cap: grouped query heads by reshaping q against un-repeated k and v, float32 logits,
the cap, a causal and a sliding-window mask of `arange` rows and columns, softmax cast
back; also Gemma's reference code, which merges each key head's group of logits into
the query heads between the products and reshapes the probabilities back. A mask that
is a band of key offsets becomes the op's `is_causal` and `local_window_size`; any other
mask is passed to the op as an array.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: values and
gradients of the rewritten program are compared with `jax.jit` of the user's function,
in float32 at HIGHEST precision.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import (
    HIGHEST,
    assert_gradients_match_jit,
    attention_arguments,
    h200_plan,
    weighted,
)
from benchmarks.models.ops import _jnp_attention
from conftest import assert_close, calibrate, random_normal

B, T, S, N, K, H = 2, 12, 14, 4, 2, 16  # group of 2 query heads per key head
WINDOW = 3
SOFT_CAP = 5.0


def rows_minus_cols(rows, cols):
    return (cols <= rows) & (rows - cols <= WINDOW)


def cols_above_rows_minus_window(rows, cols):
    return (rows >= cols) & (cols > rows - WINDOW - 1)


def window_without_causal(rows, cols):
    return rows - cols <= WINDOW


def grouped(q, k, v, keep, *, cap=SOFT_CAP, softmax_axis=-1, fill=-jnp.inf):
    """Gemma-2's attention in jnp, `keep(rows, cols)` the mask (a tuple of them: masks
    applied in turn, each with `fill`, or with its own where `fill` is a tuple)."""
    b, t, n, d = q.shape
    q = q.reshape(b, t, K, n // K, d)
    logits = jnp.einsum("bthgd,bshd->bhgts", q, k, preferred_element_type=jnp.float32,
                        precision=HIGHEST)
    logits = logits / math.sqrt(d)
    logits = cap * jnp.tanh(logits / cap)
    rows, cols = jnp.arange(t)[:, None], jnp.arange(k.shape[1])[None, :]
    keeps = keep if isinstance(keep, tuple) else (keep,)
    fills = fill if isinstance(fill, tuple) else (fill,) * len(keeps)
    for one, one_fill in zip(keeps, fills, strict=True):
        logits = jnp.where(one(rows, cols), logits, one_fill)
    probs = jax.nn.softmax(logits, axis=softmax_axis).astype(v.dtype)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, v, precision=HIGHEST)
    return out.reshape(b, t, n, d)


def operands(seed=0):
    return (random_normal(seed, (B, T, N, H)), random_normal(seed + 1, (B, S, K, H)),
            random_normal(seed + 2, (B, S, K, H)))


def check_values_and_gradients(f, args, cotangent):
    expected = jax.jit(jax.value_and_grad(weighted(f, cotangent), argnums=(0, 1, 2)))(*args)
    optimized = tokamax.optimize(f)
    assert_close(optimized(*args), jax.jit(f)(*args))
    value, grads = jax.value_and_grad(weighted(optimized, cotangent), argnums=(0, 1, 2))(*args)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


@pytest.mark.parametrize(("keep", "causal", "window"), [
    (rows_minus_cols, True, (WINDOW, 0)),
    (cols_above_rows_minus_window, True, (WINDOW, 0)),
    (window_without_causal, False, (WINDOW, T + S)),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_band_mask_becomes_the_ops_window(rewritten, keep, causal, window):
    def f(q, k, v):
        return grouped(q, k, v, keep)

    args = operands()
    assert attention_arguments(tokamax.optimize(f), *args) == {(causal, window, False)}
    check_values_and_gradients(f, args, random_normal(9, (B, T, N, H)))


def tril_and_triu_of_ones(rows, cols):
    return jnp.tril(jnp.ones((T, S), bool)) & jnp.triu(jnp.ones((T, S), bool), -WINDOW)


def band_cast_to_float(rows, cols):
    """A float32 mask, as Flax's `make_causal_mask` gives: kept where nonzero."""
    return rows_minus_cols(rows, cols).astype(jnp.float32)


def float_tril_and_triu_of_ones(rows, cols):
    """Masks of float ones, multiplied: kept where the product is nonzero."""
    ones = jnp.ones((T, S))
    return jnp.tril(ones) * jnp.triu(ones, -WINDOW)


def float_tril_minus_tril_of_ones(rows, cols):
    """A band as a difference of float masks, the one taken away within the other."""
    ones = jnp.ones((T, S))
    return jnp.tril(ones) - jnp.tril(ones, -WINDOW - 1)


def float_masks_compared_from_the_left(rows, cols):
    """Float masks of ones compared with the number as the first operand (`0 < m` in
    Python is `m > 0`): kept where `jnp.less(0, m)` and `jnp.less_equal(1, m)`."""
    ones = jnp.ones((T, S))
    return jnp.less(0, jnp.tril(ones)) & jnp.less_equal(1, jnp.triu(ones, -WINDOW))


def negated_comparisons(rows, cols):
    return ~(cols > rows) & ~(rows - cols > WINDOW)


@pytest.mark.parametrize("keep", [tril_and_triu_of_ones, negated_comparisons,
                                  band_cast_to_float, float_tril_and_triu_of_ones,
                                  float_tril_minus_tril_of_ones,
                                  float_masks_compared_from_the_left],
                         ids=lambda f: f.__name__)
def test_other_spellings_of_the_causal_window(rewritten, keep):
    def f(q, k, v):
        return grouped(q, k, v, keep)

    args = operands(3)
    assert attention_arguments(tokamax.optimize(f), *args) == {(True, (WINDOW, 0), False)}
    assert_close(tokamax.optimize(f)(*args), jax.jit(f)(*args))


def hidden_where_zero(q, k, v, mask):
    """nanoGPT's spelling: a float `jnp.tril` of ones, its zeros filled."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / math.sqrt(H)
    logits = jnp.where(mask == 0, -jnp.inf, logits)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v,
                      precision=HIGHEST)


def test_a_float_tril_of_ones_is_the_ops_causal_mask(rewritten):
    def f(q, k, v):
        return hidden_where_zero(q, k, v, jnp.tril(jnp.ones((T, T)))[None, None])

    args = tuple(random_normal(seed, (B, T, N, H)) for seed in range(3))
    assert attention_arguments(tokamax.optimize(f), *args) == {(True, None, False)}
    check_values_and_gradients(f, args, random_normal(9, (B, T, N, H)))


def union_of_float_masks(ones):
    return jnp.tril(ones) + jnp.triu(ones, WINDOW)


def difference_of_overlapping_float_masks(ones):
    """1 above the diagonal, -1 below the window, 0 between: nonzero on two bands."""
    return jnp.triu(ones, -WINDOW) - jnp.tril(ones)


@pytest.mark.parametrize("mask", [union_of_float_masks, difference_of_overlapping_float_masks],
                         ids=lambda f: f.__name__)
def test_float_masks_nonzero_off_one_band_are_passed_as_arrays(rewritten, mask):
    def f(q, k, v):
        return hidden_where_zero(q, k, v, mask(jnp.ones((T, T))))

    args = tuple(random_normal(seed, (B, T, N, H)) for seed in range(3))
    assert attention_arguments(tokamax.optimize(f), *args) == {(False, None, True)}
    check_values_and_gradients(f, args, random_normal(9, (B, T, N, H)))


def test_inside_value_and_grad_the_attention_and_its_gradient_are_the_op(rewritten):
    cotangent = random_normal(9, (B, T, N, H))

    def f(q, k, v):
        return grouped(q, k, v, rows_minus_cols)

    step = jax.value_and_grad(weighted(f, cotangent), argnums=(0, 1, 2))
    args = operands(5)
    optimized = tokamax.optimize(step)
    assert [m.path for m in optimized.plan(*args).matches if m.rewritten] == ["vjp/attention"]
    assert attention_arguments(optimized, *args) == {(True, (WINDOW, 0), False)}
    expected, actual = jax.jit(step)(*args), optimized(*args)
    assert_close(actual[0], expected[0])
    for got, wanted in zip(actual[1], expected[1], strict=True):
        assert_close(got, wanted)


def anti_diagonal(rows, cols):
    return rows + cols <= T


def strictly_causal(rows, cols):
    return cols < rows  # row 0 sees no key: plain JAX gives NaN there


def unsigned_window(rows, cols):
    """`rows - cols` in uint32 wraps around where `cols > rows`: a causal window, which
    the same expression in signed integers is not."""
    return rows.astype(jnp.uint32) - cols.astype(jnp.uint32) <= WINDOW


@pytest.mark.parametrize(("keep", "fill"), [(anti_diagonal, -jnp.inf), (strictly_causal, -jnp.inf),
                                            (strictly_causal, -1e30), (unsigned_window, -jnp.inf)],
                         ids=["anti_diagonal", "strictly_causal", "strictly_causal_finite_fill",
                              "unsigned_window"])
def test_a_mask_that_is_no_band_is_passed_as_an_array(rewritten, keep, fill):
    """A row that sees no key gets plain JAX's value: NaN for `-inf`, else the mean of
    its key head's values."""
    def f(q, k, v):
        return grouped(q, k, v, keep, fill=fill)

    args = operands(7)
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == {(False, None, True)}
    expected, actual = jax.jit(f)(*args), optimized(*args)
    assert np.array_equal(np.isnan(actual), np.isnan(expected))
    assert_close(jnp.nan_to_num(actual), jnp.nan_to_num(expected))


def test_a_band_of_rounded_float_indices_is_passed_as_an_array(rewritten):
    """bfloat16 holds the integers up to 256 exactly: an `arange` of 260 rounds its last
    indices, and their rows see other keys than a causal mask's."""
    t = 260

    def f(q, k, v):
        indices = jnp.arange(t, dtype=jnp.bfloat16)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.25
        logits = jnp.where(indices[None, :] <= indices[:, None], logits, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)

    args = tuple(random_normal(seed, (1, t, 1, 8)) for seed in range(3))
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == {(False, None, True)}
    assert_close(optimized(*args), jax.jit(f)(*args))


def causal(rows, cols):
    return cols <= rows


def test_a_causal_mask_then_a_window_mask_are_one_band(rewritten):
    """Masks applied in turn (`jnp.where` twice, as sliding-window layers often add
    theirs) keep the keys both keep: the band they share."""
    def f(q, k, v):
        return grouped(q, k, v, (causal, window_without_causal))

    args = operands(5)
    assert attention_arguments(tokamax.optimize(f), *args) == {(True, (WINDOW, 0), False)}
    check_values_and_gradients(f, args, random_normal(9, (B, T, N, H)))


def test_a_band_then_a_mask_reading_data_are_passed_as_arrays(rewritten):
    def f(q, k, v, offsets):
        return grouped(q, k, v, (
            causal, lambda rows, cols: cols >= offsets[:, None, None, None, None]))

    args = (*operands(13), jnp.array([0, 2]))
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == {(False, None, True)}
    expected, actual = jax.jit(f)(*args), optimized(*args)
    assert np.isnan(expected).any()  # rows 0 and 1 of the second sequence see no key
    assert np.array_equal(np.isnan(actual), np.isnan(expected))
    assert_close(jnp.nan_to_num(actual), jnp.nan_to_num(expected))


def causal_against_a_rounded_threshold(rows, cols):
    """Two numbers chosen by a causal comparison, compared with a threshold float32
    rounds: `2.0**24 + 1` is `2.0**24` there, so `chosen < threshold` keeps exactly the
    causal keys (read as `2.0**24 + 1`, it would keep every key)."""
    chosen = jnp.where(cols <= rows, 0.0, 2.0**24)
    threshold = jnp.full(chosen.shape, 2.0**24) + 1.0
    return chosen < threshold


def against_a_rounded_literal(rows, cols):
    """Two numbers chosen by a causal comparison, one a literal float32 rounds: it holds
    `3.0000001e38` and `3e38` as one number, so `chosen <= 3e38` keeps every key (read as
    the literal's float64 value, it would keep only the causal ones)."""
    chosen = jnp.where(cols <= rows, 0.0, 3.0000001e38)
    return chosen <= 3e38


@pytest.mark.parametrize(("keep", "arguments"), [
    (causal_against_a_rounded_threshold, (False, None, True)),
    (against_a_rounded_literal, (False, None, False)),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_number_the_dtype_rounds_is_compared_as_the_program_holds_it(rewritten, keep,
                                                                        arguments):
    """Numbers are compared as the program's dtype holds them: a sum it rounds is not
    read as a band (its mask is passed as an array), a literal is read rounded."""
    def f(q, k, v):
        return grouped(q, k, v, keep)

    args = operands(19)
    assert attention_arguments(tokamax.optimize(f), *args) == {arguments}
    check_values_and_gradients(f, args, random_normal(9, (B, T, N, H)))


def causal_plus_padding_above_one(q, k, v, padding):
    """A float causal mask plus a float padding mask, kept where both are 1: `(causal +
    padding) > 1`, with a fill of `-1e30` (a row it hides whole averages the values)."""
    def keep(rows, cols):
        causal_ones = (cols <= rows).astype(jnp.float32)
        return causal_ones + padding[:, None, None, None, :] > 1

    return grouped(q, k, v, keep, fill=-1e30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_a_causal_mask_plus_a_padding_mask_compared_is_passed_as_an_array(rewritten, dtype):
    """The sum reads the padding (data): no band, the keys both keep passed as an array;
    the first sequence's first key is padding, so its first row is hidden whole."""
    padding = np.ones((B, S), np.float32)
    padding[0, :2] = 0
    padding[1, -3:] = 0
    args = (*operands(17), jnp.asarray(padding))
    low = tuple(a.astype(dtype) for a in args[:3]) + args[3:]
    optimized = tokamax.optimize(causal_plus_padding_above_one)
    assert attention_arguments(optimized, *low) == {(False, None, True)}
    assert_gradients_match_jit(causal_plus_padding_above_one, optimized,
                               random_normal(9, (B, T, N, H)), (0, 1, 2), low, args, dtype)


def test_masks_of_different_fills_are_left_as_written(rewritten):
    def f(q, k, v):
        return grouped(q, k, v, (causal, window_without_causal), fill=(-jnp.inf, -1e30))

    args = operands(5)
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == set()
    assert_close(optimized(*args), jax.jit(f)(*args))


def test_a_mask_reading_data_is_passed_as_an_array(rewritten):
    def f(q, k, v, offsets):
        return grouped(q, k, v, lambda rows, cols: cols <= rows + offsets[:, None, None, None,
                                                                          None])

    args = (*operands(11), jnp.array([0, 2]))
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == {(False, None, True)}
    assert_close(optimized(*args), jax.jit(f)(*args))


def test_softmax_over_the_queries_is_left_as_written(rewritten):
    def f(q, k, v):
        return grouped(q, k, v, rows_minus_cols, softmax_axis=-2)

    args = operands()
    assert not any(m.rewritten for m in tokamax.optimize(f).plan(*args).matches)


def test_the_gemma2_twins_attention_plans_the_hand_ported_calls(calibration_dir):
    """The model suite's plain twin (bfloat16, logits in float32, probabilities cast
    back) planned for an H200: the calls of the hand-ported model."""
    calibrate(calibration_dir, {"PallasMosaicGpuFlashAttention": 0.8,
                                "PallasTritonFlashAttention": 0.7, "DotProductAttention": 0.05})
    q = jax.ShapeDtypeStruct((2, 2048, 8, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2048, 4, 256), jnp.bfloat16)

    def twin(q, k, v):
        return _jnp_attention(q, k, v, causal=True, window=512, soft_cap=50.0)

    plan = h200_plan(twin, q, kv, kv)
    (match,) = plan.matches
    assert match.rewritten and match.implementation["cuda"] != "xla", match.outcome
    (row,) = plan.rows
    arguments = row.bound["arguments"]
    assert (arguments["query"], arguments["key"]) == ("bf16[2,2048,8,256]",
                                                       "bf16[2,2048,4,256]")
    assert (arguments["is_causal"], arguments["local_window_size"], arguments["mask"],
            arguments["logits_soft_cap"], arguments["scale"]) == (True, [512, 0], None,
                                                                  50.0, 1 / 16)



GEMMA_FILL = -2.3819763e38  # Gemma's `K_MASK`


def gemma_attention(q, k, v, positions, *, layout, swap_back=False):
    """Gemma's reference grouped attention: q scaled and reshaped to `(B, T, K, G, H)`,
    the logits of each key head's group merged into `(B, T, N, S)` (`layout` `"BTKGS"`)
    or `(B, N, T, S)` (`"BKGTS"`) for the soft cap, mask and softmax, the probabilities
    reshaped back before the second product (with K and G swapped, a different
    attention, where `swap_back`); the mask causal and a sliding window of `positions`,
    as Gemma's `create_sliding_mask` builds it."""
    b, t, n, h = q.shape
    grouped_q = (q * h**-0.5).reshape(b, t, K, n // K, h)
    logits = jnp.einsum(f"BTKGH,BSKH->{layout}", grouped_q, k, precision=HIGHEST)
    product_shape = logits.shape
    logits = logits.reshape((b, t, n, -1) if layout == "BTKGS" else (b, n, t, -1))
    logits = jnp.tanh(logits / SOFT_CAP) * SOFT_CAP
    cache_positions = jnp.arange(k.shape[1])
    sliding = cache_positions > positions[..., None] - WINDOW
    sliding *= cache_positions < positions[..., None] + WINDOW
    mask = jnp.tril(jnp.ones((t, k.shape[1]), bool)) * sliding
    mask = jnp.expand_dims(mask, -2 if layout == "BTKGS" else -3)
    probs = jax.nn.softmax(jnp.where(mask, logits, GEMMA_FILL), axis=-1).astype(k.dtype)
    probs = probs.reshape(product_shape)
    if swap_back:
        probs = jnp.swapaxes(probs, layout.index("K"), layout.index("G"))
    encoded = jnp.einsum(f"{layout},BSKH->BTKGH", probs, v, precision=HIGHEST)
    return encoded.reshape(b, t, n, h)


@pytest.mark.parametrize(("layout", "positions_given", "arguments"), [
    ("BTKGS", False, (True, (WINDOW - 1, 0), False)),
    ("BKGTS", True, (False, None, True)),
])
def test_gemmas_logits_merged_between_the_products(rewritten, layout, positions_given,
                                                   arguments):
    """Positions made from `arange` in the function give a band (the op's causal
    window); positions passed in, a mask array."""
    def f(q, k, v, positions):
        if not positions_given:
            positions = jnp.broadcast_to(jnp.arange(T), positions.shape)
        return gemma_attention(q, k, v, positions, layout=layout)

    args = (*operands(17), jnp.broadcast_to(jnp.arange(T), (B, T)))
    assert attention_arguments(tokamax.optimize(f), *args) == {arguments}
    check_values_and_gradients(f, args, random_normal(9, (B, T, N, H)))


def test_probabilities_reshaped_back_to_other_heads_are_left_as_written(rewritten):
    def f(q, k, v, positions):
        return gemma_attention(q, k, v, positions, layout="BTKGS", swap_back=True)

    args = (*operands(17), jnp.broadcast_to(jnp.arange(T), (B, T)))
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == set()
    assert_close(optimized(*args), jax.jit(f)(*args))
