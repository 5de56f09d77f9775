"""`optimize` on small models spelled as JAX libraries write them: dm-haiku's
`MultiHeadAttention`, `LayerNorm` and `RMSNorm`; Equinox's per-example modules under
`jax.vmap`; Google's Gemma reference code; MaxText's Llama block; Keras 3's
`LayerNormalization` and `MultiHeadAttention`; a PaLM-style parallel block. Each runs its
layers in `lax.scan` under `jax.value_and_grad` of optax's one-hot cross-entropy loss.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: the test lists
what each spelling matches, and compares the rewritten step's loss and gradients with
`jax.jit` of the same step (float32), or checks that they are as close to the float32
step as plain JAX's (bfloat16, where rounding differs inside the ops). The pieces these
libraries spell their own way are tested one by one below: Haiku's broadcast statistic
and parameterless norms, MaxText's additive mask compared back to booleans, optax's
integer-label loss, and mask biases that hide keys without swallowing the logits
(Keras 3's in bfloat16 and float16, the TensorFlow tutorial's `mask * -1e9`).
"""

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tokamax_pass as tokamax
from _rewriting import assert_gradients_match_jit, attention_arguments, weighted
from conftest import TOLERANCE, assert_close, random_normal

B, T, D, N, KV, HD, F, V, LAYERS = 2, 8, 32, 4, 2, 8, 48, 64, 2
NORM, ATTENTION, GLU, LOSS = ("layer_norm", "attention", "gated_linear_unit",
                              "linear_softmax_cross_entropy_loss")


# dm-haiku ----------------------------------------------------------------------------
def haiku_rms_norm(x, scale, eps=1e-5):
    """`hk.RMSNorm`: the mean of squares and the scale broadcast to `x`'s shape."""
    mean_squared = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    mean_squared = jnp.broadcast_to(mean_squared, x.shape)
    return x * jnp.broadcast_to(scale, x.shape) * lax.rsqrt(mean_squared + eps)


def haiku_layer_norm(x, scale, offset, eps=1e-5):
    """`hk.LayerNorm`: scale, offset and mean broadcast to `x`'s shape."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    scale, offset = jnp.broadcast_to(scale, x.shape), jnp.broadcast_to(offset, x.shape)
    mean = jnp.broadcast_to(mean, x.shape)
    inv = scale * lax.rsqrt(variance + lax.convert_element_type(eps, variance.dtype))
    return inv * (x - mean) + offset


def haiku_linear(x, w, b):
    return jnp.dot(x, w) + jnp.broadcast_to(b, x.shape[:-1] + b.shape)


def haiku_attention(x, p, mask):
    """`hk.MultiHeadAttention`'s einsums, scale on the logits, `-1e30` fill."""
    def heads(w, b):
        return haiku_linear(x, w, b).reshape((*x.shape[:-1], N, HD))
    q, k, v = heads(p["q"], p["bq"]), heads(p["k"], p["bk"]), heads(p["v"], p["bv"])
    attn_logits = jnp.einsum("...thd,...Thd->...htT", q, k)
    attn_logits = attn_logits / np.sqrt(HD).astype(k.dtype)
    attn_logits = jnp.where(mask, attn_logits, -1e30)
    attn = jnp.einsum("...htT,...Thd->...thd", jax.nn.softmax(attn_logits), v)
    return haiku_linear(jnp.reshape(attn, (*x.shape[:-1], -1)), p["o"], p["bo"])


HAIKU = dict(ln_scale=(D,), ln_offset=(D,), q=(D, N * HD), bq=(N * HD,), k=(D, N * HD),
             bk=(N * HD,), v=(D, N * HD), bv=(N * HD,), o=(N * HD, D), bo=(D,),
             rms_scale=(D,), w1=(D, F), b1=(F,), w2=(F, D), b2=(D,))


def haiku_layer(x, p):
    mask = jnp.tril(jnp.ones((1, 1, T, T)))
    x = x + haiku_attention(haiku_layer_norm(x, p["ln_scale"], p["ln_offset"]), p, mask)
    h = haiku_rms_norm(x, p["rms_scale"])
    return x + haiku_linear(jax.nn.gelu(haiku_linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])


