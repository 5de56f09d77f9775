"""`optimize` reads a mask added to the logits as a bias of 0 and a fill that swallows
them (Hugging Face's Flax models: `lax.select(mask > 0, zeros, full(finfo.min))`) as the
op's mask, so a query row the mask hides whole (a padded sequence) gets plain JAX's
value and gradient there; the op would otherwise add `finfo.min` to its logits, which
its kernels overflow to `-inf` (NaN rows) and its `lse` residual rounds (gradients off
by the number of keys).

On CPU the plain path is chosen, so `rewritten` keeps every candidate: values and
gradients of the rewritten program are compared with `jax.jit` of the user's function,
in float32 at HIGHEST precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _rewriting import HIGHEST, REWRITTEN, assert_gradients_match_jit, op_names, outcomes
from conftest import assert_close, random_normal

B, T, N, K, H = 2, 6, 4, 2, 8
# Padding: the first sequence all padding (every row hidden), the second's first two keys.
PADDING = np.ones((B, T), np.int32)
PADDING[0, :] = 0
PADDING[1, :2] = 0


def bias_of(mask, dtype=jnp.float32):
    """Hugging Face Flax's bias of a mask: 0 where it is set, `finfo(dtype).min` elsewhere."""
    return jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0).astype(dtype),
                          jnp.full(mask.shape, jnp.finfo(dtype).min).astype(dtype))


def flax_weights(q, k, bias):
    """`flax.linen.dot_product_attention_weights`: q scaled, the bias added, the softmax."""
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=HIGHEST) + bias
    return jax.nn.softmax(logits).astype(q.dtype)


def causal(length):
    """Flax's `make_causal_mask` as Hugging Face builds it: over the longest sequence, sliced."""
    idxs = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 16))
    mask = jnp.greater_equal(idxs[..., None], idxs[..., None, :])[:, None]
    return mask[:, :, :length, :length]


def hugging_face_llama(q, k, v, padding):
    """`FlaxLlamaAttention`: the causal mask and the padding combined into one float32
    mask, its bias, keys and values repeated for the query heads."""
    mask = jnp.broadcast_to(causal(T), (B, 1, T, T))
    padding = jnp.broadcast_to(jnp.expand_dims(padding, (-3, -2)), mask.shape)
    mask = jnp.logical_and(padding, mask).astype(jnp.float32)
    k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
    weights = flax_weights(q, k, bias_of(mask))
    return jnp.einsum("...hqk,...khd->...qhd", weights, v, precision=HIGHEST)


def t5_position_bias(q, k, v, padding, position_bias):
    """T5's Flax attention: its position bias plus the padding's bias, no scale."""
    bias = position_bias + bias_of(jnp.expand_dims(padding, (-3, -2)))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


def where_bias_under_the_scale(q, k, v, padding):
    """`jnp.where(mask, 0, fill)` added before the scale."""
    bias = jnp.where(jnp.expand_dims(padding, (-3, -2)) > 0, 0.0, jnp.finfo(jnp.float32).min)
    logits = (jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) + bias) * 0.3
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


def bias_expanded_after_the_select(q, k, v, padding):
    """The `(B, S)` padding's bias expanded to the logits' rank after it is made."""
    bias = bias_of(padding)[:, None, None, :]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.3 + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


def complement_of_the_mask(q, k, v, padding):
    """The mask's complement scaled, `(1.0 - mask) * finfo.min`, as ports of BERT write it."""
    mask = (jnp.expand_dims(padding, (-3, -2)) > 0).astype(jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.3
    logits = logits + (1.0 - mask) * jnp.finfo(jnp.float32).min
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


def operands(f, dtype=jnp.float32):
    q = random_normal(0, (B, T, N, H), dtype)
    heads = K if f is hugging_face_llama else N
    k, v = (random_normal(seed, (B, T, heads, H), dtype) for seed in (1, 2))
    extra = (random_normal(3, (1, N, T, T)),) if f is t5_position_bias else ()
    return (q, k, v, jnp.asarray(PADDING), *extra)


@pytest.mark.parametrize("f", [hugging_face_llama, t5_position_bias, where_bias_under_the_scale,
                               bias_expanded_after_the_select, complement_of_the_mask],
                         ids=lambda f: f.__name__)
def test_rows_the_bias_hides_whole_have_the_values_and_gradients_of_jit(rewritten, f):
    args = operands(f)
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *args) == [REWRITTEN]
    assert op_names(optimized, *args) == ["DotProductAttention"]
    (row,) = optimized.plan(*args)
    assert "mask=" in row.arguments
    assert ("bias=" in row.arguments) == (f is t5_position_bias)
    assert_close(optimized(*args), jax.jit(f)(*args))
    assert_gradients_match_jit(f, optimized, random_normal(9, (B, T, N, H)), floats, args)


