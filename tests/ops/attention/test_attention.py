"""dot_product_attention's base suite: every implementation that runs on CPU (xla, xla_chunked
at chunks that divide the shapes and at chunks that pad them, the Triton kernels in Pallas
interpret mode) gets the same cases against an independent float64 reference: masks, bias,
GQA and MQA, cross attention, sequence lengths, windows, the soft cap, all of them at once,
bf16, vmap, fully masked rows. The Mosaic TPU kernels need head dims of 128 lanes
(`test_mosaic_tpu_attention.py`); the Mosaic GPU and cuDNN kernels lower for an H200 here
and run on the device (`tests/gpu/`)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.attention import (
    CudnnDotProductAttention,
    DotProductAttention,
    PallasTritonFlashAttention,
    PallasTritonFlashAttentionConfig,
    PallasTritonFlashAttentionVjp,
    PallasTritonFlashAttentionVjpConfig,
    XlaChunkedConfig,
    XlaChunkedDotProductAttention,
    XlaChunkedDotProductAttentionVjp,
    dot_product_attention,
)
from tokamax_kernels.attention.api import FAMILY
from tokamax_kernels.attention.cudnn import _nonempty_rows

B, H, D = 2, 4, 16
# LLVM optimization off: halves XLA's CPU compile time, the bulk of this file's runtime.
fast_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _keep(batch, heads, sq, sk, mask=None, is_causal=False, query_seq_lengths=None,
          key_value_seq_lengths=None, local_window_size=None, **_):
    """The (B, H, Sq, Sk) attend-or-not boolean, spelled out in numpy."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    keep = np.ones((batch, heads, sq, sk), bool)
    if mask is not None:
        keep &= np.broadcast_to(np.asarray(mask), keep.shape)
    if is_causal:
        keep &= j <= i
    if local_window_size is not None:
        left, right = ((local_window_size,) * 2 if isinstance(local_window_size, int)
                       else local_window_size)
        keep &= (j >= i - left) & (j <= i + right)
    if query_seq_lengths is not None:
        keep &= (i < np.asarray(query_seq_lengths)[:, None, None])[:, None]
    if key_value_seq_lengths is not None:
        keep &= (j < np.asarray(key_value_seq_lengths)[:, None, None])[:, None]
    return keep


def reference(q, k, v, bias=None, mask=None, *, scale=None, logits_soft_cap=None,
              precision=None, **options):
    """Plain float32 jnp attention (differentiable); rows with nothing to attend to -> 0."""
    del precision
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    batch, sq, heads, dim = q.shape
    k = jnp.repeat(k, heads // k.shape[2], axis=2)
    v = jnp.repeat(v, heads // v.shape[2], axis=2)
    scale = 1 / np.sqrt(dim) if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    keep = _keep(batch, heads, sq, k.shape[1], mask, **options)
    probs = jax.nn.softmax(jnp.where(keep, logits, -1e30), axis=-1) * keep
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def np_reference(q, k, v, bias, dout, *, scale=None, logits_soft_cap=None, precision=None,
                 **options):
    """Attention and its textbook gradients in float64 numpy: (out, (dq, dk, dv, dbias))."""
    del precision
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    batch, sq, heads, dim = q.shape
    sk, groups = k.shape[1], heads // k.shape[2]
    kr, vr = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scale = 1 / np.sqrt(dim) if scale is None else scale
    logits = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if logits_soft_cap is not None:
        tanh = np.tanh(logits / logits_soft_cap)
        logits = logits_soft_cap * tanh
    keep = _keep(batch, heads, sq, sk, **options)
    masked = np.where(keep, logits, -np.inf)
    row_max = np.max(masked, axis=-1, keepdims=True)
    probs = np.where(keep, np.exp(masked - np.where(np.isfinite(row_max), row_max, 0)), 0)
    total = probs.sum(-1, keepdims=True)
    probs = probs / np.where(total > 0, total, 1)
    out = np.einsum("bhqk,bkhd->bqhd", probs, vr)
    dprobs = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    dlogits = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True))
    if logits_soft_cap is not None:
        dlogits = dlogits * (1 - tanh**2)
    dq = np.einsum("bhqk,bkhd->bqhd", dlogits, kr) * scale
    grouped = (batch, sk, k.shape[2], groups, dim)
    dk = (np.einsum("bhqk,bqhd->bkhd", dlogits, q) * scale).reshape(grouped).sum(3)
    dv = np.einsum("bhqk,bqhd->bkhd", probs, dout).reshape(grouped).sum(3)
    dbias = None
    if bias is not None:
        axes = tuple(a for a in range(4) if np.shape(bias)[a] == 1)
        dbias = dlogits.sum(axis=axes, keepdims=True)
    return out, (dq, dk, dv, dbias)