# Equinox -----------------------------------------------------------------------------
def equinox_linear(w, b, x):
    return w @ x + b


def equinox_attention_of_a_head(query, key, value, mask):
    """`eqx.nn.attention.dot_product_attention` of one head: 2-D, q scaled first,
    the finfo-min fill, the softmax in float32 and cast back."""
    query = query / math.sqrt(query.shape[-1])
    logits = jnp.einsum("sd,Sd->sS", query, key)
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(logits.dtype, jnp.float32)
    weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
    return jnp.einsum("sS,Sd->sd", weights, value)


def equinox_attention(p, x, mask):
    """`eqx.nn.MultiheadAttention` (its default projections have no bias): `jax.vmap` of
    the projections over tokens and of the attention over heads."""
    def project(w):
        return jax.vmap(lambda token: w @ token)(x).reshape(T, N, -1)
    attn = jax.vmap(equinox_attention_of_a_head, in_axes=(1, 1, 1, None), out_axes=1)(
        project(p["wq"]), project(p["wk"]), project(p["wv"]), mask)
    return jax.vmap(lambda token: p["wo"] @ token)(attn.reshape(T, -1))


def equinox_norm(x, weight, bias=None, eps=1e-5):
    """`eqx.nn.LayerNorm` (with `bias`) or `eqx.nn.RMSNorm` of one token, in float32."""
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(x.dtype, jnp.float32)
    y = x.astype(dtype)
    if bias is None:
        out = lax.rsqrt(jnp.mean(y**2) + eps) * y
    else:
        variance = jnp.maximum(0.0, jnp.var(y, keepdims=True))
        out = (y - jnp.mean(y, keepdims=True)) * lax.rsqrt(variance + eps)
    out = weight.astype(dtype) * out
    if bias is not None:
        out = out + bias.astype(dtype)
    return out.astype(x.dtype)


EQUINOX = dict(ln_weight=(D,), ln_bias=(D,), wq=(N * HD, D), wk=(N * HD, D), wv=(N * HD, D),
               wo=(D, N * HD), rms_weight=(D,), w1=(F, D), b1=(F,), w2=(D, F), b2=(D,))


def equinox_example(x, p):
    mask = jnp.tril(jnp.ones((T, T), bool))
    h = jax.vmap(lambda t: equinox_norm(t, p["ln_weight"], p["ln_bias"]))(x)
    x = x + equinox_attention(p, h, mask)
    h = jax.vmap(lambda t: equinox_norm(t, p["rms_weight"]))(x)
    mlp = functools.partial(equinox_linear, p["w2"], p["b2"])
    return x + jax.vmap(lambda t: mlp(jax.nn.relu(equinox_linear(p["w1"], p["b1"], t))))(h)


def equinox_layer(x, p):
    return jax.vmap(equinox_example, in_axes=(0, None))(x, p)


# Gemma -------------------------------------------------------------------------------
GEMMA_K_MASK = -2.3819763e38
GEMMA_WINDOW = 4
GEMMA_SOFT_CAP = 50.0


def gemma_rms_norm(x, scale):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = jnp.asarray(x * lax.rsqrt(var + 1e-06))
    return normed_inputs * (1 + jnp.expand_dims(scale, axis=range(len(x.shape) - 1)))