def test_a_bfloat16_bias_of_its_own_minimum(rewritten):
    """`finfo(bfloat16).min` in a bfloat16 bias, as a Flax model of bfloat16 computes it."""
    def f(q, k, v, padding):
        weights = flax_weights(q, k, bias_of(jnp.expand_dims(padding, (-3, -2)), q.dtype))
        return jnp.einsum("...hqk,...khd->...qhd", weights, v, precision=HIGHEST)

    args = operands(where_bias_under_the_scale)
    low = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, *low) == [REWRITTEN]
    assert_gradients_match_jit(f, optimized, random_normal(9, (B, T, N, H)), (0, 1, 2), low,
                               args, jnp.bfloat16)


def bias_of_minus_1e9(q, k, v, padding):
    """A fill of `-1e9` added to the logits rounds them (to multiples of 64) rather than
    swallowing them: a row it hides whole keeps what is left."""
    bias = jnp.where(jnp.expand_dims(padding, (-3, -2)) > 0, 0.0, -1e9)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.3 + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


def causal_bias_plus_padding_bias(q, k, v, padding):
    """Two masks spelled as biases and added: where both hide a key the fills add to -inf,
    so a row the padding hides whole averages only the keys the causal mask keeps."""
    bias = bias_of(causal(T)) + bias_of(jnp.expand_dims(padding, (-3, -2)))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.3 + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


@pytest.mark.parametrize("f, reason", [(bias_of_minus_1e9, "-1e+09"),
                                       (causal_bias_plus_padding_bias, "two masks")],
                         ids=["fill_the_logits_round_into", "two_mask_biases_added"])
def test_near_misses_are_left_as_written_with_their_reason(rewritten, f, reason):
    args = operands(f)
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(*args).matches
    assert not match.rewritten and reason in match.reason
    assert op_names(optimized, *args) == []
    assert_close(optimized(*args), jax.jit(f)(*args))


def causal_bias_plus_padding_bias_of_minus_inf(q, k, v, padding):
    """Two masks spelled as biases of `-inf` (`jnp.where(m, 0.0, -jnp.inf)`, weakly typed:
    their sum is cast to float32) and added: a row they hide whole is NaN, and so are the
    gradients of its query, keys and values."""
    def bias(mask):
        return jnp.where(mask, 0.0, -jnp.inf)

    mask_bias = bias(causal(T)) + bias(jnp.expand_dims(padding, (-3, -2)) > 0)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.3 + mask_bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


def causal_bias_then_padding_bias_of_minus_inf(q, k, v, padding):
    """The two `-inf` mask biases added to the logits one after the other."""
    causal_bias = jnp.where(causal(T), 0.0, -jnp.inf)
    padding_bias = jnp.where(jnp.expand_dims(padding, (-3, -2)) > 0, 0.0, -jnp.inf)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * 0.3
    logits = logits + causal_bias + padding_bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)


@pytest.mark.parametrize("f", [causal_bias_plus_padding_bias_of_minus_inf,
                               causal_bias_then_padding_bias_of_minus_inf],
                         ids=lambda f: f.__name__)
def test_two_mask_biases_of_minus_inf_added_are_left_as_written(rewritten, f):
    args = operands(f)
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(*args).matches
    assert not match.rewritten and "biases of -inf added" in match.reason
    assert op_names(optimized, *args) == []
    np.testing.assert_allclose(optimized(*args), jax.jit(f)(*args), rtol=1e-6, equal_nan=True)


def test_logits_of_no_product_with_a_mask_bias_are_no_attention_near_miss():
    """`softmax(a * 2 + where(mask, 0, -1e9)) @ v` reads as far as its bias like attention,
    but its logits are no `q . k`: `plan()` lists no attention left alone."""
    def f(a, mask, v):
        logits = a * 2 + jnp.where(mask, 0.0, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v, precision=HIGHEST)

    args = (random_normal(0, (B, N, T, T)), jnp.ones((B, 1, T, T), bool),
            random_normal(1, (B, T, N, H)))
    assert not tokamax.optimize(f).plan(*args).matches


def test_the_fill_the_pass_reads_as_hidden_is_the_floor_the_kernels_hold_logits_at():
    """A bias at or below `KERNEL_FLOOR` is read as hiding its keys because the `triton`
    kernels hold every logit at `HIDDEN_LOGIT`: two names for one fact, kept equal."""
    from tokamax_kernels.attention import _flash_tiles
    from tokamax_pass.passes import additive_mask

    assert additive_mask.KERNEL_FLOOR == _flash_tiles.HIDDEN_LOGIT