def _inputs(sq=16, sk=16, kv_heads=H, dtype=jnp.float32, seed=0):
    q = random_normal(seed, (B, sq, H, D), dtype)
    k = random_normal(seed + 1, (B, sk, kv_heads, D), dtype)
    v = random_normal(seed + 2, (B, sk, kv_heads, D), dtype)
    return q, k, v


def _mask(shape, seed=5, empty_row=True):
    mask = np.array(jax.random.bernoulli(jax.random.key(seed), 0.7, shape))
    if empty_row:
        mask[0, :, 3, :] = False  # a fully masked query row
    return jnp.asarray(mask)


# name -> (input kwargs, option builder taking (sq, sk))
CASES = {
    "plain": (dict(), lambda sq, sk: {}),
    "causal": (dict(), lambda sq, sk: dict(is_causal=True)),
    "mask": (dict(), lambda sq, sk: dict(mask=_mask((B, 1, sq, sk)))),
    "bias": (dict(), lambda sq, sk: dict(bias=random_normal(7, (B, H, sq, sk)))),
    "bias_broadcast": (dict(), lambda sq, sk: dict(bias=random_normal(7, (1, H, 1, sk)))),
    "gqa": (dict(kv_heads=2), lambda sq, sk: {}),
    "mqa": (dict(kv_heads=1), lambda sq, sk: dict(is_causal=True)),
    "cross": (dict(sq=24, sk=40), lambda sq, sk: {}),
    "seq_lengths": (dict(sq=20, sk=24), lambda sq, sk: dict(
        query_seq_lengths=jnp.array([20, 7]), key_value_seq_lengths=jnp.array([11, 24]))),
    # Lengths past the sequence mean the whole sequence (padded keys stay unseen).
    "lengths_past_the_end": (dict(sq=20, sk=24), lambda sq, sk: dict(
        query_seq_lengths=jnp.array([23, 9]), key_value_seq_lengths=jnp.array([30, 27]))),
    "window": (dict(), lambda sq, sk: dict(local_window_size=(3, 1))),
    "soft_cap": (dict(), lambda sq, sk: dict(logits_soft_cap=0.8, scale=1.0)),
    "combined": (dict(sq=24, sk=40, kv_heads=2), lambda sq, sk: dict(
        bias=random_normal(7, (1, H, sq, sk)), mask=_mask((B, H, sq, sk)), is_causal=True,
        query_seq_lengths=jnp.array([24, 19]), key_value_seq_lengths=jnp.array([40, 13]),
        local_window_size=(9, 4), logits_soft_cap=2.0, scale=0.3,
        precision=jax.lax.Precision.HIGHEST)),
}

IMPLEMENTATIONS = {
    "xla": "xla",
    "xla_chunked": XlaChunkedDotProductAttention(config=XlaChunkedConfig(8, 16)),
    "xla_chunked_padded": XlaChunkedDotProductAttention(config=XlaChunkedConfig(5, 7)),
    # 16-row blocks: the 20-, 24- and 40-long sequences leave partial blocks.
    "triton": PallasTritonFlashAttention(
        interpret=True,
        config=PallasTritonFlashAttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=2),
        vjp=PallasTritonFlashAttentionVjp(interpret=True, config=(
            PallasTritonFlashAttentionVjpConfig(16, 16, 4, 2, 16, 16, 4, 2)))),
}
# Kernels accumulate in another order than XLA's dots: float32 agrees to this, relative.
F32_RTOL = {"triton": 1e-4}


def _fwd_and_grads(fn, q, k, v, options):
    """out and d(sum(out * w))/d(q, k, v, bias) under one jit."""
    bias = options.pop("bias", None)
    w = _cotangent(q.shape)

    def loss(q, k, v, bias):
        out = fn(q, k, v, bias, **options)
        return jnp.sum(out.astype(jnp.float32) * w), out

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, out), grads = fast_jit(value_and_grad)(q, k, v, bias)
    return out, grads


@functools.cache
def _reference_results(case, dtype_name):
    """The numpy reference's out and gradients for a case (on the dtype-rounded inputs)."""
    shapes, build = CASES[case]
    q, k, v = (x.astype(jnp.float32) for x in _inputs(dtype=jnp.dtype(dtype_name), **shapes))
    options = build(q.shape[1], k.shape[1])
    return np_reference(q, k, v, options.pop("bias", None), _cotangent(q.shape), **options)


def _cotangent(shape):
    return random_normal(11, shape, jnp.float32)


