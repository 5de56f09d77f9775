"""`optimize` on small models spelled as more codebases write them: PaxML/Praxis's
decoder (a learned per-dim scale on q, logits tanh-capped by a `jnp.array` cap, an
additive causal mask of `jnp.tile`d indices merged with the padding's by `jnp.minimum`
and compared back with half its fill, LayerNorm times `1 + scale`, a gated gelu FFN,
one-hot cross entropy), Grok-1's (grouped heads `...thHd`, logits cast to float32 and
multiplied by `attn_output_multiplier`, capped at 30, a `-1e30` fill, float32 RMSNorm with
its statistic broadcast, a gated gelu MLP) and Hugging Face's Flax BERT encoder (the
padding as an additive bias of shape `(B, 1, 1, S)`, Flax's `dot_product_attention_weights`,
LayerNorm with Flax's fast variance, a masked-LM head with a bias). Each runs its layers
in `lax.scan` under `jax.value_and_grad` of a cross-entropy loss.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: each test lists
what the spelling matches and which masks become the op's `is_causal`, and compares the
rewritten step's loss and gradients with `jax.jit` of the same step (float32). What
these codebases spell their own way is tested alone below, each with a near-miss:
MaxText's attention normalized after the second product, Praxis's additive causal mask
of tiled indices.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tokamax_pass as tokamax
from _rewriting import assert_gradients_match_jit
from conftest import random_normal
from test_rewrite_library_spellings import (
    assert_steps_close,
    maxtext_local_attention,
    optax_softmax_cross_entropy,
    rewritten_patterns,
)
from test_rewrite_more_model_spellings import (
    CAUSAL,
    PADDED,
    Model,
    assert_attention_calls_match_jit,
    attention_calls,
    decoder_arguments,
    flax_mask_bias,
    head_of,
    labels_of,
    layered,
    padding_of,
    rope,
)

B, T, D, N, KV, HD, F, V = 2, 8, 32, 4, 2, 8, 48, 64
NORM, ATTENTION, GLU, LOSS = ("layer_norm", "attention", "gated_linear_unit",
                              "linear_softmax_cross_entropy_loss")


# PaxML / Praxis ----------------------------------------------------------------------
PRAXIS_CAP = 50.0


def large_negative_number(dtype):
    """`py_utils.get_large_negative_number`: `-0.7` times the dtype's largest value."""
    return jnp.asarray(-0.7 * jnp.finfo(dtype).max, dtype=dtype)


def praxis_causal_mask(x):
    """`attentions.causal_mask`: tiled column and row indices compared, times the large
    negative number: `(1, 1, T, T)`, to be added to the logits."""
    t = x.shape[1]
    col_idx = jnp.tile(jnp.arange(t)[jnp.newaxis, :], [t, 1])
    row_idx = jnp.tile(jnp.arange(t)[:, jnp.newaxis], [1, t])
    mask = (row_idx < col_idx).astype(x.dtype) * large_negative_number(x.dtype)
    return mask[jnp.newaxis, jnp.newaxis, :, :]


def apply_mask_to_logits(logits, mask):
    """`py_utils.apply_mask_to_logits`: the additive mask compared with half its fill."""
    min_value = large_negative_number(logits.dtype)
    return jnp.where((mask >= min_value * 0.5), logits, min_value)


def praxis_layer_norm(x, scale, bias, eps=1e-6):
    """`normalizations.LayerNorm`: `mean(square(x - mean))`, times `1 + scale`."""
    mean = jnp.mean(x, axis=[-1], keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=[-1], keepdims=True)
    normed = (x - mean) * lax.rsqrt(var + eps)
    normed *= 1 + scale
    return normed + bias


