"""`dot_product_attention` as a drop-in for `jax.nn.dot_product_attention`.

The attention cases of JAX's own `tests/nn_test.py` (GQA with and without `vmap`, every
mask mode, the bias gradient), rewritten to call ours, for every implementation that
runs on CPU; the reference is `jax.nn.dot_product_attention` itself on float32 inputs at
HIGHEST precision. Then the layouts `jax.nn` takes beyond rank 4 (no batch axis, masks
and biases of lower rank) and upstream Tokamax's extra leading batch axes.
Shapes are JAX's, shrunk (sequence 128 -> 32) to keep CPU time small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, random_normal, reference_precision
from tokamax_kernels.attention import (
    PallasTritonFlashAttention,
    PallasTritonFlashAttentionConfig,
    PallasTritonFlashAttentionVjp,
    PallasTritonFlashAttentionVjpConfig,
    XlaChunkedConfig,
    XlaChunkedDotProductAttention,
    XlaChunkedDotProductAttentionVjp,
    dot_product_attention,
)

S = T = 32
N, H = 4, 16
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

IMPLEMENTATIONS = {
    "xla": "xla",
    "default": None,
    # Chunks that do not divide the sequence: the padded path too.
    "xla_chunked": XlaChunkedDotProductAttention(
        config=XlaChunkedConfig(16, 12),
        vjp=XlaChunkedDotProductAttentionVjp(config=XlaChunkedConfig(12, 16))),
    "triton": PallasTritonFlashAttention(
        interpret=True,
        config=PallasTritonFlashAttentionConfig(block_q=16, block_k=16, num_warps=4,
                                                num_stages=2),
        vjp=PallasTritonFlashAttentionVjp(
            interpret=True, config=PallasTritonFlashAttentionVjpConfig(
                16, 16, 4, 2, 16, 16, 4, 2))),
}


def _reference(*args, **kwargs):
    """`jax.nn`'s XLA attention on float32 inputs at HIGHEST precision."""
    args = [x.astype(jnp.float32) if x is not None and jnp.issubdtype(x.dtype, jnp.floating)
            else x for x in args]
    with reference_precision():
        return jax.nn.dot_product_attention(*args, **kwargs, implementation="xla")


def _vjp(fn, *primals, cotangent):
    """`fn`'s output and its VJP at `cotangent`, under one (fast-compiling) jit."""
    def run(primals, cotangent):
        out, pullback = jax.vjp(fn, *primals)
        return out, pullback(cotangent)
    return fast_jit(run)(primals, cotangent)


def _ours(impl):
    return functools.partial(dot_product_attention, implementation=IMPLEMENTATIONS[impl])


# nn_test.testDotProductAttention: GQA group sizes, with and without a per-example vmap.
# JAX's whole grid for `xla`; a spread of it for the slower CPU runs (CI time).
GQA_RUNS = [("xla", jnp.bfloat16, g, use_vmap) for g in (1, 2, 4) for use_vmap in (False, True)]
GQA_RUNS += [("xla", jnp.float16, 2, True), ("default", jnp.bfloat16, 4, True),
             ("xla_chunked", jnp.bfloat16, 1, False), ("xla_chunked", jnp.bfloat16, 2, True),
             ("xla_chunked", jnp.bfloat16, 4, True), ("triton", jnp.float32, 2, False),
             ("triton", jnp.float32, 4, True)]