def _check_against_reference(implementation, case, dtype, rtol=None):
    shapes, build = CASES[case]
    q, k, v = _inputs(dtype=dtype, **shapes)
    options = build(q.shape[1], k.shape[1])

    def op(q, k, v, bias, **kw):
        return dot_product_attention(q, k, v, bias, implementation=implementation, **kw)

    with reference_precision():
        out, grads = _fwd_and_grads(op, q, k, v, dict(options))
    ref_out, ref_grads = _reference_results(case, jnp.dtype(dtype).name)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, scale_rtol=rtol)
    for name, grad, ref in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        if ref is None:
            assert grad is None, name
            continue
        assert np.all(np.isfinite(np.asarray(grad, np.float32))), name
        assert_close(grad, ref, dtype, scale_rtol=None if rtol is None else rtol * 2)


def test_numpy_reference_gradients_match_autodiff():
    """The hand-written numpy gradients agree with jax.grad of the jnp reference."""
    out, grads = _reference_results("combined", "float32")
    shapes, build = CASES["combined"]
    q, k, v = _inputs(**shapes)
    with reference_precision():
        jnp_out, jnp_grads = _fwd_and_grads(reference, q, k, v, build(q.shape[1], k.shape[1]))
    assert_close(jnp_out, out)
    for grad, jnp_grad in zip(grads, jnp_grads, strict=True):
        assert_close(jnp_grad, grad)


# Chunks that do not divide the shapes (padding) only where the shapes are uneven.
# "causal", "gqa" and "cross" run in the suite's other cases, not on their own: "mqa" is
# causal self-attention (one K/V head), "combined" is causal cross attention (24 queries,
# 40 keys) over two K/V heads, so a fault in any of the three fails those.
_COVERED_BY_OTHER_CASES = ("causal", "gqa", "cross")
F32_RUNS = [(impl, case) for impl in ("xla", "xla_chunked", "triton")
            for case in sorted(CASES) if case not in _COVERED_BY_OTHER_CASES] + [
    ("xla_chunked_padded", "combined"), ("xla_chunked_padded", "seq_lengths")]


@pytest.mark.parametrize("impl,case", F32_RUNS)
def test_matches_reference_f32(impl, case):
    _check_against_reference(IMPLEMENTATIONS[impl], case, jnp.float32,
                             rtol=F32_RTOL.get(impl, 2e-5))


# bf16 with every feature at once (the float32 grid checks them one at a time).
@pytest.mark.parametrize("case", ["combined"])
@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "triton"])
def test_matches_reference_bf16(impl, case):
    _check_against_reference(IMPLEMENTATIONS[impl], case, jnp.bfloat16, rtol=3e-2)


def test_chunked_lengths_past_the_end_never_reach_the_padded_keys():
    """Key chunks of 7 pad 24 keys to 28: key lengths of 30 and 27 mean all 24 keys,
    never the 4 padded ones (and a query length of 23 all 20 queries)."""
    _check_against_reference(IMPLEMENTATIONS["xla_chunked_padded"], "lengths_past_the_end",
                             jnp.float32, rtol=2e-5)


def test_default_implementation_runs_on_cpu():
    _check_against_reference(None, "combined", jnp.float32, rtol=2e-5)


def test_float64_in_xla_implementations():
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in _inputs(sq=12, sk=20))
        options = dict(is_causal=True, local_window_size=2)  # an int window: (2, 2)
        expected, _ = np_reference(q, k, v, None, np.zeros(q.shape), **options)
        for implementation in ("xla", IMPLEMENTATIONS["xla_chunked"]):
            out = fast_jit(lambda q, k, v, implementation=implementation: dot_product_attention(
                q, k, v, **options, implementation=implementation))(q, k, v)
            assert out.dtype == jnp.float64
            # Far beyond float32 rounding (~1e-7): the computation really is float64.
            np.testing.assert_allclose(np.asarray(out), expected, atol=1e-12)


@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "triton"])
def test_vmap(impl):
    q, k, v = (jnp.stack([x, x * 0.5]) for x in _inputs(sq=16, sk=24))
    mask = _mask((B, 1, 16, 24))

    def op(q, k, v):
        return dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                     implementation=IMPLEMENTATIONS[impl])

    w = jnp.stack([_cotangent(q.shape[1:])] * 2)
    out, grad = fast_jit(jax.value_and_grad(
        lambda q: jnp.sum(jax.vmap(op)(q, k, v) * w)))(q)
    out = fast_jit(jax.vmap(op))(q, k, v)
    for i in range(2):
        ref_out, (ref_dq, *_) = np_reference(q[i], k[i], v[i], None, w[i], mask=mask,
                                             is_causal=True)
        assert_close(out[i], ref_out, scale_rtol=F32_RTOL.get(impl))
        assert_close(grad[i], ref_dq, scale_rtol=F32_RTOL.get(impl, 2e-5))


