"""`optimize` on small models spelled as their reference code spells them: T5 (relative
position bias plus a padding mask bias on unscaled logits, RMSNorm with a float32
variance, gated-gelu FFN), Hugging Face's Flax GPT-2 (a fused qkv projection split in
three, a `tril` mask filled with `jnp.finfo(dtype).min`, LayerNorm with a bias, a gelu
MLP that is no gated unit, a tied LM head), Hugging Face's Flax Mistral (a sliding window
band spelled as an additive bias, grouped queries by `jnp.repeat`), DeepSeek-V2's
multi-head latent attention (value heads narrower than query and key heads), Qwen2-MoE
(top-k routing, tokens sorted by expert through `jax.lax.ragged_dot` SwiGLU experts, a
gated shared expert), Whisper's encoder-decoder (q and k each scaled by `d ** -0.25`, a
`jnp.triu(jnp.full(..., -inf), 1)` causal bias, cross-attention of 6 queries to 8 keys
padded per example) and Gemma 3 (QK-norm over each head's dim, local sliding-window layers
alternating with global ones). Each runs under `jax.value_and_grad` of an integer-label
cross-entropy loss.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: each test lists
what the spelling matches and which masks become the op's `is_causal` and
`local_window_size`, and compares the rewritten step's loss and gradients with `jax.jit`
of the same step (float32), or checks that they are as close to the float32 step as plain
JAX's (bfloat16). The spellings these models brought out are tested one by one below:
T5's mask bias added after its position bias, band masks spelled as additive biases,
causal masks sliced from longer ones (nanoGPT, Hugging Face's Flax models), constant
masks made with NumPy, and the reason given for a data mask times `finfo.min`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tokamax_pass as tokamax
from _rewriting import assert_gradients_match_jit, weighted
from conftest import assert_close, random_normal
from test_rewrite_library_spellings import assert_as_close_as_plain, rewritten_patterns

B, T, D, N, KV, HD, F, V, LAYERS = 2, 8, 32, 4, 2, 8, 48, 64, 2
WINDOW = 3
NORM, ATTENTION, GLU, LOSS, RAGGED = ("layer_norm", "attention", "gated_linear_unit",
                                      "linear_softmax_cross_entropy_loss", "ragged_dot")
CAUSAL, UNMASKED = (True, None, False, False), (False, None, False, False)


def integer_label_loss(logits, labels):
    """The mean of `logsumexp(logits) - logits[label]`, in float32."""
    logits = logits.astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits, -1) - label_logits).mean()


def rope(x, positions, base=10000.0):
    """Rotary embedding of `x`'s last axis, halves rotated (Llama's `rotate_half`)."""
    half = x.shape[-1] // 2
    angles = positions[..., None] / base ** (jnp.arange(half, dtype=jnp.float32) / half)
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def swiglu(x, p, gate="gate", up="up", down="down"):
    return (jax.nn.silu(x @ p[gate]) * (x @ p[up])) @ p[down]


def float32_rms_norm(x, weight, eps=1e-6):
    """Hugging Face's Llama/Mistral `RMSNorm`: the mean of squares in float32, `x * 1 /
    sqrt(...)`, the weight applied after casting back."""
    variance = jnp.power(x.astype(jnp.float32), 2).mean(-1, keepdims=True)
    x = x * (1 / jnp.sqrt(variance + eps))
    return weight * x.astype(weight.dtype)


def layer_norm(x, scale, bias, eps=1e-5):
    mean, variance = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
    return (x - mean) * lax.rsqrt(variance + eps) * scale + bias


def flax_mask_bias(mask, dtype):
    """Hugging Face's Flax models' bias of a mask: `lax.select(mask > 0, 0, finfo.min)`."""
    return lax.select(mask > 0, jnp.full(mask.shape, 0.0).astype(dtype),
                      jnp.full(mask.shape, jnp.finfo(dtype).min).astype(dtype))


# T5 ----------------------------------------------------------------------------------
BUCKETS, MAX_DISTANCE = 8, 16


def t5_layer_norm(x, weight, eps=1e-6):
    """`FlaxT5LayerNorm`: no mean subtracted, the variance of the float32 input."""
    variance = jnp.power(x.astype("f4"), 2).mean(axis=-1, keepdims=True)
    return weight * (x / jnp.sqrt(variance + eps))


def t5_relative_position_bucket(relative_position):
    """T5's bidirectional buckets: exact for small distances, logarithmic beyond."""
    num_buckets = BUCKETS // 2
    buckets = (relative_position > 0) * num_buckets
    relative_position = jnp.abs(relative_position)
    max_exact = num_buckets // 2
    large = max_exact + (jnp.log(relative_position / max_exact)
                         / jnp.log(MAX_DISTANCE / max_exact) * (num_buckets - max_exact))
    large = jnp.clip(large, max=num_buckets - 1)
    return (buckets + jnp.where(relative_position < max_exact, relative_position,
                                large)).astype("i4")


def t5_position_bias(embedding):
    """`(1, heads, T, T)`: each head's learned bias of each bucket of `key - query`."""
    relative = jnp.arange(T, dtype="i4")[None, :] - jnp.arange(T, dtype="i4")[:, None]
    return embedding[t5_relative_position_bucket(relative)].transpose((2, 0, 1))[None]


def t5_attention(x, p, padding, mask_bias_added_last):
    """Unscaled logits plus the position bias and the padding mask's bias, the softmax in
    float32 (`FlaxT5Attention`); `mask_bias_added_last`: `logits + position_bias +
    mask_bias`, else the biases summed first."""
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[n]) for n in ("q", "k", "v"))
    mask_bias = flax_mask_bias(jnp.expand_dims(padding, axis=(-3, -2)), x.dtype)
    position_bias = t5_position_bias(p["relative"])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if mask_bias_added_last:
        logits = logits + position_bias + mask_bias
    else:
        logits = logits + (position_bias + mask_bias)
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
    return jnp.einsum("bthk,hkd->btd", jnp.einsum("bhqk,bkhd->bqhd", weights, v), p["o"])


def t5_gated_gelu(x, p):
    """`FlaxT5DenseGatedActDense`: `gelu_new(wi_0 x) * wi_1 x`, then `wo`."""
    return (jax.nn.gelu(x @ p["wi_0"], approximate=True) * (x @ p["wi_1"])) @ p["wo"]


T5 = dict(ln1=(D,), q=(D, N, HD), k=(D, N, HD), v=(D, N, HD), o=(N, HD, D),
          relative=(BUCKETS, N), ln2=(D,), wi_0=(D, F), wi_1=(D, F), wo=(F, D))


def t5_loss(params, head, x, padding, labels, mask_bias_added_last=True):
    def layer(x, p):
        p = dict(p, q=p["q"] * HD**-0.5)  # T5's query initialization: its logits unscaled
        h = t5_layer_norm(x, p["ln1"])
        x = x + t5_attention(h, p, padding, mask_bias_added_last)
        return x + t5_gated_gelu(t5_layer_norm(x, p["ln2"]), p)
    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), x, params)
    return integer_label_loss(x @ head, labels)


# GPT-2 (Hugging Face Flax) -----------------------------------------------------------
def gpt2_attention(x, p):
    """`FlaxGPT2Attention`'s fused `c_attn` split in three; PyTorch GPT-2's mask, `tril`
    of booleans with a `jnp.finfo(dtype).min` fill through `jnp.where`."""
    q, k, v = jnp.split(x @ p["c_attn"] + p["c_attn_b"], 3, axis=2)
    q, k, v = (a.reshape(*a.shape[:2], N, HD) for a in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HD).astype(x.dtype)
    causal = jnp.tril(jnp.ones((T, T), dtype="bool"))[None, None]
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(x.shape)
    return out @ p["c_proj"] + p["c_proj_b"]


def gpt2_mlp(x, p):
    """`gelu_new(c_fc x) @ c_proj`: one projection activated, no gated unit."""
    hidden = jax.nn.gelu(x @ p["c_fc"] + p["c_fc_b"], approximate=True)
    return hidden @ p["mlp_proj"] + p["mlp_proj_b"]


GPT2 = dict(ln1=(D,), ln1_b=(D,), c_attn=(D, 3 * D), c_attn_b=(3 * D,), c_proj=(D, D),
            c_proj_b=(D,), ln2=(D,), ln2_b=(D,), c_fc=(D, F), c_fc_b=(F,),
            mlp_proj=(F, D), mlp_proj_b=(D,))


def gpt2_loss(params, wte, wpe, final_norm, tokens):
    """Token and position embeddings in, the tied embedding as the LM head, the logits
    shifted against the next tokens."""
    def layer(x, p):
        x = x + gpt2_attention(layer_norm(x, p["ln1"], p["ln1_b"]), p)
        return x + gpt2_mlp(layer_norm(x, p["ln2"], p["ln2_b"]), p)
    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), wte[tokens] + wpe[None], params)
    x = layer_norm(x, final_norm[0], final_norm[1])
    return integer_label_loss((x @ wte.T)[:, :-1], tokens[:, 1:])


# Mistral (Hugging Face Flax) ---------------------------------------------------------
def mistral_attention(x, p):
    """`FlaxMistralAttention`: RoPE, k and v repeated to the query heads, the sliding
    window `jnp.triu(jnp.tril(ones), -window)` turned into a bias, q scaled."""
    positions = jnp.arange(T)[None]
    q = rope((x @ p["q"]).reshape(B, T, N, HD), positions)
    k = rope((x @ p["k"]).reshape(B, T, KV, HD), positions)
    v = (x @ p["v"]).reshape(B, T, KV, HD)
    k, v = jnp.repeat(k, N // KV, axis=2), jnp.repeat(v, N // KV, axis=2)
    window = jnp.triu(jnp.tril(jnp.ones((T, T), "bool")), k=-WINDOW)[None, None]
    q = q / jnp.sqrt(HD).astype(x.dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) + flax_mask_bias(window, x.dtype)
    weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(x.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(B, T, N * HD) @ p["o"]


MISTRAL = dict(ln1=(D,), q=(D, N * HD), k=(D, KV * HD), v=(D, KV * HD), o=(N * HD, D),
               ln2=(D,), gate=(D, F), up=(D, F), down=(F, D))


def mistral_layer(x, p):
    x = x + mistral_attention(float32_rms_norm(x, p["ln1"]), p)
    return x + swiglu(float32_rms_norm(x, p["ln2"]), p)


def decoder_loss(layer, params, head, x, labels):
    x, _ = lax.scan(lambda carry, p: (layer(carry, p), None), x, params)
    return integer_label_loss(x @ head, labels)


# DeepSeek-V2 multi-head latent attention ---------------------------------------------
NOPE, ROPE, VALUE, LATENT = 8, 4, 8, 16
QK = NOPE + ROPE


def deepseek_attention(x, p):
    """Query and key heads of `NOPE + ROPE = 12`, value heads of 8: keys and values
    decompressed from a normed latent, one RoPE key shared by every head."""
    positions = jnp.arange(T)[None]
    q = (x @ p["q"]).reshape(B, T, N, QK)
    compressed = x @ p["kv_a"]
    latent, k_rope = compressed[..., :LATENT], compressed[..., LATENT:]
    kv = (float32_rms_norm(latent, p["kv_norm"]) @ p["kv_b"]).reshape(B, T, N, NOPE + VALUE)
    k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
    q = jnp.concatenate([q[..., :NOPE], rope(q[..., NOPE:], positions)], -1)
    k_rope = jnp.broadcast_to(rope(k_rope.reshape(B, T, 1, ROPE), positions), (B, T, N, ROPE))
    k = jnp.concatenate([k_nope, k_rope], -1)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * QK**-0.5
    logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
    weights = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(x.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, N * VALUE) @ p["o"]


DEEPSEEK = dict(ln1=(D,), q=(D, N * QK), kv_a=(D, LATENT + ROPE), kv_norm=(LATENT,),
                kv_b=(LATENT, N * (NOPE + VALUE)), o=(N * VALUE, D), ln2=(D,), gate=(D, F),
                up=(D, F), down=(F, D))


def deepseek_layer(x, p):
    x = x + deepseek_attention(float32_rms_norm(x, p["ln1"]), p)
    return x + swiglu(float32_rms_norm(x, p["ln2"]), p)


# Qwen2-MoE ---------------------------------------------------------------------------
EXPERTS, TOP_K, EXPERT_F = 4, 2, 16


def qwen_attention(x, p):
    """Biased q, k, v projections, RoPE, grouped queries by reshape."""
    positions = jnp.arange(T)[None]
    q = rope((x @ p["q"] + p["bq"]).reshape(B, T, N, HD), positions)
    k = rope((x @ p["k"] + p["bk"]).reshape(B, T, KV, HD), positions)
    v = (x @ p["v"] + p["bv"]).reshape(B, T, KV, HD)
    logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, T, KV, N // KV, HD), k)
    logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits / math.sqrt(HD),
                       jnp.finfo(jnp.float32).min)
    attended = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, -1), v)
    return attended.reshape(B, T, N * HD) @ p["o"]


def qwen_moe(x, p):
    """`Qwen2MoeSparseMoeBlock`: a softmax router's top-k, the token copies sorted by
    expert through ragged SwiGLU experts and put back, plus a sigmoid-gated shared
    expert."""
    tokens = x.reshape(-1, D)
    router = jax.nn.softmax((tokens @ p["router"]).astype(jnp.float32), -1)
    weights, experts = lax.top_k(router, TOP_K)
    order = jnp.argsort(experts.reshape(-1))
    sorted_tokens = tokens[order // TOP_K]
    sizes = jnp.bincount(experts.reshape(-1), length=EXPERTS).astype(jnp.int32)
    hidden = (jax.nn.silu(lax.ragged_dot(sorted_tokens, p["e_gate"], sizes))
              * lax.ragged_dot(sorted_tokens, p["e_up"], sizes))
    out = lax.ragged_dot(hidden, p["e_down"], sizes)
    routed = jnp.zeros_like(out).at[order].set(out).reshape(-1, TOP_K, D)
    routed = jnp.einsum("tkd,tk->td", routed, weights.astype(x.dtype))
    shared = jax.nn.sigmoid(tokens @ p["shared_gate"]) * swiglu(
        tokens, p, "s_gate", "s_up", "s_down")
    return (routed + shared).reshape(x.shape)


QWEN = dict(ln1=(D,), q=(D, N * HD), bq=(N * HD,), k=(D, KV * HD), bk=(KV * HD,),
            v=(D, KV * HD), bv=(KV * HD,), o=(N * HD, D), ln2=(D,), router=(D, EXPERTS),
            e_gate=(EXPERTS, D, EXPERT_F), e_up=(EXPERTS, D, EXPERT_F),
            e_down=(EXPERTS, EXPERT_F, D), s_gate=(D, F), s_up=(D, F), s_down=(F, D),
            shared_gate=(D, 1))


def qwen_layer(x, p):
    x = x + qwen_attention(float32_rms_norm(x, p["ln1"]), p)
    return x + qwen_moe(float32_rms_norm(x, p["ln2"]), p)


# Whisper -----------------------------------------------------------------------------
DECODED = 6


def whisper_attention(x, source, p, prefix, padding=None, causal=False):
    """OpenAI Whisper's `MultiHeadAttention`: q and k each scaled by `d ** -0.25`, no key
    bias, a causal `jnp.triu(jnp.full(..., -inf), 1)` added, padded keys hidden."""
    scale = HD**-0.25
    rows, keys = x.shape[1], source.shape[1]
    q = (x @ p[prefix + "q"] + p[prefix + "bq"]).reshape(B, rows, N, HD) * scale
    k = (source @ p[prefix + "k"]).reshape(B, keys, N, HD) * scale
    v = (source @ p[prefix + "v"] + p[prefix + "bv"]).reshape(B, keys, N, HD)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if causal:
        logits = logits + jnp.triu(jnp.full((rows, keys), -jnp.inf), 1)
    if padding is not None:
        logits = jnp.where(padding[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(x.dtype)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return attended.reshape(B, rows, N * HD) @ p[prefix + "o"]


def whisper_attention_shapes(prefix):
    return {prefix + "q": (D, N * HD), prefix + "bq": (N * HD,), prefix + "k": (D, N * HD),
            prefix + "v": (D, N * HD), prefix + "bv": (N * HD,), prefix + "o": (N * HD, D)}


def whisper_mlp(x, p):
    return jax.nn.gelu(x @ p["fc1"] + p["fc1_b"], approximate=False) @ p["fc2"] + p["fc2_b"]


WHISPER_ENCODER = dict(ln1=(D,), ln1_b=(D,), **whisper_attention_shapes("self_"), ln2=(D,),
                       ln2_b=(D,), fc1=(D, F), fc1_b=(F,), fc2=(F, D), fc2_b=(D,))
WHISPER_DECODER = dict(WHISPER_ENCODER, **whisper_attention_shapes("cross_"), ln_cross=(D,),
                       ln_cross_b=(D,))


def whisper_encoder_layer(x, p, padding):
    h = layer_norm(x, p["ln1"], p["ln1_b"])
    x = x + whisper_attention(h, h, p, "self_", padding=padding)
    return x + whisper_mlp(layer_norm(x, p["ln2"], p["ln2_b"]), p)


def whisper_decoder_layer(y, p, memory, padding):
    h = layer_norm(y, p["ln1"], p["ln1_b"])
    y = y + whisper_attention(h, h, p, "self_", causal=True)
    h = layer_norm(y, p["ln_cross"], p["ln_cross_b"])
    y = y + whisper_attention(h, memory, p, "cross_", padding=padding)
    return y + whisper_mlp(layer_norm(y, p["ln2"], p["ln2_b"]), p)


def whisper_loss(params, head, x, y, padding, labels):
    """The encoder over `x` (keys padded per example), the decoder over `y` attending to
    it: 6 queries to 8 keys, the padding hiding keys only."""
    x, _ = lax.scan(lambda c, p: (whisper_encoder_layer(c, p, padding), None), x,
                    params["encoder"])
    y, _ = lax.scan(lambda c, p: (whisper_decoder_layer(c, p, x, padding), None), y,
                    params["decoder"])
    return integer_label_loss(y @ head, labels)


# Gemma 3 -----------------------------------------------------------------------------
def gemma_rms_norm(x, scale):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = jnp.asarray(x * lax.rsqrt(var + 1e-06))
    return normed_inputs * (1 + jnp.expand_dims(scale, axis=range(len(x.shape) - 1)))


def gemma3_sliding_mask(segment_pos):
    """`_create_sliding_mask`: keys within the window of each query's position."""
    cache_positions = jnp.arange(T)
    sliding_mask = cache_positions > segment_pos[:, :, None] - WINDOW
    sliding_mask *= cache_positions < segment_pos[:, :, None] + WINDOW
    return sliding_mask


def gemma3_attention(x, p, local):
    """Gemma 3's `Attention`: q and k normed over each head's dim (QK-norm) before RoPE,
    grouped queries by reshape, a sliding window on local layers."""
    segment_pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    query = jnp.einsum("BTD,NDH->BTNH", x, p["q"])
    key, value = jnp.einsum("BSD,CKDH->CBSKH", x, p["kv"])
    query = rope(gemma_rms_norm(query, p["q_norm"]), segment_pos) * HD**-0.5
    key = rope(gemma_rms_norm(key, p["k_norm"]), segment_pos)
    b, t, kg, h = query.shape
    query = query.reshape((b, t, KV, kg // KV, h))
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", query, key).reshape((b, t, N, -1))
    attn_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    if local:
        attn_mask *= gemma3_sliding_mask(segment_pos)
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, -2.3819763e38)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(key.dtype)
    probs = probs.reshape((b, t, KV, N // KV, -1))
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value).reshape((b, t, N, h))
    return jnp.einsum("BTNH,NHD->BTD", encoded, p["o"])


def gemma3_feed_forward(x, p):
    gate = jnp.einsum("...F,NHF->...NH", x, p["gating"])
    return jnp.einsum("...H,HF->...F", jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :],
                      p["linear"])


GEMMA3 = dict(pre_attn=(D,), q=(N, D, HD), kv=(2, KV, D, HD), q_norm=(HD,), k_norm=(HD,),
              o=(N, HD, D), post_attn=(D,), pre_ffw=(D,), gating=(2, F, D), linear=(F, D),
              post_ffw=(D,))


def gemma3_loss(params, head, x, labels):
    """A local layer then a global one (Gemma 3 alternates five to one)."""
    for index in range(LAYERS):
        p = jax.tree.map(lambda a, i=index: a[i], params)
        attended = gemma3_attention(gemma_rms_norm(x, p["pre_attn"]), p, local=index % 2 == 0)
        x = x + gemma_rms_norm(attended, p["post_attn"])
        fed = gemma3_feed_forward(gemma_rms_norm(x, p["pre_ffw"]), p)
        x = x + gemma_rms_norm(fed, p["post_ffw"])
    return integer_label_loss(x @ head, labels)


# The steps ---------------------------------------------------------------------------
def layered(shapes, dtype, seed=0):
    """`LAYERS` stacked random parameters of each shape, scaled by their fan-in."""
    return {name: (random_normal(seed + i, (LAYERS, *shape))
                   / math.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(dtype)
            for i, (name, shape) in enumerate(sorted(shapes.items()))}


def labels_of(seed, shape=(B, T)):
    return jax.random.randint(jax.random.key(seed), shape, 0, V)


def padding_of(dtype):
    """Keys kept per example: the second example's last three are padding."""
    return (jnp.arange(T)[None] < jnp.array([[T], [T - 3]])).astype(dtype)


def head_of(dtype):
    return (random_normal(100, (D, V)) / math.sqrt(D)).astype(dtype)


def decoder_arguments(shapes):
    return lambda dtype: (layered(shapes, dtype), head_of(dtype),
                          random_normal(101, (B, T, D), dtype), labels_of(102))


def t5_arguments(dtype):
    return (layered(T5, dtype), head_of(dtype), random_normal(101, (B, T, D), dtype),
            padding_of(jnp.int32), labels_of(102))


def gpt2_arguments(dtype):
    return (layered(GPT2, dtype), (random_normal(1, (V, D)) * 0.3).astype(dtype),
            (random_normal(2, (T, D)) * 0.3).astype(dtype),
            (1 + 0.1 * random_normal(3, (2, D))).astype(dtype), labels_of(4))


def whisper_arguments(dtype):
    params = {"encoder": layered(WHISPER_ENCODER, dtype),
              "decoder": layered(WHISPER_DECODER, dtype, seed=50)}
    return (params, head_of(dtype), random_normal(101, (B, T, D), dtype),
            random_normal(103, (B, DECODED, D), dtype), padding_of(bool),
            labels_of(102, (B, DECODED)))


@dataclasses.dataclass(frozen=True)
class Model:
    """A loss of `(params, head, x, *data)` and what its step matches: the patterns
    rewritten, in plan order, and `(is_causal, local_window_size, mask array passed,
    bias passed)` of each attention call."""

    loss: Callable
    arguments: Callable  # dtype -> the loss's arguments
    patterns: list[str]
    attention: set[tuple]


PADDED, BIASED_AND_PADDED = (False, None, True, False), (False, None, True, True)
GEMMA3_LAYER = [NORM, NORM, NORM, ATTENTION, NORM, NORM, GLU, NORM]
MODELS = {
    "t5": Model(t5_loss, t5_arguments, [NORM, ATTENTION, NORM, GLU, LOSS],
                {BIASED_AND_PADDED}),
    "t5_biases_summed_first": Model(functools.partial(t5_loss, mask_bias_added_last=False),
                                    t5_arguments, [NORM, ATTENTION, NORM, GLU, LOSS],
                                    {BIASED_AND_PADDED}),
    "gpt2": Model(gpt2_loss, gpt2_arguments, [NORM, ATTENTION, NORM, NORM, LOSS], {CAUSAL}),
    "mistral": Model(functools.partial(decoder_loss, mistral_layer), decoder_arguments(MISTRAL),
                     [NORM, ATTENTION, NORM, GLU, LOSS], {(True, (WINDOW, 0), False, False)}),
    "deepseek_v2": Model(functools.partial(decoder_loss, deepseek_layer),
                         decoder_arguments(DEEPSEEK),
                         [NORM, NORM, ATTENTION, NORM, GLU, LOSS], {CAUSAL}),
    "qwen2_moe": Model(functools.partial(decoder_loss, qwen_layer), decoder_arguments(QWEN),
                       [NORM, ATTENTION, NORM, GLU, GLU, LOSS, RAGGED, RAGGED, RAGGED],
                       {CAUSAL}),
    "whisper": Model(whisper_loss, whisper_arguments,
                     [NORM, ATTENTION, NORM, NORM, ATTENTION, NORM, ATTENTION, NORM, LOSS],
                     {PADDED, CAUSAL}),
    "gemma3": Model(gemma3_loss, decoder_arguments(GEMMA3), [*GEMMA3_LAYER * LAYERS, LOSS],
                    {CAUSAL, (True, (WINDOW - 1, 0), False, False)}),
}


def attention_calls(optimized, *args):
    """`(is_causal, local_window_size, mask array passed, bias passed)` of each attention
    call the optimized program plans (forward and gradient alike)."""
    found = set()
    for row in optimized.plan(*args):
        arguments = row.bound["arguments"]
        if "local_window_size" in arguments:
            window = arguments["local_window_size"]
            found.add((arguments["is_causal"], None if window is None else tuple(window),
                       arguments["mask"] is not None, arguments["bias"] is not None))
    return found


def assert_attention_calls_match_jit(f, arguments, args=None):
    """`f` through `optimize` plans attention with `arguments` alone (`attention_calls`),
    and its values and gradients at `args` (default: three random (B, T, N, HD) arrays)
    match `jax.jit`'s under a random cotangent."""
    if args is None:
        args = tuple(random_normal(seed, (B, T, N, HD)) for seed in range(3))
    optimized = tokamax.optimize(f)
    assert attention_calls(optimized, *args) == {arguments}
    assert_gradients_match_jit(f, optimized, random_normal(3, (B, T, N, HD)), (0, 1, 2),
                               args)


def step_and_arguments(model, dtype):
    return (jax.value_and_grad(model.loss, argnums=(0, 1, 2)), model.arguments(dtype))


# The models CI steps through (`pytest -m slow` steps through the others): each spelling
# the others hold is also checked alone by a test below.
IN_CI = ("deepseek_v2",)


@pytest.mark.parametrize("name", [name if name in IN_CI else
                                  pytest.param(name, marks=pytest.mark.slow)
                                  for name in MODELS])
def test_float32_steps_match_jit(rewritten, name):
    model = MODELS[name]
    step, args = step_and_arguments(model, jnp.float32)
    optimized = tokamax.optimize(step)
    assert rewritten_patterns(optimized, *args) == model.patterns
    assert attention_calls(optimized, *args) == model.attention
    (loss, grads), (expected_loss, expected_grads) = optimized(*args), jax.jit(step)(*args)
    assert_close(loss, expected_loss)
    for actual, wanted in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads),
                              strict=True):
        assert_close(actual, wanted)


@pytest.mark.slow  # bfloat16 rewrites are checked pattern by pattern in CI
@pytest.mark.parametrize(("name", "patterns"), [
    ("mistral", MODELS["mistral"].patterns),
    ("gpt2", [ATTENTION, LOSS]),
    ("deepseek_v2", MODELS["deepseek_v2"].patterns),
])
def test_bfloat16_steps_are_as_close_to_float32_as_plain_jax(rewritten, name, patterns):
    """The float32 step of the same (bfloat16-rounded) arguments is the reference. GPT-2's
    LayerNorm takes its statistics in bfloat16, which the op does not: it stays as
    written. Whisper's and Gemma 3's bfloat16 steps of these sizes are off the float32 one
    by several percent in every gradient, plain JAX's as much as the rewritten one's: too
    noisy to compare; T5's norm returns float32 and Qwen2-MoE's routing picks other
    experts."""
    step, args = step_and_arguments(MODELS[name], jnp.bfloat16)
    optimized = tokamax.optimize(step)
    assert rewritten_patterns(optimized, *args) == patterns
    reference = jax.jit(step)(*jax.tree.map(
        lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, args))
    assert_as_close_as_plain(optimized(*args), jax.jit(step)(*args), reference)


def t5_biased_attention(spelling):
    """Attention of unscaled logits, T5's position bias and a padding mask's bias added as
    `spelling` says; `-1e9`: the mask bias filled with `-1e9`, added last."""
    def f(q, k, v, position_bias, padding):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        mask = jnp.expand_dims(padding, axis=(-3, -2))
        mask_bias = (jnp.where(mask > 0, 0.0, -1e9) if spelling == "fill_-1e9"
                     else flax_mask_bias(mask, q.dtype))
        if spelling == "mask_bias_first":
            logits = logits + mask_bias + position_bias
        elif spelling == "biases_summed_first":
            logits = logits + (position_bias + mask_bias)
        else:
            logits = logits + position_bias + mask_bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return f


@pytest.mark.parametrize("spelling", ["mask_bias_last", "mask_bias_first",
                                      "biases_summed_first", "fill_-1e9"])
def test_t5s_mask_bias_added_beside_its_position_bias(rewritten, spelling):
    """`logits + position_bias + mask_bias` (in either order) is the op's attention with
    the position bias and the mask, as `logits + (position_bias + mask_bias)` is: the fill
    swallows whichever bias it meets. The second example's keys are all padding, so its
    rows get plain JAX's mean of the values and autodiff's gradient through the logits
    the sum rounded away. A fill of `-1e9`, which does not swallow the logits, stays as
    written."""
    f = t5_biased_attention(spelling)
    args = (*(random_normal(seed, (B, T, N, HD)) for seed in range(3)),
            random_normal(3, (1, N, T, T)), jnp.ones((B, T), jnp.int32).at[1].set(0))
    optimized = tokamax.optimize(f)
    (match,) = optimized.plan(*args).matches
    if spelling == "fill_-1e9":
        assert not match.rewritten and "does not swallow" in match.reason
    else:
        assert match.rewritten, match.reason
        assert attention_calls(optimized, *args) == {BIASED_AND_PADDED}
    cotangent = random_normal(4, (B, T, N, HD))
    loss = jax.value_and_grad(weighted(f, cotangent), argnums=(0, 1, 2, 3))
    expected = jax.jit(loss)(*args)
    value, grads = jax.value_and_grad(weighted(optimized, cotangent),
                                      argnums=(0, 1, 2, 3))(*args)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def flax_window_bias(dtype):
    return flax_mask_bias(jnp.triu(jnp.tril(jnp.ones((T, T), "bool")), k=-WINDOW), dtype)


MASK_BIASES = {
    "flax_causal": (lambda dtype: flax_mask_bias(jnp.tril(jnp.ones((T, T), "bool")), dtype),
                    CAUSAL),
    "flax_sliding_window": (flax_window_bias, (True, (WINDOW, 0), False, False)),
    "where_minus_inf": (lambda dtype: jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0,
                                                -jnp.inf), CAUSAL),
    "whisper_triu": (lambda dtype: jnp.triu(jnp.full((T, T), -jnp.inf), 1), CAUSAL),
    "triu_cast_from_bfloat16": (lambda dtype: jnp.triu(
        jnp.full((T, T), -jnp.inf, jnp.bfloat16), 1).astype(dtype), CAUSAL),
    "fill_rounded_by_a_cast": (lambda dtype: jnp.triu(
        jnp.full((T, T), -1e30), 1).astype(jnp.bfloat16).astype(dtype), PADDED),
    "mistral_reference_log": (
        lambda dtype: jnp.log(jnp.triu(jnp.tril(jnp.ones((T, T), dtype)), -WINDOW)),
        (True, (WINDOW, 0), False, False)),
    "triu_hiding_the_first_row": (
        lambda dtype: jnp.triu(jnp.full((T, T), jnp.finfo(dtype).min), 0), PADDED),
}


@pytest.mark.parametrize("spelling", MASK_BIASES)
def test_a_band_spelled_as_a_bias_is_the_ops_band(rewritten, spelling):
    """A mask bias of a band, Hugging Face Flax's `lax.select(mask > 0, 0, finfo.min)` of
    a causal or sliding-window mask, `jnp.where(causal, 0.0, -inf)`, Whisper's
    `jnp.triu(jnp.full((t, t), -inf), 1)` (also made in bfloat16 and cast to float32:
    0 and `-inf` are exact in both) or Mistral's reference `jnp.log` of a band of
    float ones, becomes `is_causal` and `local_window_size`:
    every row keeps a key, so no row takes the hidden rows' gradient. One that hides the
    first row whole is passed as an array (that row gets the mean of the values), as is
    one whose fill a cast rounds (`-1e30` to bfloat16): no band is read through it."""
    bias_of, arguments = MASK_BIASES[spelling]

    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD) + bias_of(q.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)

    assert_attention_calls_match_jit(f, arguments)


MAX_POSITIONS = 16


def make_causal_mask(x):
    """`flax.linen.make_causal_mask`: positions compared, of the longest sequence."""
    idxs = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    mask = jnp.greater_equal(jnp.expand_dims(idxs, -1), jnp.expand_dims(idxs, -2))
    return jnp.expand_dims(mask, axis=-3).astype(bool)


def hugging_face_flax_logits(q, k):
    """`FlaxGPT2Attention` without padding: its causal mask of `max_position_embeddings`
    sliced to the sequence, combined with the all-ones attention mask it makes, turned
    into a bias."""
    causal = make_causal_mask(jnp.ones((1, MAX_POSITIONS), dtype="bool"))[:, :, :T, :T]
    attention_mask = jnp.broadcast_to(jnp.expand_dims(jnp.ones((B, T)), axis=(-3, -2)),
                                      (B, 1, T, T))
    bias = flax_mask_bias(jnp.logical_and(attention_mask, causal), q.dtype)
    return jnp.einsum("...qhd,...khd->...hqk", q / jnp.sqrt(HD).astype(q.dtype), k) + bias


def nanogpt_logits(q, k, rows=slice(0, T)):
    """nanoGPT's `att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)` of a causal
    buffer of `block_size` (`rows`: the buffer's rows taken)."""
    buffer = jnp.tril(jnp.ones((MAX_POSITIONS, MAX_POSITIONS)))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD)
    return jnp.where(buffer[rows, :T] == 0, -jnp.inf, logits)


@pytest.mark.parametrize(("logits", "arguments"), [
    (hugging_face_flax_logits, CAUSAL),
    (nanogpt_logits, CAUSAL),
    (functools.partial(nanogpt_logits, rows=slice(2, 2 + T)),
     (False, (2 * T, 2), False, False)),  # no left bound: as many keys as rows and keys
], ids=["hugging_face_flax", "nanogpt", "nanogpt_rows_offset"])
def test_a_causal_mask_sliced_from_a_longer_one_is_the_ops_band(rewritten, logits, arguments):
    """A causal mask made for the longest sequence and sliced to this one is the band the
    slice keeps: the causal band where rows and keys start together, the band shifted
    where the rows start later (row `i` of `buffer[2:2 + t]` keeps keys up to `i + 2`)."""
    def f(q, k, v):
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits(q, k), axis=-1), v)

    assert_attention_calls_match_jit(f, arguments)


def pytorch_port_padded_attention(q, k, v, padding):
    """Hugging Face's PyTorch models ported to JAX: the integer padding mask cast to the
    logits' dtype, `(1.0 - mask) * jnp.finfo(dtype).min`, added to the logits."""
    mask = padding[:, None, None, :].astype(q.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD)
    logits = logits + (1.0 - mask) * jnp.finfo(q.dtype).min
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def test_a_mask_read_from_the_data_times_finfo_min_is_left_alone_as_no_boolean(rewritten):
    """`(1.0 - mask) * finfo.min` of a mask cast from integers swallows the logits where
    the mask is 0, but other values of it (2, -1) are no mask: it stays as written, its
    reason saying so rather than that it does not swallow the logits."""
    args = (*(random_normal(seed, (B, T, N, HD)) for seed in range(3)), padding_of(jnp.int32))
    optimized = tokamax.optimize(pytorch_port_padded_attention)
    (match,) = optimized.plan(*args).matches
    assert not match.rewritten
    assert "not a boolean choice" in match.reason and "does not swallow" not in match.reason
    assert_close(optimized(*args), jax.jit(pytorch_port_padded_attention)(*args))


CAUSAL_BUFFER = jnp.tril(jnp.ones((MAX_POSITIONS, MAX_POSITIONS)))  # made before tracing
NO_BAND = np.random.default_rng(0).random((T, T)) < 0.5
CONSTANT_MASKS = {
    "numpy_causal": (np.tril(np.ones((T, T), bool)), CAUSAL),
    "numpy_sliding_window": (np.triu(np.tril(np.ones((T, T))), -WINDOW) != 0,
                             (True, (WINDOW, 0), False, False)),
    "buffer_sliced": (CAUSAL_BUFFER[:T, :T] != 0, CAUSAL),
    "numpy_no_band": (NO_BAND | np.eye(T, dtype=bool), PADDED),
    "numpy_first_row_hidden": (np.tril(np.ones((T, T), bool), -1), PADDED),
}


def masked_by(mask):
    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HD)
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return f


@pytest.mark.parametrize("spelling", CONSTANT_MASKS)
def test_a_constant_mask_is_the_band_it_keeps(rewritten, spelling):
    """A mask the function closes over, made with NumPy or computed before tracing, is
    read from its values: one band of key offsets that gives every row a key becomes
    `is_causal` and `local_window_size`; any other constant (no band, or the strict lower
    triangle that hides the first row) is passed as an array."""
    mask, arguments = CONSTANT_MASKS[spelling]
    f = masked_by(mask)
    assert_attention_calls_match_jit(f, arguments)


def scanned_layers(mask, wrap):
    """`LAYERS` attention layers in `lax.scan`, each masked by `mask`: closed over by the
    body (`"scan"`), by a `jax.checkpoint` body inside it (`"checkpointed_scan"`), or
    one layer's slice of masks scanned over (`"scanned_over"`)."""
    def layers(q, k, v):
        if wrap == "scanned_over":
            stacked = np.stack([mask] * LAYERS)
            return lax.scan(lambda carry, m: (masked_by(m)(carry, k, v), None), q,
                            stacked)[0]
        layer = masked_by(mask)
        layer = jax.checkpoint(layer) if wrap == "checkpointed_scan" else layer
        return lax.scan(lambda carry, _: (layer(carry, k, v), None), q, None,
                        length=LAYERS)[0]
    return layers


@pytest.mark.parametrize(("wrap", "arguments"), [
    ("scan", CAUSAL),
    pytest.param("checkpointed_scan", CAUSAL, marks=pytest.mark.slow),
    ("scanned_over", PADDED),
], ids=["scan", "checkpointed_scan", "scanned_over"])
def test_a_constant_mask_inside_a_scanned_layer_is_the_band_it_keeps(rewritten, wrap,
                                                                     arguments):
    """A `lax.scan` body, and a `jax.checkpoint` body inside it, receives the constants it
    closes over as operands: they are read as the constants they are, a causal mask as
    the band it keeps, forward and under `jax.value_and_grad`. A mask scanned over reaches
    the body as a slice of the scanned array, no constant: it is passed as an array."""
    layers = scanned_layers(np.tril(np.ones((T, T), bool)), wrap)
    args = tuple(random_normal(seed, (B, T, N, HD)) for seed in range(3))
    cotangent = random_normal(3, (B, T, N, HD))
    step = jax.value_and_grad(weighted(layers, cotangent), argnums=(0, 1, 2))
    assert attention_calls(tokamax.optimize(step), *args) == {arguments}
    optimized = tokamax.optimize(layers)
    assert attention_calls(optimized, *args) == {arguments}
    assert_gradients_match_jit(layers, optimized, cotangent, (0, 1, 2), args)