@pytest.mark.parametrize("impl,dtype,group_num,use_vmap", GQA_RUNS)
def test_gqa(impl, dtype, group_num, use_vmap):
    B, G = 2, group_num
    q = random_normal(0, (B, T, N, H), dtype)
    k = random_normal(1, (B, S, N // G, H), dtype)
    v = random_normal(2, (B, S, N // G, H), dtype)
    grad = random_normal(3, (B, T, N, H), dtype)
    sdpa_ans = _ours(impl)
    if use_vmap:
        sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)
    # The reference is the non-GQA version without vmap, as in JAX's test.
    k_ref, v_ref = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    out_ref, (dq_ref, dk_ref, dv_ref) = _vjp(
        lambda q, k, v: _reference(q, k, v), q, k_ref, v_ref,
        cotangent=grad.astype(jnp.float32))
    out, (dq, dk, dv) = _vjp(lambda q, k, v: sdpa_ans(q, k, v, None, None), q, k, v,
                             cotangent=grad)
    dk_ref = dk_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dv_ref = dv_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    assert out.shape == q.shape and out.dtype == dtype
    for actual, expected in ((out, out_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert_close(actual, expected, dtype)


MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"),
              ("custom", "padding"), ("bias", "causal"), ("causal", "sliding_window")]


# nn_test.testDotProductAttentionMask: every mask mode, gradients including the bias's.
# Padding alone runs in CI for `xla`; the kernels' padding is checked with a custom mask
# over it (the `slow` case is a subset of that one's).
MASK_RUNS = [("xla", mode) for mode in MASK_MODES] + [
    pytest.param(impl, mode, marks=[pytest.mark.slow] if mode == "padding" else [])
    for impl in ("xla_chunked", "triton") for mode in
    ("padding", ("custom", "padding"), ("bias", "causal"), ("causal", "sliding_window"))]


@pytest.mark.parametrize("impl,mask_mode", MASK_RUNS, ids=str)
def test_mask_modes(impl, mask_mode):
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    dtype = jnp.float32 if impl == "triton" else jnp.bfloat16
    B = 2
    q = random_normal(10, (B, T, N, H), dtype)
    k = random_normal(11, (B, S, N, H), dtype)
    v = random_normal(12, (B, S, N, H), dtype)
    grad = random_normal(13, (B, T, N, H), dtype)
    bias = mask = q_seqlen = kv_seqlen = window_size = None
    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in mask_mode:
        bias = random_normal(14, (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    def run(sdpa, q, k, v, b):
        return sdpa(q, k, v, b, mask, is_causal=is_causal, query_seq_lengths=q_seqlen,
                    key_value_seq_lengths=kv_seqlen, local_window_size=window_size)

    out_ref, grads_ref = _vjp(functools.partial(run, _reference), q, k, v, bias,
                              cotangent=grad.astype(jnp.float32))
    out, grads = _vjp(functools.partial(run, _ours(impl)), q, k, v, bias, cotangent=grad)
    assert_close(out, out_ref, dtype)
    for name, actual, expected in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref,
                                      strict=True):
        assert (actual is None) == (expected is None), name
        if expected is not None:
            assert_close(actual, expected, dtype)


# nn_test.testDotProductAttentionBiasGradient: a rank-3 mask (1, 1, S), a per-example bias
# under vmap; ours gives the bias gradient at every batch size (cuDNN's only at batch 1).
@pytest.mark.parametrize("impl,batch_size,use_vmap", [
    ("xla", 1, False), ("xla", 1, True), ("xla", 3, False), ("xla", 3, True),
    ("xla_chunked", 3, True), ("triton", 3, True)])
def test_bias_gradient(impl, batch_size, use_vmap):
    dtype = jnp.float32 if impl == "triton" else jnp.bfloat16
    x = random_normal(20, (batch_size, S, N, H), dtype)
    bias = random_normal(21, (batch_size, N, S, S), dtype)
    mask = jnp.asarray(np.arange(S) % 5 != 2)[None, None, :]  # (1, 1, S), as jax.nn allows

    def attention(sdpa, x, bias, mask):
        return sdpa(x, x, x, bias, mask, is_causal=False)

    ref = functools.partial(attention, _reference)
    ans = functools.partial(attention, _ours(impl))
    if use_vmap:
        ref, ans = jax.vmap(ref, in_axes=(0, 0, None)), jax.vmap(ans, in_axes=(0, 0, None))
    cotangent = random_normal(22, x.shape, dtype)
    y_ref, (dx_ref, dbias_ref) = _vjp(lambda x, b: ref(x, b, mask), x, bias,
                                      cotangent=cotangent.astype(jnp.float32))
    y, (dx, dbias) = _vjp(lambda x, b: ans(x, b, mask), x, bias, cotangent=cotangent)
    assert y.shape == x.shape and dbias.shape == bias.shape
    for actual, expected in ((y, y_ref), (dx, dx_ref), (dbias, dbias_ref)):
        assert_close(actual, expected, dtype)


# Layouts beyond rank 4: (query shape, kv shape, bias shape, mask shape, seq-lengths shape).
LAYOUTS = {
    "no_batch_axis": ((T, N, H), (S, 2, H), (N, T, S), (T, S), (1,)),
    "no_batch_axis_rank4_bias": ((T, N, H), (S, N, H), (1, N, T, S), (1, S), ()),
    "low_rank_bias_and_mask": ((2, T, N, H), (2, S, N, H), (T, S), (1, 1, S), (2,)),
    "two_batch_axes": ((2, 3, T, N, H), (2, 3, S, 1, H), (3, 1, 1, S), (2, 1, N, T, S),
                       (2, 3)),
    "bias_over_some_batch_axes": ((2, 3, T, N, H), (2, 3, S, N, H), (2, 1, N, 1, S),
                                  (1, 1, T, S), (2, 3)),
}


def _flat_reference(q, k, v, bias, mask, lengths):
    """jax.nn on the same problem spelled out with one batch axis (the ground truth)."""
    batch = q.shape[:-3]
    flat = int(np.prod(batch))
    q4, k4, v4 = (x.reshape(flat, *x.shape[-3:]) for x in (q, k, v))
    full = (*batch, N, T, S)
    b4, m4 = (jnp.broadcast_to(x.reshape(x.shape[-len(full):]) if x.ndim > len(full) else x,
                               full).reshape(flat, N, T, S) for x in (bias, mask))
    l4 = lengths.reshape(flat)
    return _reference(q4, k4, v4, b4, m4, query_seq_lengths=l4, key_value_seq_lengths=l4,
                      is_causal=True).reshape(q.shape)


@pytest.mark.parametrize("impl,layout", [("xla", layout) for layout in sorted(LAYOUTS)] + [
    ("xla_chunked", "no_batch_axis"), ("xla_chunked", "two_batch_axes")])
def test_layouts(impl, layout):
    q_shape, kv_shape, bias_shape, mask_shape, lengths_shape = LAYOUTS[layout]
    q = random_normal(30, q_shape)
    k, v = random_normal(31, kv_shape), random_normal(32, kv_shape)
    bias = random_normal(33, bias_shape)
    # Key 0 always seen: no fully masked rows, where jax.nn averages and we give zeros.
    mask = jax.random.bernoulli(jax.random.key(34), 0.8, mask_shape).at[..., 0].set(True)
    lengths = jax.random.randint(jax.random.key(35), lengths_shape, T // 2, T + 1)
    options = dict(is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    w = random_normal(36, q_shape)

    def loss(sdpa, q, k, v, bias):
        out = sdpa(q, k, v, bias, mask, **options)
        return jnp.sum(out * w), out

    def ref_loss(q, k, v, bias):
        out = _flat_reference(q, k, v, bias, mask, lengths)
        return jnp.sum(out * w), out

    argnums = (0, 1, 2, 3)
    (_, out), grads = fast_jit(jax.value_and_grad(
        functools.partial(loss, _ours(impl)), argnums, has_aux=True))(q, k, v, bias)
    (_, expected), expected_grads = fast_jit(jax.value_and_grad(
        ref_loss, argnums, has_aux=True))(q, k, v, bias)
    assert out.shape == q_shape
    assert_close(out, expected, scale_rtol=2e-5)
    for actual, ref in zip(grads, expected_grads, strict=True):
        assert actual.shape == ref.shape
        assert_close(actual, ref, scale_rtol=2e-5)


def test_numpy_and_list_inputs():
    """jax.nn takes array-likes; so do we."""
    q = np.asarray(random_normal(40, (T, N, H)))
    mask = np.tril(np.ones((T, S), bool)).tolist()
    out = dot_product_attention(q, q, q, mask=mask, implementation="xla")
    assert_close(out, _reference(jnp.asarray(q), jnp.asarray(q), jnp.asarray(q),
                                 mask=jnp.asarray(mask)))


BAD_LAYOUTS = [
    ("query must have rank >= 3", dict(query=(N, H))),
    ("same leading batch axes", dict(key=(3, S, N, H), value=(3, S, N, H))),
    ("bias must broadcast", dict(bias=(N, 5, S))),
    ("bias must broadcast", dict(bias=(2, 1, N, T, S))),
    ("mask must broadcast", dict(mask=(3, T, S))),
    ("query_seq_lengths must have the leading batch axes", dict(query_seq_lengths=(2,))),
]


@pytest.mark.parametrize("match,shapes", BAD_LAYOUTS, ids=[m for m, _ in BAD_LAYOUTS])
def test_bad_layouts_raise_value_error_naming_the_argument(match, shapes):
    arrays = {"query": (T, N, H), "key": (S, N, H), "value": (S, N, H), **shapes}
    args = {name: random_normal(50, shape) for name, shape in arrays.items()}
    if "mask" in args:
        args["mask"] = args["mask"] > 0
    if "query_seq_lengths" in args:
        args["query_seq_lengths"] = jnp.full(shapes["query_seq_lengths"], T, jnp.int32)
    with pytest.raises(ValueError, match=match):
        dot_product_attention(**args, implementation="xla")


# --- return_residual=True: (output, lse) as jax.nn returns them ---------------------------

@functools.cache
def _masked_lse(dtype):
    """What jax.nn's xla implementation returns as the lse of a row that sees nothing."""
    return jax.nn.dot_product_attention(
        jnp.ones((1, 1, 1, 8), dtype), jnp.ones((1, 1, 1, 8), dtype),
        jnp.ones((1, 1, 1, 8), dtype), mask=jnp.zeros((1, 1, 1, 1), bool),
        return_residual=True, implementation="xla")[1][0, 0, 0]


def _reference_with_lse(q, k, v, bias, mask, **options):
    """jax.nn's xla attention and its lse, float32 at HIGHEST, with the lse's gradient
    (jax.nn stops it): the logsumexp of jax.nn's own masked logits."""
    from jax._src.nn.functions import _apply_masks  # jax.nn's masking, pinned jax 0.11.2

    q, k, v, bias = (None if x is None else x.astype(jnp.float32) for x in (q, k, v, bias))
    out = _reference(q, k, v, bias, mask, **options)
    with reference_precision():
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    window = options.get("local_window_size")
    logits = _apply_masks(logits, mask, options.get("is_causal", False),
                          options.get("query_seq_lengths"), options.get("key_value_seq_lengths"),
                          (window, window) if isinstance(window, int) else window)
    return out, jnp.swapaxes(jax.nn.logsumexp(logits, axis=-1), 1, 2)


def _assert_lse_close(lse, expected, dtype):
    """Equal where jax.nn's lse says a row sees nothing, close (relative to the finite
    values' scale) everywhere else."""
    masked = np.asarray(expected <= _masked_lse(jnp.float32) / 2)
    assert lse.dtype == dtype and lse.shape == expected.shape
    assert np.all(np.asarray(lse)[masked] == np.asarray(_masked_lse(dtype))), "masked rows"
    assert_close(jnp.where(masked, 0.0, lse.astype(jnp.float32)),
                 jnp.where(masked, 0.0, expected), dtype)


RESIDUAL_RUNS = [("xla", mode) for mode in ("none", "padding", "custom", ("bias", "causal"),
                                              ("causal", "sliding_window"))]
RESIDUAL_RUNS += [(impl, mode) for impl in ("default", "xla_chunked", "triton")
                  for mode in (("custom", "padding"), ("bias", "causal"))]


def _mask_options(mask_mode, dtype, B):
    """`(bias, mask, options)` of a mask mode; "custom" hides every key from query row 1."""
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    bias = mask = None
    options = dict(is_causal="causal" in mask_mode)
    if "padding" in mask_mode:
        options["query_seq_lengths"] = jnp.array([T // 2, T - 3], dtype=jnp.int32)
        options["key_value_seq_lengths"] = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        mask = jax.random.bernoulli(jax.random.key(60), 0.7, (B, 1, T, S)).at[:, :, 1].set(False)
    if "bias" in mask_mode:
        bias = random_normal(61, (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        options["local_window_size"] = (3, 2) if options["is_causal"] else (3, 0)
    return bias, mask, options


@pytest.mark.parametrize("impl,mask_mode", RESIDUAL_RUNS, ids=str)
def test_return_residual_matches_jax_nn(impl, mask_mode):
    """Forward: the output and lse (shape BTN, the inputs' dtype, natural log, jax.nn's value
    for rows that see nothing) against jax.nn's xla; gradient of a loss using both outputs
    (random cotangents) against the float32 reference with lse's gradient."""
    dtype = jnp.float32 if impl == "triton" else jnp.bfloat16
    B = 2
    q = random_normal(62, (B, T, N, H), dtype)
    k, v = random_normal(63, (B, S, N, H), dtype), random_normal(64, (B, S, N, H), dtype)
    dout, dlse = random_normal(65, q.shape, dtype), random_normal(66, (B, T, N), dtype)
    bias, mask, options = _mask_options(mask_mode, dtype, B)

    out_nn, lse_nn = fast_jit(lambda q, k, v, bias: jax.nn.dot_product_attention(
        q, k, v, bias, mask, **options, implementation="xla", return_residual=True))(
            q, k, v, bias)
    out_ref, lse_ref = fast_jit(lambda q, k, v, bias: _reference_with_lse(
        q, k, v, bias, mask, **options))(q, k, v, bias)
    np.testing.assert_array_equal(lse_nn == _masked_lse(dtype), lse_ref <= -1e38)

    def loss(sdpa, q, k, v, bias):
        out, lse = sdpa(q, k, v, bias, mask, **options)
        # A row that sees nothing: our output is zeros where jax.nn's averages the values.
        seen = lse_ref > -1e38
        out = jnp.where(seen[..., None], out, 0.0)
        return (jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
                + jnp.sum(jnp.where(seen, lse, 0.0).astype(jnp.float32) * dlse), (out, lse))

    ours = functools.partial(_ours(impl), return_residual=True)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, (out, lse)), grads = fast_jit(jax.value_and_grad(
        functools.partial(loss, ours), argnums, has_aux=True))(q, k, v, bias)
    (_, _), grads_ref = fast_jit(jax.value_and_grad(
        functools.partial(loss, _reference_with_lse), argnums, has_aux=True))(q, k, v, bias)
    assert out.shape == q.shape and out.dtype == dtype
    _assert_lse_close(lse, lse_ref, dtype)
    assert lse.dtype == lse_nn.dtype
    _assert_lse_close(lse, lse_nn.astype(jnp.float32), dtype)
    assert_close(out, jnp.where(lse_ref[..., None] > -1e38, out_ref, 0.0), dtype)
    for actual, expected in zip(grads, grads_ref, strict=True):
        assert_close(actual, expected, dtype)


def test_return_residual_gradient_of_lse_alone_and_of_out_alone():
    """Only lse in the loss (the output's cotangent is a symbolic zero), and only the
    output: the latter is the ordinary gradient, with no lse cotangent in the VJP call."""
    q = random_normal(70, (2, T, N, H))
    k, v = random_normal(71, (2, S, 2, H)), random_normal(72, (2, S, 2, H))
    dlse = random_normal(73, (2, T, N))
    ours = functools.partial(dot_product_attention, implementation=IMPLEMENTATIONS["triton"],
                             is_causal=True, return_residual=True)
    grads = fast_jit(jax.grad(lambda q, k: jnp.sum(ours(q, k, v)[1] * dlse), (0, 1)))(q, k)
    v_ref = jnp.repeat(v, 2, axis=2)
    grads_ref = fast_jit(jax.grad(lambda q, k: jnp.sum(_reference_with_lse(
        q, jnp.repeat(k, 2, axis=2), v_ref, None, None, is_causal=True)[1] * dlse), (0, 1)))(
            q, k)
    for actual, expected in zip(grads, grads_ref, strict=True):
        assert_close(actual, expected)

    def out_loss(q):
        return jnp.sum(ours(q, k, v)[0] * q)

    plain = fast_jit(jax.grad(lambda q: jnp.sum(dot_product_attention(
        q, k, v, is_causal=True, implementation=IMPLEMENTATIONS["triton"]) * q)))(q)
    assert_close(fast_jit(jax.grad(out_loss))(q), plain, scale_rtol=1e-6)
    vjp_calls = [eqn.params["call"] for eqn in jax.make_jaxpr(jax.grad(out_loss))(q).eqns
                 if eqn.primitive.name == "tokamax_call"]
    assert vjp_calls and not any(
        "dresiduals" in call.arguments([None] * len(call.operand_indices))
        for call in vjp_calls)


@pytest.mark.parametrize("use_vmap", [False, True])
def test_return_residual_without_batch_axis(use_vmap):
    """(T, N, H) inputs give a (T, N) lse, as jax.nn; under a per-example vmap (B, T, N)."""
    shape = (2, T, N, H) if use_vmap else (T, N, H)
    q, k, v = (random_normal(80 + i, shape, jnp.bfloat16) for i in range(3))
    mask = np.tril(np.ones((T, S), bool))
    mask[4] = False
    mask = jnp.asarray(mask[None])  # (1, T, S); row 4 empty
    ours = functools.partial(dot_product_attention, mask=mask, implementation="xla_chunked",
                             return_residual=True)
    theirs = functools.partial(jax.nn.dot_product_attention, mask=mask, implementation="xla",
                               return_residual=True)
    if use_vmap:
        ours, theirs = jax.vmap(ours), jax.vmap(theirs)
    (out, lse), (out_nn, lse_nn) = fast_jit(ours)(q, k, v), fast_jit(theirs)(q, k, v)
    assert lse.shape == lse_nn.shape == shape[:-1] and lse.dtype == lse_nn.dtype
    _assert_lse_close(lse, lse_nn.astype(jnp.float32), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[..., 4, :, :], 0.0)
    assert_close(out.at[..., 4, :, :].set(0), out_nn.at[..., 4, :, :].set(0), jnp.bfloat16)


def test_return_residual_must_be_a_bool():
    q = random_normal(90, (T, N, H))
    with pytest.raises(TypeError, match="return_residual must be a bool"):
        dot_product_attention(q, q, q, return_residual="yes")