def praxis_attention(x, p, attention_mask):
    """`DotProductAttention`: q scaled per dim (`PerDimScale`), logits capped by a
    `jnp.array` cap (`_cap_logits`), the softmax in float32."""
    q, k, v = (jnp.einsum("BTD,DNH->BTNH", x, p[n]) for n in ("q", "k", "v"))
    scale = jnp.array(1.442695041 / np.sqrt(HD), dtype=q.dtype)
    scale *= jax.nn.softplus(p["per_dim_scale"])
    logits = jnp.einsum("BTNH,BSNH->BNTS", q * scale, k)
    cap = jnp.array(PRAXIS_CAP, dtype=logits.dtype)
    logits = cap * jnp.tanh(logits / cap)
    padded_logits = apply_mask_to_logits(logits.astype(jnp.float32), attention_mask)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(k.dtype)
    encoded = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    return jnp.einsum("BTNH,DNH->BTD", encoded, p["post"])


def praxis_feed_forward(x, p):
    """`TransformerFeedForward` gated: `gelu(x @ wi_0) * (x @ wi_1)`, no biases."""
    gate_value = jax.nn.gelu(x @ p["wi_0"])
    return (gate_value * (x @ p["wi_1"])) @ p["wo"]


PRAXIS = dict(ln1=(D,), ln1_b=(D,), q=(D, N, HD), k=(D, N, HD), v=(D, N, HD),
              per_dim_scale=(HD,), post=(D, N, HD), ln2=(D,), ln2_b=(D,), wi_0=(D, F),
              wi_1=(D, F), wo=(F, D))


def praxis_loss(params, head, x, paddings, labels):
    """`StackedTransformer`'s mask: the paddings' additive mask merged with the causal one
    by `jnp.minimum`; `FullSoftmax`'s one-hot cross entropy."""
    attention_mask = jnp.minimum(paddings[:, None, None, :] * large_negative_number(x.dtype),
                                 praxis_causal_mask(x))

    def layer(x, p):
        x = x + praxis_attention(praxis_layer_norm(x, p["ln1"], p["ln1_b"]), p,
                                 attention_mask)
        return x + praxis_feed_forward(praxis_layer_norm(x, p["ln2"], p["ln2_b"]), p)

    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), x, params)
    return optax_softmax_cross_entropy((x @ head).astype(jnp.float32), labels).mean()


def praxis_arguments(dtype):
    """The second example's last three tokens are padding (1 marks padding in Pax)."""
    return (layered(PRAXIS, dtype), head_of(dtype), random_normal(101, (B, T, D), dtype),
            1.0 - padding_of(dtype), labels_of(102))


# Grok-1 ------------------------------------------------------------------------------
GROK_MULTIPLIER = 0.08838834764831845


def grok_rms_norm(x, scale, eps=1e-5):
    """`RMSNorm`: float32, the mean of squares broadcast to `x`'s shape."""
    fprop_dtype = x.dtype
    x = x.astype(jnp.float32)
    mean_squared = jnp.mean(jnp.square(x), axis=[-1], keepdims=True)
    mean_squared = jnp.broadcast_to(mean_squared, x.shape)
    normed = x * lax.rsqrt(mean_squared + eps)
    return (scale.astype(jnp.float32) * normed).astype(fprop_dtype)