def gemma_attention(x, p, attn_mask):
    """Gemma 2's `Attention` of a sliding-window layer: grouped queries by reshape."""
    query_proj = jnp.einsum("BTD,NDH->BTNH", x, p["q"])
    key_proj, value_proj = jnp.einsum("BSD,CKDH->CBSKH", x, p["kv"])
    query_scaled = query_proj * HD**-0.5
    b, t, kg, h = query_scaled.shape
    query_scaled = query_scaled.reshape((b, t, KV, kg // KV, h))
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
    logits = logits.reshape((b, t, N, -1))
    logits = jnp.tanh(logits / GEMMA_SOFT_CAP) * GEMMA_SOFT_CAP
    all_ones = jnp.ones_like(attn_mask)
    sliding_mask = (jnp.triu(all_ones, -GEMMA_WINDOW + 1)
                    * jnp.tril(all_ones, GEMMA_WINDOW - 1))
    attn_mask = sliding_mask * attn_mask
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, GEMMA_K_MASK)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
    probs = probs.reshape((b, t, KV, N // KV, -1))
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj).reshape((b, t, N, h))
    return jnp.einsum("BTNH,NHD->BTD", encoded, p["o"])


def gemma_feed_forward(x, p):
    gate = jnp.einsum("...F,NHF->...NH", x, p["gating"])
    activations = jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
    return jnp.einsum("...H,HF->...F", activations, p["linear"])


GEMMA = dict(pre_attn=(D,), q=(N, D, HD), kv=(2, KV, D, HD), o=(N, HD, D), post_attn=(D,),
             pre_ffw=(D,), gating=(2, F, D), linear=(F, D), post_ffw=(D,))


def gemma_layer(x, p):
    attn_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (x.shape[0], T, T))
    attended = gemma_attention(gemma_rms_norm(x, p["pre_attn"]), p, attn_mask)
    x = x + gemma_rms_norm(attended, p["post_attn"])
    h = gemma_rms_norm(x, p["pre_ffw"])
    return x + gemma_rms_norm(gemma_feed_forward(h, p), p["post_ffw"])


# MaxText -----------------------------------------------------------------------------
MAXTEXT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)


def maxtext_rms_norm(x, scale):
    y = jnp.asarray(x, jnp.float32)
    mean2 = jnp.mean(lax.square(y), axis=-1, keepdims=True)
    y = jnp.asarray(y * lax.rsqrt(mean2 + 1e-6), x.dtype)
    return y * jnp.asarray(scale, x.dtype)


def maxtext_dense(x, kernel, contracted=1):
    axes = tuple(range(x.ndim - contracted, x.ndim))
    return lax.dot_general(x, kernel, ((axes, tuple(range(contracted))), ((), ())))


def maxtext_mlp(x, p):
    """`MlpBlock` with `fused_mlp`: one `(D, 2, F)` kernel, activations `("silu", "linear")`."""
    x = maxtext_dense(x, p["wi"])
    activations = [jax.nn.silu(x[:, :, 0, ...]), x[:, :, 1, ...]]
    return maxtext_dense(functools.reduce(operator.mul, activations), p["wo_mlp"])