@pytest.mark.parametrize("impl", ["xla", "xla_chunked", "triton"])
def test_fully_masked_rows_are_zero_with_zero_gradient(impl):
    q, k, v = _inputs()
    mask = jnp.zeros((B, 1, 16, 16), bool).at[1].set(True)  # batch 0 sees nothing
    op = IMPLEMENTATIONS[impl]
    out = fast_jit(lambda q, k, v: dot_product_attention(
        q, k, v, mask=mask, implementation=op))(q, k, v)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.abs(np.asarray(out[1])) > 0)
    grads = fast_jit(jax.grad(lambda q, k, v: jnp.sum(dot_product_attention(
        q, k, v, mask=mask, implementation=op) ** 2), argnums=(0, 1, 2)))(q, k, v)
    for grad in grads:
        assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad[0]) == 0)


@pytest.mark.parametrize("cls", [DotProductAttention, XlaChunkedDotProductAttention])
def test_lse_residual_contract(cls):
    q, k, v = _inputs(sq=24, sk=40, kv_heads=2)
    options = dict(mask=_mask((B, 1, 24, 40)), is_causal=True, logits_soft_cap=3.0)
    ba = cls().bind(q, k, v, **options)
    config = XlaChunkedConfig(8, 16) if cls is XlaChunkedDotProductAttention else None
    _, (lse,) = fast_jit(lambda: cls()._fwd(**ba.arguments, config=config,
                                            return_residuals=True))()
    assert lse.shape == (B, H, 24) and lse.dtype == jnp.float32
    kr = jnp.repeat(k, 2, axis=2)
    with reference_precision():
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(D)
    logits = 3.0 * jnp.tanh(logits / 3.0)
    keep = np.asarray(options["mask"]) & (np.arange(40)[None] <= np.arange(24)[:, None])
    expected = jax.nn.logsumexp(jnp.where(keep, logits, -jnp.inf), axis=-1)
    assert np.array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(expected)))
    assert np.isinf(np.asarray(lse)[0, :, 3]).all() and (np.asarray(lse)[0, :, 3] < 0).all()
    finite = np.isfinite(np.asarray(expected))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(expected)[finite], atol=1e-5)


def test_chunked_vjp_pairs_with_reference_forward_residuals():
    """The backward works from any forward's lse: reference forward + chunked backward."""
    q, k, v = _inputs(sq=24, sk=40, kv_heads=2)
    bias = random_normal(7, (B, 1, 24, 40))
    options = dict(is_causal=True, local_window_size=(6, 2), logits_soft_cap=2.0)
    ref_op = DotProductAttention(vjp=XlaChunkedDotProductAttentionVjp(
        config=XlaChunkedConfig(16, 8)))
    w = _cotangent(q.shape)
    grads = fast_jit(jax.grad(lambda q, k, v, b: jnp.sum(ref_op(q, k, v, b, **options) * w),
                              argnums=(0, 1, 2, 3)))(q, k, v, bias)
    _, expected = np_reference(q, k, v, bias, w, **options)
    for grad, ref in zip(grads, expected, strict=True):
        assert_close(grad, ref, scale_rtol=2e-5)


def test_chunked_search_space_configs_agree():
    q, k, v = _inputs(sq=16, sk=40)
    ba = XlaChunkedDotProductAttention().bind(q, k, v, is_causal=True)
    configs = ba.autotuning_configs
    assert XlaChunkedConfig(16, 64) in configs and ba.heuristics_config in configs
    expected, _ = np_reference(q, k, v, None, np.zeros(q.shape), is_causal=True)
    for config in (ba.heuristics_config, XlaChunkedConfig(64, 64)):
        op = XlaChunkedDotProductAttention(config=config)
        out = fast_jit(lambda q, k, v, op=op: dot_product_attention(
            q, k, v, is_causal=True, implementation=op))(q, k, v)
        assert_close(out, expected, scale_rtol=2e-5)
    with pytest.raises(ValueError, match="chunk_q"):
        XlaChunkedConfig(0, 8)