def grok_attention(x, p, mask):
    """`MultiHeadAttention`: grouped query heads against un-repeated k and v."""
    positions = jnp.arange(T)[None]
    q = rope((x @ p["q"]).reshape(B, T, N, HD), positions)
    k = rope((x @ p["k"]).reshape(B, T, KV, HD), positions)
    v = (x @ p["v"]).reshape(B, T, KV, HD)
    q = q.reshape(B, T, KV, N // KV, HD)
    attn_logits = jnp.einsum("...thHd,...Thd->...hHtT", q, k).astype(jnp.float32)
    attn_logits *= GROK_MULTIPLIER
    max_attn_val = jnp.array(30.0, dtype=attn_logits.dtype)
    attn_logits = max_attn_val * jnp.tanh(attn_logits / max_attn_val)
    attn_logits = jnp.where(mask[:, :, None, :, :], attn_logits, -1e30)
    attn_weights = jax.nn.softmax(attn_logits).astype(q.dtype)
    attn = jnp.einsum("...hHtT,...Thd->...thHd", attn_weights, v)
    return attn.reshape(B, T, -1) @ p["o"]


def grok_dense_block(x, p):
    """`DenseBlock`: `gelu(x @ w1) * (x @ v)`, then the output projection."""
    h_v = x @ p["linear_v"]
    h_w1 = jax.nn.gelu(x @ p["linear"])
    return (h_w1 * h_v) @ p["linear_1"]


GROK = dict(ln1=(D,), q=(D, N * HD), k=(D, KV * HD), v=(D, KV * HD), o=(N * HD, D),
            ln2=(D,), ln3=(D,), linear=(D, F), linear_v=(D, F), linear_1=(F, D), ln4=(D,))


def grok_loss(params, head, x, labels):
    """`Transformer`'s mask: the tokens kept (all here) times `jnp.tril` of ones; norms
    before and after attention and the MLP."""
    causal = jnp.tril(jnp.ones((1, 1, T, T))).astype(jnp.bool_)
    mask = jnp.ones((B, 1, 1, T), jnp.bool_) * causal

    def layer(x, p):
        x = x + grok_rms_norm(grok_attention(grok_rms_norm(x, p["ln1"]), p, mask), p["ln2"])
        return x + grok_rms_norm(grok_dense_block(grok_rms_norm(x, p["ln3"]), p), p["ln4"])

    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), x, params)
    logits = (x @ head).astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits, -1) - label_logits).mean()


# Hugging Face Flax BERT --------------------------------------------------------------
def flax_fast_variance_layer_norm(x, scale, bias, eps=1e-12):
    """Flax's `nn.LayerNorm` (`use_fast_variance=True`, its default): `max(0, mean(x^2) -
    mean^2)`, which the op does not compute (it is left as written)."""
    mean, mean2 = jnp.mean(x, -1, keepdims=True), jnp.mean(jnp.square(x), -1, keepdims=True)
    var = jnp.maximum(0.0, mean2 - jnp.square(mean))
    mul = lax.rsqrt(var + eps) * scale
    return (x - mean) * mul + bias


def flax_attention_weights(query, key, bias):
    """`flax.linen.dot_product_attention_weights` without dropout."""
    query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
    attn_weights = jnp.einsum("...qhd,...khd->...hqk", query, key)
    return jax.nn.softmax(attn_weights + bias).astype(query.dtype)


def bert_self_attention(x, p, attention_mask):
    """`FlaxBertSelfAttention`: biased projections, the padding mask as a bias."""
    q, k, v = ((x @ p[n] + p["b" + n]).reshape(B, T, N, HD) for n in ("q", "k", "v"))
    attention_bias = flax_mask_bias(jnp.expand_dims(attention_mask, axis=(-3, -2)), x.dtype)
    attn_weights = flax_attention_weights(q, k, attention_bias)
    attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, v)
    return attn_output.reshape(B, T, N * HD) @ p["o"] + p["bo"]


BERT = dict(q=(D, N * HD), bq=(N * HD,), k=(D, N * HD), bk=(N * HD,), v=(D, N * HD),
            bv=(N * HD,), o=(N * HD, D), bo=(D,), ln1=(D,), ln1_b=(D,), wi=(D, F), bi=(F,),
            wo=(F, D), bo2=(D,), ln2=(D,), ln2_b=(D,))