def maxtext_logits(query, key):
    """`AttentionOp`'s float32 logits of grouped queries, masked as `apply_mask_to_logits`
    masks them (an additive causal mask compared with half its fill)."""
    b, t, n, d = query.shape
    query = jnp.reshape(query, (b, t, KV, n // KV, d))
    logits = jnp.einsum("btkgd,bskd->bkgts", query, key).astype(jnp.float32)
    rows, cols = lax.broadcasted_iota(jnp.int32, (t, t), 0), lax.broadcasted_iota(
        jnp.int32, (t, t), 1)
    mask = jnp.where(cols <= rows, 0.0, MAXTEXT_MASK_VALUE)[None, None, None]
    return jnp.where(mask >= MAXTEXT_MASK_VALUE * 0.5, logits, MAXTEXT_MASK_VALUE)


def maxtext_attention(query, key, value):
    probs = jax.nn.softmax(maxtext_logits(query, key), axis=-1).astype(value.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, value).reshape(query.shape)


def maxtext_local_attention(query, key, value):
    """`apply_attention_dot`'s `compute_local_attention`: unnormalized `exp(l - max) @ v`,
    divided by the row sums after the product."""
    logits = maxtext_logits(query, key)
    local_exps = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    local_sum = jnp.moveaxis(jnp.sum(local_exps, axis=-1, keepdims=True), -2, 1)
    out = jnp.einsum("bkgts,bskd->btkgd", local_exps, value).reshape(query.shape)
    return (out / local_sum.reshape(*query.shape[:3], 1)).astype(value.dtype)


MAXTEXT = dict(pre=(D,), q=(D, N, HD), k=(D, KV, HD), v=(D, KV, HD), o=(N, HD, D),
               post=(D,), wi=(D, 2, F), wo_mlp=(F, D))


def maxtext_layer(x, p, attention=maxtext_attention):
    h = maxtext_rms_norm(x, p["pre"])
    q = maxtext_dense(h, p["q"]) / jnp.sqrt(HD).astype(x.dtype)
    attended = attention(q, maxtext_dense(h, p["k"]), maxtext_dense(h, p["v"]))
    x = x + maxtext_dense(attended, p["o"], 2)
    return x + maxtext_mlp(maxtext_rms_norm(x, p["post"]), p)


# Keras 3 -----------------------------------------------------------------------------
def keras_layer_norm(x, gamma, beta, eps=1e-3):
    """`keras.layers.LayerNormalization` on the JAX backend: float32, centering
    distributed over the factor."""
    y = x.astype(jnp.float32)
    mean, variance = jnp.mean(y, -1, keepdims=True), jnp.var(y, -1, keepdims=True)
    inv = lax.rsqrt(variance + eps) * gamma.astype(jnp.float32)
    return (y * inv + (-mean * inv + beta.astype(jnp.float32))).astype(x.dtype)


def keras_attention(x, p, mask):
    """`keras.layers.MultiHeadAttention`'s einsums; `Softmax` adds `(1 - mask) * -1e9`."""
    q, k, v = (jnp.einsum("abc,cde->abde", x, p[n]) + p["b" + n] for n in "qkv")
    q = jnp.multiply(q, jnp.asarray(1.0 / math.sqrt(float(HD)), q.dtype))
    scores = jnp.einsum("aecd,abcd->acbe", k, q)
    scores = scores + (1.0 - mask.astype(scores.dtype)) * -1e9
    out = jnp.einsum("acbe,aecd->abcd", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("abcd,cde->abe", out, p["o"]) + p["bo"]


KERAS = dict(g1=(D,), b1=(D,), q=(D, N, HD), bq=(N, HD), k=(D, N, HD), bk=(N, HD),
             v=(D, N, HD), bv=(N, HD), o=(N, HD, D), bo=(D,), g2=(D,), b2=(D,),
             w1=(D, F), w2=(F, D))


def keras_layer(x, p):
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    x = x + keras_attention(keras_layer_norm(x, p["g1"], p["b1"]), p, mask)
    return x + jax.nn.relu(keras_layer_norm(x, p["g2"], p["b2"]) @ p["w1"]) @ p["w2"]


# PaLM-style parallel block -----------------------------------------------------------
PALM = dict(norm=(D,), q=(D, N * HD), k=(D, HD), v=(D, HD), o=(N * HD, D),
            w_gate=(D, F), w_up=(D, F), w_down=(F, D))


def palm_layer(x, p):
    """One float32 RMSNorm feeds multi-query attention and the SwiGLU MLP, summed."""
    x32 = x.astype(jnp.float32)
    h = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + 1e-6)
    h = (h * p["norm"]).astype(x.dtype)
    q = (h @ p["q"]).reshape(B, T, N, HD)
    logits = jnp.einsum("bthd,bsd->bhts", q, h @ p["k"]) * HD**-0.5
    logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
    attended = jnp.einsum("bhts,bsd->bthd", probs, h @ p["v"]).reshape(B, T, N * HD)
    mlp = jax.nn.swish(h @ p["w_gate"]) * (h @ p["w_up"])
    return x + attended @ p["o"] + mlp @ p["w_down"]


# The loss and the step ---------------------------------------------------------------
def optax_softmax_cross_entropy(logits, labels):
    """`optax.softmax_cross_entropy` of `jax.nn.one_hot` labels."""
    log_probs = jax.nn.log_softmax(logits, -1, where=None)
    return -(jax.nn.one_hot(labels, V) * log_probs).sum(-1, where=None)


def model_loss(layer, params, head, x, labels):
    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), x, params)
    return optax_softmax_cross_entropy((x @ head).astype(jnp.float32), labels).mean()