def test_a_chunk_past_the_sequence_pads_to_its_next_power_of_2():
    """A chunk of 2**20 (within the config limits, as a cache file may hold it) at 24
    queries and 40 keys runs as one block of 32 x 64, forward and backward, not padded to
    2**20 (a logits block of terabytes)."""
    q = jax.ShapeDtypeStruct((B, 24, 2, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((B, 40, 2, 16), jnp.float32)
    huge = XlaChunkedConfig(2**20, 2**20)
    op = XlaChunkedDotProductAttention(config=huge,
                                       vjp=XlaChunkedDotProductAttentionVjp(config=huge))
    loss = jax.grad(lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, implementation=op)),
                    argnums=(0, 1, 2))
    shapes = re.findall(r"tensor<([0-9x]+)x", jax.jit(loss).lower(q, k, k).as_text())
    assert not any(str(2**20) in shape for shape in shapes)
    assert any(shape.endswith("32x64") for shape in shapes)


def _max_square_dim(text: str, size: int) -> bool:
    return bool(re.search(rf"\b{size}x{size}x", text))


def test_chunked_does_not_materialize_seq_by_seq():
    s = 512
    x = jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 2, 1, s), jnp.float32)

    def loss(implementation):
        def f(q, k, v, b):
            return jnp.sum(dot_product_attention(q, k, v, b, is_causal=True,
                                                 implementation=implementation) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))

    config = XlaChunkedConfig(64, 64)
    chunked = XlaChunkedDotProductAttention(
        config=config, vjp=XlaChunkedDotProductAttentionVjp(config=config))
    chunked_text = loss(chunked).lower(x, x, x, bias).as_text()
    assert "tokamax_pass_spec" in chunked_text
    assert not _max_square_dim(chunked_text, s)
    assert _max_square_dim(loss("xla").lower(x, x, x, bias).as_text(), s)  # the check can fail


def test_metadata_round_trip():
    q, k, v = _inputs(sq=16, sk=24, kv_heads=2)
    mask = _mask((B, 1, 16, 24))
    lengths = jnp.array([16, 9], jnp.int32)

    def f(q, k, v):
        return dot_product_attention(q, k, v, mask=mask, key_value_seq_lengths=lengths,
                                     local_window_size=3, logits_soft_cap=5.0,
                                     precision="highest", implementation="xla_chunked")

    text = jax.jit(f).lower(q, k, v).as_text()
    payloads = set(re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text))
    assert len(payloads) == 1
    ba = tokamax.BoundArguments.from_json(payloads.pop().replace("\\22", '"'))
    assert isinstance(ba.op, XlaChunkedDotProductAttention)
    assert ba.op.config is not None
    args = ba.arguments
    assert args["key"].shape == (B, 24, 2, D) and args["mask"].dtype == jnp.bool_
    assert args["local_window_size"] == (3, 3) and args["logits_soft_cap"] == 5.0
    assert args["precision"] == jax.lax.Precision.HIGHEST
    assert args["scale"] == pytest.approx(1 / np.sqrt(D))


BAD_INPUTS = [
    ("query must have rank >= 3", lambda q, k, v: ((q[0, 0], k, v), {})),
    ("same leading batch axes", lambda q, k, v: ((q[0], k, v), {})),
    ("query, key and value must share a dtype", lambda q, k, v: (
        (q, k.astype(jnp.bfloat16), v), {})),
    ("key head_dim", lambda q, k, v: ((q, k[..., :8], v[..., :8]), {})),
    ("value", lambda q, k, v: ((q, k, v[:, :8]), {})),
    ("must divide query heads", lambda q, k, v: ((q, k[:, :, :3], v[:, :, :3]), {})),
    ("bias", lambda q, k, v: ((q, k, v), dict(bias=jnp.ones((B, H, 16, 5))))),
    ("bias", lambda q, k, v: ((q, k, v), dict(bias=jnp.ones((3, 16, 16))))),
    ("mask", lambda q, k, v: ((q, k, v), dict(mask=jnp.ones((B, 1, 16, 16))))),
    ("mask", lambda q, k, v: ((q, k, v), dict(mask=jnp.ones((B, 3, 16, 16), bool)))),
    ("query_seq_lengths", lambda q, k, v: ((q, k, v), dict(query_seq_lengths=jnp.ones(B)))),
    ("key_value_seq_lengths", lambda q, k, v: (
        (q, k, v), dict(key_value_seq_lengths=jnp.ones((B, 1), jnp.int32)))),
    ("local_window_size", lambda q, k, v: ((q, k, v), dict(local_window_size=-1))),
    ("local_window_size", lambda q, k, v: ((q, k, v), dict(local_window_size=(1, 2, 3)))),
    ("logits_soft_cap", lambda q, k, v: ((q, k, v), dict(logits_soft_cap=0.0))),
    ("precision", lambda q, k, v: ((q, k, v), dict(precision="bogus"))),
    ("scale", lambda q, k, v: ((q, k, v), dict(scale="big"))),
]