def bert_loss(params, head, x, attention_mask, labels):
    """Post-norm layers; the masked-LM head's decoder is the tied embedding plus a bias
    (`FlaxBertLMPredictionHead`), which the op has none of: that loss is left alone."""
    def layer(x, p):
        x = flax_fast_variance_layer_norm(x + bert_self_attention(x, p, attention_mask),
                                          p["ln1"], p["ln1_b"])
        h = jax.nn.gelu(x @ p["wi"] + p["bi"], approximate=False) @ p["wo"] + p["bo2"]
        return flax_fast_variance_layer_norm(x + h, p["ln2"], p["ln2_b"])

    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), x, params)
    embedding, bias = head
    logits = x @ embedding.T + bias
    return optax_softmax_cross_entropy(logits, labels).mean()


def bert_arguments(dtype):
    head = (random_normal(1, (V, D)) * 0.3).astype(dtype), random_normal(2, (V,), dtype)
    return (layered(BERT, dtype), head,
            random_normal(101, (B, T, D), dtype), padding_of(jnp.int32), labels_of(102))


# The steps ---------------------------------------------------------------------------
MODELS = {
    "praxis": Model(praxis_loss, praxis_arguments, [NORM, ATTENTION, NORM, GLU, LOSS],
                    {PADDED}),
    "grok": Model(grok_loss, decoder_arguments(GROK),
                  [NORM, ATTENTION, NORM, NORM, GLU, NORM, LOSS],
                  {(False, None, True, False)}),
    "bert": Model(bert_loss, bert_arguments, [ATTENTION], {PADDED}),
}
# The models CI steps through (`pytest -m slow` steps through the others): each spelling
# the others hold is also checked alone by a test here or in the other model files.
IN_CI = ("praxis",)


@pytest.mark.parametrize("name", [name if name in IN_CI else
                                  pytest.param(name, marks=pytest.mark.slow)
                                  for name in MODELS])
def test_float32_steps_match_jit(rewritten, name):
    model = MODELS[name]
    step = jax.value_and_grad(model.loss, argnums=(0, 1, 2))
    args = model.arguments(jnp.float32)
    optimized = tokamax.optimize(step)
    assert rewritten_patterns(optimized, *args) == model.patterns
    assert attention_calls(optimized, *args) == model.attention
    assert_steps_close(optimized(*args), jax.jit(step)(*args))