def step_and_arguments(layer, shapes, dtype):
    params = {name: (random_normal(seed, (LAYERS, *shape))
                     / math.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(dtype)
              for seed, (name, shape) in enumerate(sorted(shapes.items()))}
    head = (random_normal(100, (D, V)) / math.sqrt(D)).astype(dtype)
    x = random_normal(101, (B, T, D), dtype)
    labels = jax.random.randint(jax.random.key(102), (B, T), 0, V)
    step = jax.value_and_grad(functools.partial(model_loss, layer), argnums=(0, 1, 2))
    return step, (params, head, x, labels)


MODELS = {
    "haiku": (haiku_layer, HAIKU, [NORM, ATTENTION, NORM, LOSS]),
    "equinox": (equinox_layer, EQUINOX, [NORM, ATTENTION, NORM, LOSS]),
    "gemma": (gemma_layer, GEMMA, [NORM, ATTENTION, NORM, NORM, GLU, NORM, LOSS]),
    "maxtext": (maxtext_layer, MAXTEXT, [NORM, ATTENTION, NORM, GLU, LOSS]),
    "maxtext_local_attention": (functools.partial(maxtext_layer,
                                                  attention=maxtext_local_attention),
                                MAXTEXT, [NORM, ATTENTION, NORM, GLU, LOSS]),
    "keras": (keras_layer, KERAS, [NORM, NORM, LOSS]),
    "palm_parallel": (palm_layer, PALM, [NORM, ATTENTION, GLU, LOSS]),
}


def rewritten_patterns(optimized, *args):
    return [m.pattern for m in optimized.plan(*args).matches if m.rewritten]


# The models CI steps through (`pytest -m slow` steps through the others): each spelling
# the others hold is also checked alone by a test below.
IN_CI = ("haiku", "maxtext", "palm_parallel")


@pytest.mark.parametrize("model", [model if model in IN_CI else
                                   pytest.param(model, marks=pytest.mark.slow)
                                   for model in MODELS])
def test_float32_steps_match_jit(rewritten, model):
    layer, shapes, patterns = MODELS[model]
    step, args = step_and_arguments(layer, shapes, jnp.float32)
    optimized = tokamax.optimize(step)
    assert rewritten_patterns(optimized, *args) == patterns
    rtol = NORMALIZED_AFTER_RTOL if model == "maxtext_local_attention" else None
    assert_steps_close(optimized(*args), jax.jit(step)(*args), rtol)


# The op normalizes the probabilities before the second product, MaxText's local
# attention after it: float32 rounds the two steps apart by about as much as each lies
# from a float64 step, more than `TOLERANCE` allows.
NORMALIZED_AFTER_RTOL = 1e-4


def assert_steps_close(actual, expected, rtol=None):
    """Loss and gradients close (within `rtol` of their scale, default float32's
    tolerance); the key bias's gradient is zero but for rounding (the softmax over the
    keys ignores a shift), so it is held to the key weight's scale."""
    rtol = rtol or TOLERANCE[jnp.dtype(jnp.float32)]
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    assert_close(loss, expected_loss, scale_rtol=rtol)
    for name, wanted in expected_grads[0].items():
        if name == "bk":
            bound = rtol * float(jnp.abs(expected_grads[0]["k"]).max())
            assert float(jnp.abs(grads[0][name] - wanted).max()) <= bound
        else:
            assert_close(grads[0][name], wanted, scale_rtol=rtol)
    for got, wanted in zip(jax.tree.leaves(grads[1:]), jax.tree.leaves(expected_grads[1:]),
                           strict=True):
        assert_close(got, wanted, scale_rtol=rtol)


@pytest.mark.variants  # MaxText's step rewrites every pattern in bfloat16: CI runs it
@pytest.mark.parametrize(("model", "patterns"), [
    ("maxtext", MODELS["maxtext"][2]),
    ("haiku", [ATTENTION, LOSS]),
    ("equinox", MODELS["equinox"][2]),
    ("gemma", [ATTENTION, GLU, LOSS]),
    ("palm_parallel", MODELS["palm_parallel"][2]),
], ids=["maxtext", "haiku", "equinox", "gemma", "palm_parallel"])
def test_bfloat16_steps_are_as_close_to_float32_as_plain_jax(rewritten, model, patterns):
    """The float32 step of the same (bfloat16-rounded) parameters is the reference:
    each rewritten gradient is within twice plain JAX's error of it, or bfloat16's
    tolerance. Haiku's and Gemma's norms take their statistics in bfloat16, which the
    op does not: they stay as written."""
    layer, shapes, _ = MODELS[model]
    step, args = step_and_arguments(layer, shapes, jnp.bfloat16)
    optimized = tokamax.optimize(step)
    assert rewritten_patterns(optimized, *args) == patterns
    reference = jax.jit(step)(*jax.tree.map(lambda a: a.astype(jnp.float32), args[:3]),
                              args[3])
    assert_as_close_as_plain(optimized(*args), jax.jit(step)(*args), reference)


def assert_as_close_as_plain(actual, plain, reference):
    """Each leaf of `actual` is within twice plain JAX's error of the float32
    `reference`, or within bfloat16's tolerance of it."""
    for got, plain_leaf, wanted in zip(*(jax.tree.leaves(r) for r in (
            actual, plain, reference)), strict=True):
        got, plain_leaf, wanted = (np.asarray(a, np.float32) for a in (got, plain_leaf, wanted))
        error, plain_error = np.abs(got - wanted).max(), np.abs(plain_leaf - wanted).max()
        tolerance = TOLERANCE[jnp.dtype(jnp.bfloat16)] * np.abs(wanted).max()
        assert error <= max(2 * plain_error, tolerance), (got.shape, error, plain_error)


@pytest.mark.parametrize("spelling", ["haiku", "per_element_epsilon"])
def test_a_mean_of_squares_broadcast_before_epsilon(rewritten, spelling):
    """Haiku's `RMSNorm` broadcasts its mean of squares to `x`'s shape before adding
    epsilon: still one value per row, the op's. An epsilon of one value per element is
    no norm and stays as written."""
    epsilon = 1e-5 if spelling == "haiku" else 1e-5 + jnp.abs(random_normal(5, (D,)))

    def f(x, scale):
        mean_squared = jnp.broadcast_to(jnp.mean(jnp.square(x), -1, keepdims=True), x.shape)
        return x * jnp.broadcast_to(scale, x.shape) * lax.rsqrt(mean_squared + epsilon)

    args = (random_normal(0, (B, T, D)), random_normal(1, (D,)))
    optimized = tokamax.optimize(f)
    assert rewritten_patterns(optimized, *args) == ([NORM] if spelling == "haiku" else [])
    cotangent = random_normal(2, (B, T, D))
    loss = jax.value_and_grad(weighted(f, cotangent), argnums=(0, 1))
    expected = jax.jit(loss)(*args)
    value, grads = jax.value_and_grad(weighted(optimized, cotangent), argnums=(0, 1))(*args)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def maxtext_masked(keep_threshold):
    """MaxText's attention of `q`, `k`, `v` with its additive causal mask read back as
    booleans by comparing with `keep_threshold` (`apply_mask_to_logits` compares
    `mask >= fill * 0.5`)."""
    def f(q, k, v):
        b, t, n, d = q.shape
        logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, KV, n // KV, d), k)
        rows = lax.broadcasted_iota(jnp.int32, (t, t), 0)
        cols = lax.broadcasted_iota(jnp.int32, (t, t), 1)
        mask = jnp.where(cols <= rows, 0.0, MAXTEXT_MASK_VALUE)[None, None, None]
        logits = jnp.where(keep_threshold(mask), logits, MAXTEXT_MASK_VALUE)
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(q.shape)
    return f


@pytest.mark.parametrize(("keep", "arguments"), [
    (lambda mask: mask >= MAXTEXT_MASK_VALUE * 0.5, (True, None, False)),
    (lambda mask: mask == 0.0, (True, None, False)),
    (lambda mask: jnp.greater(MAXTEXT_MASK_VALUE * 0.5, mask), (False, None, True)),
], ids=["half_the_fill", "equal_to_zero", "the_hidden_side"])
def test_maxtexts_additive_mask_compared_is_the_band_it_keeps(rewritten, keep, arguments):
    """The causal mask MaxText adds, compared with a number, keeps the band where the
    comparison holds; the strict upper triangle leaves the last row no key, so it is
    passed as an array (that row gets plain JAX's mean of the values)."""
    f = maxtext_masked(keep)
    args = (random_normal(0, (B, T, N, HD)), random_normal(1, (B, T, KV, HD)),
            random_normal(2, (B, T, KV, HD)))
    optimized = tokamax.optimize(f)
    assert attention_arguments(optimized, *args) == {arguments}
    assert_gradients_match_jit(f, optimized, random_normal(3, (B, T, N, HD)), (0, 1, 2),
                               args)



def optax_integer_label_loss(logits, labels, where=None, axis=-1):
    """`optax.softmax_cross_entropy_with_integer_labels` as optax 0.2.4 and later
    compute it: the label's logit picked by `take_along_axis(...).take(0, axis)`, the
    log-sum-exp taking `where`, rows `where` hides whole zeroed."""
    label_logits = jnp.take_along_axis(logits, jnp.expand_dims(labels, axis),
                                       axis=axis).take(0, axis=axis)
    out = jax.nn.logsumexp(logits, axis=axis, where=where) - label_logits
    if where is not None:
        out = jnp.where(jnp.any(where, axis), out, 0.0)
    return out


@pytest.mark.parametrize("masked", [False, True], ids=["every_logit", "where_given"])
def test_optaxs_integer_label_loss(rewritten, masked):
    """The op computes the loss of every logit; a `where=` that leaves some out (the
    op has none) stays as written."""
    def loss(x, w, labels, where):
        logits = (x @ w).astype(jnp.float32)
        return optax_integer_label_loss(logits, labels, where if masked else None).mean()

    args = (random_normal(0, (B, T, D)), random_normal(1, (D, V)),
            jax.random.randint(jax.random.key(2), (B, T), 0, V),
            jnp.arange(V) < V - 3)
    step = jax.value_and_grad(loss, argnums=(0, 1))
    optimized = tokamax.optimize(step)
    assert rewritten_patterns(optimized, *args) == ([] if masked else [LOSS])
    (value, grads), (expected_value, expected_grads) = optimized(*args), jax.jit(step)(*args)
    assert_close(value, expected_value)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert_close(actual, wanted)


def haiku_parameterless_rms_norm(x, scale=1.0, eps=1e-5):
    """`hk.RMSNorm(create_scale=False)`: `x * 1. * rsqrt(...)`."""
    mean_squared = jnp.broadcast_to(jnp.mean(jnp.square(x), -1, keepdims=True), x.shape)
    return x * scale * lax.rsqrt(mean_squared + eps)


def haiku_parameterless_layer_norm(x, scale=1.0, offset=0.0, eps=1e-5):
    """`hk.LayerNorm(create_scale=False, create_offset=False)`: `np.array(1.)` and
    `np.array(0.)` broadcast to `x`'s shape."""
    return haiku_layer_norm(x, np.array(scale, x.dtype), np.array(offset, x.dtype), eps)


@pytest.mark.parametrize(("f", "matched"), [
    (haiku_parameterless_rms_norm, True),
    (haiku_parameterless_layer_norm, True),
    (functools.partial(haiku_parameterless_rms_norm, scale=2.0), False),
    (functools.partial(haiku_parameterless_layer_norm, scale=2.0), False),
    (functools.partial(haiku_parameterless_layer_norm, offset=0.5), True),
], ids=["rms_norm", "layer_norm", "rms_norm_times_2", "layer_norm_times_2",
        "layer_norm_plus_half"])
def test_haikus_norms_without_parameters(rewritten, f, matched):
    """Ones for the scale and zeros for the offset are the op's norm without them. The
    op has no scalar scale or offset: a scale of another number in the factor leaves the
    norm as written, an offset of another number stays outside the op (the norm before
    it is matched)."""
    x = random_normal(0, (B, T, D)) + 2.0
    optimized = tokamax.optimize(f)
    assert rewritten_patterns(optimized, x) == ([NORM] if matched else [])
    cotangent = random_normal(1, (B, T, D))
    loss = jax.value_and_grad(weighted(f, cotangent))
    (value, grad), (expected_value, expected_grad) = (
        jax.value_and_grad(weighted(optimized, cotangent))(x), jax.jit(loss)(x))
    assert_close(value, expected_value)
    assert_close(grad, expected_grad)


def keras_masked_attention(fill):
    """`keras.layers.MultiHeadAttention`'s attention with a mask: `Softmax` adds
    `(1 - mask) * fill` in the logits' dtype (`-1e9`, `-3e4` in float16)."""
    def f(q, k, v, mask):
        q = jnp.multiply(q, jnp.asarray(1.0 / math.sqrt(float(HD)), q.dtype))
        scores = jnp.einsum("aecd,abcd->acbe", k, q)
        scores = scores + (1.0 - mask.astype(scores.dtype)) * fill
        return jnp.einsum("acbe,aecd->abcd", jax.nn.softmax(scores, axis=-1), v)
    return f


@pytest.mark.parametrize(("dtype", "fill"), [(jnp.float32, -1e9), (jnp.bfloat16, -1e9),
                                             (jnp.float16, -3e4), (jnp.float32, -1e6)],
                         ids=["float32", "bfloat16", "float16", "float32_below_the_floor"])
def test_a_mask_bias_that_does_not_swallow_the_logits_is_left_as_written(rewritten, dtype,
                                                                          fill):
    """Keras 3's mask bias rounds the logits it is added to (in bfloat16 and float16 by
    more than the logits' size), so an example that is all padding gets the mean of the
    values where the op's float32 sum would keep its logits; a float32 fill of `-1e6`
    keeps them nearly exact, where the op's kernels hold them at their floor."""
    f = keras_masked_attention(fill)
    args = (*(random_normal(seed, (B, T, N, HD), dtype) * 4 for seed in range(3)),
            jnp.ones((B, 1, T, T), bool).at[1].set(False))
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(*args).matches
    assert not match.rewritten and "does not swallow" in match.reason
    assert_close(optimized(*args), jax.jit(f)(*args), dtype)



def tensorflow_tutorial_attention(q, k, v, padding, factor=-1e9):
    """The TensorFlow tutorial's attention as JAX ports write it: a float padding mask
    read from the data (1 where a key is padding), `logits += mask * -1e9`."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD)
    logits = logits + padding[:, None, None, :] * factor
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize(("dtype", "factor", "matched"), [
    (jnp.float32, -1e9, False), (jnp.bfloat16, -1e9, False), (jnp.bfloat16, -0.25, True)],
    ids=["float32", "bfloat16", "bfloat16_small_factor"])
def test_a_mask_read_from_data_times_a_fill_that_rounds_is_left_as_written(
        rewritten, dtype, factor, matched):
    """A padding mask of numbers from the data times `-1e9` hides keys as Keras's does but
    is no boolean choice: the same rounding leaves it as written. A small factor is a
    bias like any other (ALiBi's slopes times distances)."""
    def f(q, k, v, padding):
        return tensorflow_tutorial_attention(q, k, v, padding, factor)

    args = (*(random_normal(seed, (B, T, N, HD), dtype) * 4 for seed in range(3)),
            jnp.zeros((B, T), dtype).at[1].set(1))
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(*args).matches
    assert match.rewritten == matched, match.reason
    if matched:
        reference = jax.jit(f)(*(a.astype(jnp.float32) for a in args))
        assert_as_close_as_plain(optimized(*args), jax.jit(f)(*args), reference)
    else:
        assert "does not swallow" in match.reason
        assert_close(optimized(*args), jax.jit(f)(*args), dtype)