@pytest.mark.parametrize("match,build", BAD_INPUTS, ids=[f"{m}-{i}" for i, (m, _) in
                                                         enumerate(BAD_INPUTS)])
def test_bad_input_raises_value_error_naming_it(match, build):
    args, kwargs = build(*_inputs())
    for implementation in (None, "xla_chunked"):
        with pytest.raises(ValueError, match=re.escape(match)):
            dot_product_attention(*args, **kwargs, implementation=implementation)


def test_accelerator_only_implementations_raise_on_cpu():
    q, k, v = _inputs(dtype=jnp.bfloat16)
    names = ("cudnn", "triton", "mosaic", "mosaic_gpu", "mosaic_tpu")
    accelerator_only = [n for n in names if n in FAMILY.implementations or n in FAMILY.aliases]
    assert {"cudnn", "mosaic", "mosaic_tpu"} <= set(accelerator_only)
    for name in accelerator_only:
        with pytest.raises(NotImplementedError):
            dot_product_attention(q, k, v, implementation=name)
    with pytest.raises(ValueError, match="xla_chunked"):
        dot_product_attention(q, k, v, implementation="flash")


@pytest.mark.parametrize("dtype,options,reason", [
    (jnp.float32, {}, "bf16/f16"),
    (jnp.bfloat16, dict(logits_soft_cap=1.0), "soft cap"),
    (jnp.bfloat16, dict(local_window_size=(2, 1)), "right part"),
])
def test_cudnn_rejects_what_it_cannot_do(dtype, options, reason):
    q, k, v = _inputs(dtype=dtype)
    op = CudnnDotProductAttention()
    ba = op.bind(q, k, v, **options)
    with pytest.raises(NotImplementedError, match=reason):
        op.check_supported(ba, None)
    odd = op.bind(*(x[..., :12].astype(jnp.bfloat16) for x in (q, k, v)))
    with pytest.raises(NotImplementedError, match="head_dim"):
        op.check_supported(odd, None)
    op.check_supported(op.bind(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                               v.astype(jnp.bfloat16), is_causal=True,
                               local_window_size=(2, 1)), None)


@pytest.mark.parametrize("options", [
    dict(is_causal=True, local_window_size=(2, 0)),
    dict(local_window_size=(1, 3), key_value_seq_lengths=jnp.array([40, 4])),
    dict(is_causal=True, query_seq_lengths=jnp.array([30, 9]),
         key_value_seq_lengths=jnp.array([0, 24])),
    dict(mask=_mask((B, 1, 48, 40)), is_causal=True, key_value_seq_lengths=jnp.array([7, 40])),
])
def test_cudnn_zeroes_exactly_the_rows_with_nothing_to_attend(options):
    """cuDNN's output is masked by this row predicate (it cannot run on CPU itself)."""
    q, k, v = _inputs(sq=48, sk=40, dtype=jnp.bfloat16)
    ba = CudnnDotProductAttention().bind(q, k, v, **options)
    rows = np.asarray(_nonempty_rows(48, 40, dict(ba.arguments)))
    expected = _keep(B, H, 48, 40, **options).any(-1).transpose(0, 2, 1)[..., None]
    assert not expected.all() and expected.any()
    np.testing.assert_array_equal(np.broadcast_to(rows, expected.shape), expected)


@pytest.mark.gpu
def test_cudnn_on_gpu_matches_reference_and_lowers_for_cuda():
    q, k, v = _inputs(sq=64, sk=128, kv_heads=2, dtype=jnp.bfloat16)
    mask = _mask((B, 1, 64, 128))
    options = dict(mask=mask, is_causal=True, key_value_seq_lengths=jnp.array([128, 50]))
    with reference_precision():
        out, grads = _fwd_and_grads(
            lambda *a, **kw: dot_product_attention(*a, **kw, implementation="cudnn"),
            q, k, v, dict(options))
        ref, ref_grads = _fwd_and_grads(reference, *(x.astype(jnp.float32) for x in (q, k, v)),
                                        dict(options))
    assert_close(out, ref, jnp.bfloat16, scale_rtol=3e-2)
    for grad, expected in zip(grads[:3], ref_grads[:3], strict=True):
        assert_close(grad, expected, jnp.bfloat16, scale_rtol=6e-2)
    with tokamax.core.targeting(H200):
        exported = jax.export.export(
            jax.jit(lambda q, k, v: dot_product_attention(q, k, v, implementation="cudnn")),
            platforms=["cuda"])(q, k, v)
    assert "cudnn" in exported.mlir_module() and "tokamax_pass_spec" in exported.mlir_module()