# MaxText's attention normalized after the second product ------------------------------
def normalized_after(denominator):
    """MaxText's `compute_local_attention` of causal grouped queries, the product of
    `exp(l - max)` and the values divided by `denominator(sums)`, the sums of shape
    `(B, K, G, T, 1)` moved to the output's `(B, T, N, 1)`."""
    def f(query, key, value):
        b, t, n, d = query.shape
        logits = jnp.einsum("btkgd,bskd->bkgts", query.reshape(b, t, KV, n // KV, d), key)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits * d**-0.5, -1e30)
        local_exps = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        local_sum = jnp.sum(local_exps, axis=-1, keepdims=True)
        out = jnp.einsum("bkgts,bskd->btkgd", local_exps, value).reshape(query.shape)
        return out / denominator(local_sum).reshape(b, t, n, 1)
    return f


SUMS = {
    "moved_to_the_rows": (lambda sums: jnp.moveaxis(sums, -2, 1), True),
    # A softmax of one more logit of 0 ("softmax off by one"): no attention's.
    "plus_one": (lambda sums: jnp.moveaxis(sums, -2, 1) + 1.0, False),
    # Each query head divided by another head's sums, of the same shape (K == G).
    "heads_swapped": (lambda sums: jnp.moveaxis(jnp.swapaxes(sums, 1, 2), -2, 1), False),
}


@pytest.mark.parametrize("spelling", SUMS)
def test_attention_normalized_after_the_second_product(rewritten, spelling):
    """`(exp(l - max) @ v) / sum(exp(l - max))`, each output row divided by its own row's
    sum, is the op's attention (it normalizes before the product: the same up to
    rounding), its causal mask `is_causal`. A denominator that is not those sums, or
    lines them up with other rows, is no attention and stays as written."""
    moved, matched = SUMS[spelling]
    f = normalized_after(moved)
    args = (random_normal(0, (B, T, N, HD)), *(random_normal(s, (B, T, KV, HD))
                                               for s in (1, 2)))
    optimized = tokamax.optimize(f)
    if not matched:  # no match: the program is the user's
        assert optimized.plan(*args).matches == ()
        return
    assert rewritten_patterns(optimized, *args) == [ATTENTION]
    assert attention_calls(optimized, *args) == {CAUSAL}
    assert_gradients_match_jit(f, optimized, random_normal(3, (B, T, N, HD)), (0, 1, 2),
                               args)


def test_maxtexts_attention_normalized_after_the_product_with_its_additive_mask(rewritten):
    """MaxText's own spelling (`test_rewrite_library_spellings`): its additive causal
    mask compared back to booleans, the sums moved and reshaped to `(B, T, N, 1)`."""
    args = (random_normal(0, (B, T, N, HD)), *(random_normal(s, (B, T, KV, HD))
                                               for s in (1, 2)))
    optimized = tokamax.optimize(maxtext_local_attention)
    assert attention_calls(optimized, *args) == {CAUSAL}
    assert_gradients_match_jit(maxtext_local_attention, optimized,
                               random_normal(3, (B, T, N, HD)), (0, 1, 2), args)


# Praxis's additive causal mask of tiled indices ---------------------------------------
def tiled_mask_attention(mask_of):
    def f(q, k, v):
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(HD)
        probs = jax.nn.softmax(apply_mask_to_logits(logits, mask_of(q)), axis=-1)
        return jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    return f


def periodic_mask(x):
    """Column indices tiled from half the row (`jnp.tile` of a longer axis: periodic,
    `cols % (t // 2) <= rows`), no band."""
    t = x.shape[1]
    cols = jnp.tile(jnp.arange(t // 2)[jnp.newaxis, :], [t, 2])
    rows = jnp.tile(jnp.arange(t)[:, jnp.newaxis], [1, t])
    return ((rows < cols).astype(x.dtype) * large_negative_number(x.dtype))[None, None]


@pytest.mark.parametrize(("mask_of", "arguments"), [
    (praxis_causal_mask, CAUSAL),
    (periodic_mask, PADDED),
], ids=["praxis_causal", "periodic"])
def test_an_additive_mask_of_tiled_indices(rewritten, mask_of, arguments):
    """Praxis's causal mask, `(rows < cols).astype(dtype) * large_negative_number` of
    `jnp.tile`d indices, compared back with half its fill, is the causal band; indices
    tiled from a shorter row repeat, no band: that mask is passed as an array."""
    f = tiled_mask_attention(mask_of)
    assert_attention_calls_match_jit(f, arguments)


def test_an_indicator_times_minus_inf_is_no_band(rewritten):
    """`(rows < cols).astype(dtype) * -inf` is NaN where the indicator is 0 (`0 * -inf`):
    no mask of two numbers, so the keys kept where it is 0 are passed as an array."""
    def f(q, k, v):
        rows, cols = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        mask = (rows < cols).astype(q.dtype) * -jnp.inf
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(HD)
        probs = jax.nn.softmax(jnp.where(mask == 0, logits, -1e30), axis=-1)
        return jnp.einsum("BNTS,BSNH->BTNH", probs, v)

    assert_attention_calls_match_jit(f, PADDED)


def test_bert_keeps_flax_fast_variance_layer_norm(rewritten):
    """BERT's LayerNorms of Flax's fast variance are left alone, saying why (its masked-LM
    head's bias makes its loss no match at all)."""
    step = jax.value_and_grad(bert_loss, argnums=(0, 1, 2))
    left_alone = [(m.pattern, "Flax's fast one" in m.reason) for m in
                  tokamax.optimize(step).plan(*bert_arguments(jnp.float32)).matches
                  if not m.rewritten]
    assert left_alone == [(NORM, True)] * 2