@pytest.mark.parametrize("head_dim", [64, 256])
def test_none_tries_cudnn_first_on_hopper_up_to_head_dim_256(monkeypatch, head_dim):
    """cuDNN is a candidate at trace time for every head dim a GPU can run (256 on
    Hopper): a candidate dropped at trace time is never reconsidered at lowering."""
    from tokamax_kernels.attention import cudnn

    monkeypatch.setattr(cudnn, "_require_cudnn_library", lambda: None)  # a CPU machine
    x = jax.ShapeDtypeStruct((2, 512, 2, head_dim), jnp.bfloat16)

    def f(q):
        return dot_product_attention(q, q, q).astype(jnp.float32).sum()

    with tokamax.core.targeting(H200):
        plan = tokamax.optimize(jax.grad(f)).plan(x)
    assert [row.op for row in plan] == [
        "CudnnDotProductAttention", "CudnnDotProductAttentionVjp"]


@pytest.mark.parametrize("shape", [(32, 2048, 16, 64), (4, 8192, 16, 128)])
def test_self_attention_backward_runs_the_measured_shared_input_kernel_on_the_h200(
        monkeypatch, shape):
    """`dot_product_attention(x, x, x)` (the seed model) on the H200: the shipped cache
    measured the Mosaic shared-input backward faster than cuDNN's at these shapes, and not
    XLA's gradient, which a device sweep shows slower than cuDNN's
    (`Op.yields_unmeasured_to`). Without that rule the unmeasured XLA gradient would make
    the measurements incomparable and `None` would fall back to cuDNN."""
    from tokamax_kernels.attention import cudnn

    monkeypatch.setattr(cudnn, "_require_cudnn_library", lambda: None)  # a CPU machine
    assert _self_attention_gradient_plan(shape) == [
        "CudnnDotProductAttention", "PallasMosaicGpuFlashAttentionVjp"]


def _self_attention_gradient_plan(shape: tuple[int, ...]) -> list[str]:
    """The ops `optimize` plans on the H200 for the gradient of `attention(x, x, x)`."""
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    def f(x):
        return dot_product_attention(x, x, x).astype(jnp.float32).sum()

    with tokamax.core.targeting(H200):
        return [row.op for row in tokamax.optimize(jax.grad(f)).plan(x)]


@pytest.mark.parametrize("shape", [(32, 2048, 16, 64), (4, 8192, 16, 128)])
def test_a_cpu_export_for_the_h200_runs_the_measured_kernels_without_cudnn(shape):
    """Exporting for the H200 from a CPU machine, where cuDNN cannot be lowered
    (`CannotLowerHere`): the self-attention gradient still runs the Mosaic shared-input
    kernel, measured faster than cuDNN's and so than XLA's, which yields to cuDNN's
    unmeasured. With cuDNN dropped and its measurement lost with it, the d128 gradient
    would run XLA's, several times slower than the kernel on the H200."""
    from tokamax_kernels.attention import cudnn

    with pytest.raises(tokamax.core.CannotLowerHere):
        cudnn._require_cudnn_library()  # a CPU machine, as the test means
    assert _self_attention_gradient_plan(shape) == [
        "PallasMosaicGpuFlashAttention", "PallasMosaicGpuFlashAttentionVjp"]


def test_cudnn_calls_a_call_it_never_runs_unsupported_not_unlowerable_here():
    """On this CPU machine cuDNN cannot be lowered (`CannotLowerHere`: its measurements
    still count); a soft-capped call it never runs anywhere is plainly unsupported, so no
    measurement of it is looked for."""
    from tokamax_kernels.attention import CudnnDotProductAttention

    x = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    with tokamax.core.targeting(H200):
        target = tokamax.core.current_target()
        capped = CudnnDotProductAttention().bind(x, x, x, logits_soft_cap=30.0)
        with pytest.raises(NotImplementedError, match="soft cap") as raised:
            capped.op.check_supported(capped, target)
        assert not isinstance(raised.value, tokamax.core.CannotLowerHere)
        runnable = CudnnDotProductAttention().bind(x, x, x)
        with pytest.raises(tokamax.core.CannotLowerHere, match="cannot be lowered here"):
            runnable.op.check_supported(runnable, target)


@pytest.mark.parametrize("shape, vmapped, plain", [
    pytest.param((1, 128, 8, 256), 1, "Xla", id="swept-loss-d256"),
    pytest.param((1, 128, 8, 128), 1, "Xla", id="swept-tie-d128"),
    pytest.param((1, 128, 8, 64), 1, "Cudnn", id="swept-win-d64"),
    pytest.param((1, 128, 16, 256), 1, "Cudnn", id="swept-win-twice-the-rows"),
    pytest.param((1, 128, 4, 128), 4, "Cudnn", id="vmapped-4x-counts"),
    pytest.param((1, 1, 32, 128), 1, "Xla", id="decode-row"),
])
def test_unmeasured_none_runs_xla_where_cudnn_lost_the_sweep(monkeypatch, shape, vmapped,
                                                             plain):
    """`None` without a measurement: cuDNN attention, plain JAX's fused path, lost to
    `jax.nn`'s default XLA attention only on the tiniest swept calls at head dims over 64
    (a device sweep of 60 shapes, causal and not); there XLA runs, forward and backward."""
    from tokamax_kernels.attention import cudnn

    monkeypatch.setattr(cudnn, "_require_cudnn_library", lambda: None)  # a CPU machine
    x = jax.ShapeDtypeStruct((vmapped, *shape) if vmapped > 1 else shape, jnp.bfloat16)

    def f(q):
        attend = lambda q: dot_product_attention(q, q, q, is_causal=True)
        out = jax.vmap(attend)(q) if vmapped > 1 else attend(q)
        return out.astype(jnp.float32).sum()

    with tokamax.core.targeting(H200):
        plan = tokamax.optimize(jax.grad(f)).plan(x)
    forward = "DotProductAttention" if plain == "Xla" else f"{plain}DotProductAttention"
    assert [row.op for row in plan] == [forward, f"{plain}DotProductAttentionVjp"]


@pytest.mark.parametrize("sq,sk", [(0, 12), (12, 0), (0, 0)])
@pytest.mark.parametrize("impl", ["xla", "xla_chunked", None])
def test_empty_sequences(impl, sq, sk):
    """No query rows: an empty output; no keys: every row attends to nothing -> zeros.
    Gradients have the inputs' shapes and are zero (kernels decline, see below)."""
    q, k, v = _inputs(sq=sq, sk=sk)
    bias = random_normal(7, (B, 1, sq, sk))

    def loss(q, k, v, bias):
        out = dot_product_attention(q, k, v, bias, is_causal=True, implementation=impl)
        return jnp.sum(out * 2.0), out

    (_, out), grads = fast_jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
        q, k, v, bias)
    assert out.shape == q.shape and not np.any(np.asarray(out))
    for grad, x in zip(grads, (q, k, v, bias), strict=True):
        assert grad.shape == x.shape and not np.any(np.asarray(grad))


def test_kernels_decline_empty_sequences():
    from tokamax_kernels.attention import PallasTritonFlashAttention

    q, k, v = _inputs(sq=0, sk=8)
    for op in (PallasTritonFlashAttention(interpret=True), CudnnDotProductAttention()):
        with pytest.raises(NotImplementedError, match="empty sequence"):
            op.check_supported(op.bind(q, k, v), None)
    XlaChunkedDotProductAttention().check_supported(
        XlaChunkedDotProductAttention().bind(q, k, v), None)


def _lse_loss(implementation):
    def f(q):
        out, lse = dot_product_attention(q, q, q, implementation=implementation,
                                         return_residual=True)
        return out.astype(jnp.float32).sum() + lse.astype(jnp.float32).sum()
    return f


def test_cudnn_backward_takes_no_lse_cotangent_and_none_moves_on(monkeypatch):
    """cuDNN's fused backward computes delta itself: a gradient through lse moves `None`
    on to another backward; `implementation="cudnn"` says why and what to do. A loss that
    uses only the output keeps cuDNN's backward (the lse cotangent is a symbolic zero)."""
    from tokamax_kernels.attention import cudnn

    monkeypatch.setattr(cudnn, "_require_cudnn_library", lambda: None)  # a CPU machine
    x = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
    with tokamax.core.targeting(H200):
        plan = tokamax.optimize(jax.grad(_lse_loss(None))).plan(x)
        assert [row.op for row in plan] == ["CudnnDotProductAttention", "XlaDotProductAttentionVjp"]
        out_only = tokamax.optimize(jax.grad(lambda q: dot_product_attention(
            q, q, q, return_residual=True)[0].astype(jnp.float32).sum())).plan(x)
        assert [row.op for row in out_only] == [
            "CudnnDotProductAttention", "CudnnDotProductAttentionVjp"]
        with pytest.raises(NotImplementedError, match="return_residual"):
            jax.jit(jax.grad(_lse_loss("cudnn"))).trace(x)
