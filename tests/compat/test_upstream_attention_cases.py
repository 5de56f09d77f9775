"""Upstream Tokamax's attention cases run through `tokamax_pass.dot_product_attention`:
its api test's grids (GQA groups, vmap, mask modes) and the base test's shape cases
that the public function takes, with upstream's shapes and tolerances. The reference is
float32 attention at `Precision.HIGHEST`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from compat._upstream import NONE_ON_CPU, as_float32, assert_trees_all_close, random_arrays

HIGHEST = jax.lax.Precision.HIGHEST
# Upstream's api test runs its grids for None, "xla" and "xla_chunked" on CPU.
IMPLEMENTATIONS = (NONE_ON_CPU, "xla", "xla_chunked")


def _reference(q, k, v, bias=None, mask=None, *, is_causal=False, query_seq_lengths=None,
               key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None):
    """Float32 attention at HIGHEST precision, value head dim free, GQA by repetition."""
    q, k, v, bias = as_float32((q, k, v, bias))
    groups = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=HIGHEST) / jnp.sqrt(
        jnp.float32(q.shape[-1]))
    if bias is not None:
        logits = logits + bias
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    t, s = logits.shape[-2:]
    rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    keep = jnp.ones((t, s), bool)
    if is_causal:
        keep &= cols <= rows
    if local_window_size is not None:
        left, right = local_window_size
        keep &= (cols >= rows - left) & (cols <= rows + right)
    keep = jnp.broadcast_to(keep, logits.shape)
    if mask is not None:
        keep &= mask
    if key_value_seq_lengths is not None:
        keep &= cols < key_value_seq_lengths[:, None, None, None]
    if query_seq_lengths is not None:
        keep &= rows < query_seq_lengths[:, None, None, None]
    logits = jnp.where(keep, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True, initial=-jnp.inf))
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("...hqk,...khd->...qhd", probs, v, precision=HIGHEST)


def _cotangent(f, args, seed):
    """A random cotangent for `f(*args)` (its shape and dtype)."""
    out = jax.eval_shape(f, *args)
    (dout,) = random_arrays(seed, (out.shape, out.dtype))
    return dout


def _value_and_pullback(f, args, dout):
    """`f(*args)` and the pullback of `dout` (cast to the output's dtype), in one compiled
    program (eager op-by-op compiles each operation of `f` and its transpose)."""
    def run(args, dout):
        out, pullback = jax.vjp(f, *args)
        return out, pullback(dout.astype(out.dtype))

    return jax.jit(run)(args, dout)


def _check_vjp(f, f_ref, args, *, seed, atol, rtol, atol_grads=None, rtol_grads=None):
    """Value and gradients of `f` against `f_ref` (at float32 inputs) with a random
    cotangent."""
    dout = _cotangent(f, args, seed)
    expected, grads_ref = _value_and_pullback(f_ref, as_float32(args), dout)
    actual, grads = _value_and_pullback(f, args, dout)
    assert_trees_all_close(actual, expected, atol=atol, rtol=rtol)
    assert_trees_all_close(grads, grads_ref, atol=atol_grads or atol, rtol=rtol_grads or rtol)


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_dot_product_attention(implementation, dtype, group_num, use_vmap):
    """Upstream's api `test_dot_product_attention` (from JAX's `nn_test`): GQA groups,
    with and without a `vmap` over the batch, within 0.01."""
    b, s, t, n, h = 2, 128, 128, 4, 64
    q, k, v = random_arrays(0, ((b, t, n, h), dtype), ((b, s, n // group_num, h), dtype),
                            ((b, s, n // group_num, h), dtype))
    f = functools.partial(tokamax.dot_product_attention, implementation=implementation)
    if use_vmap:
        f = jax.vmap(f, in_axes=(0, 0, 0))
    _check_vjp(f, _reference, (q, k, v), seed=1, atol=0.01, rtol=0.01)


MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"),
              ("custom", "padding"), ("bias", "causal"), ("causal", "sliding_window"),
              ("causal", "custom")]


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mask_mode", MASK_MODES)
def test_dot_product_attention_mask(implementation, mask_mode):
    """Upstream's api `testDotProductAttentionMask`: bias, causal, padding, custom and
    sliding-window masks and their pairs, bfloat16, rows past the query lengths zeroed."""
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    b, s, t, n, h = 2, 256, 256, 4, 64
    dtype = jnp.bfloat16
    q, k, v, bias = random_arrays(2, ((b, t, n, h), dtype), ((b, s, n, h), dtype),
                                  ((b, s, n, h), dtype), ((1, n, t, s), dtype))
    bias = bias if "bias" in mask_mode else None
    is_causal = "causal" in mask_mode
    keywords = dict(is_causal=is_causal)
    if "padding" in mask_mode:
        keywords.update(query_seq_lengths=jnp.array([t // 2, t // 4], jnp.int32),
                        key_value_seq_lengths=jnp.array([s // 4, s // 2], jnp.int32))
    mask = None
    if "custom" in mask_mode:
        custom = (jnp.arange(t)[:, None] + jnp.arange(s)[None, :]) % 2 == 0
        mask = jnp.broadcast_to(custom, (b, 1, t, s))
    if "sliding_window" in mask_mode:
        keywords["local_window_size"] = (3, 2) if is_causal else (3, 0)

    def zero_padding_rows(out):
        if "padding" not in mask_mode:
            return out
        rows = jnp.arange(t)[None, :] < keywords["query_seq_lengths"][:, None]
        return out * rows[:, :, None, None]

    def f(q, k, v, bias):
        return zero_padding_rows(tokamax.dot_product_attention(
            q, k, v, bias, mask, implementation=implementation, **keywords))

    def f_ref(q, k, v, bias):
        return zero_padding_rows(_reference(q, k, v, bias, mask, **keywords))

    args = (q, k, v, bias)
    dout = _cotangent(f, args, 3)
    expected, grads_ref = _value_and_pullback(f_ref, as_float32(args), dout)
    actual, grads = _value_and_pullback(f, args, dout)
    assert_trees_all_close(actual, expected, atol=0.01, rtol=0.01)
    for got, want, tol in zip(grads, grads_ref, (0.02, 0.02, 0.015, 0.05), strict=True):
        if want is not None:
            assert_trees_all_close(got, want, atol=tol, rtol=tol)


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_dot_product_attention_bias_gradient(implementation, batch_size, use_vmap):
    """Upstream's api bias-gradient case: self-attention with a full bias and a key mask of
    shape (1, 1, S), optionally vmapped over the batch (rank-3 calls inside); output
    within 0.01, bias gradient within 0.25."""
    b, s, n, h = batch_size, 128, 4, 64
    x, bias = random_arrays(13, ((b, s, n, h), jnp.bfloat16), ((b, n, s, s), jnp.bfloat16))
    mask = jnp.ones((1, 1, s), jnp.bool_)

    def attention(fn):
        def f(x, bias):
            return fn(x, x, x, bias, mask)
        return jax.vmap(f) if use_vmap else f

    ours = attention(functools.partial(tokamax.dot_product_attention,
                                       implementation=implementation))
    ref = attention(_reference)
    dout = _cotangent(ours, (x, bias), 14)
    expected, (_, dbias_ref) = _value_and_pullback(ref, as_float32((x, bias)), dout)
    actual, (_, dbias) = _value_and_pullback(ours, (x, bias), dout)
    assert_trees_all_close(actual, expected, atol=0.01, rtol=0.01)
    assert_trees_all_close(dbias, dbias_ref, atol=0.25, rtol=0.25)


@pytest.mark.exhaustive
@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", NONE_ON_CPU])
@pytest.mark.parametrize("input_dim", [24, 128])
@pytest.mark.parametrize("output_dim", [64, 112])
def test_different_output_head_dim(implementation, input_dim, output_dim):
    """Upstream's `test_different_output_head_dim`: a value head dim other than the
    query's (MLA), float32, within 2e-6 (gradients 5e-6)."""
    q, k, v = random_arrays(4, ((2, 1024, 4, input_dim), jnp.float32),
                            ((2, 1024, 4, input_dim), jnp.float32),
                            ((2, 1024, 4, output_dim), jnp.float32))
    f = functools.partial(tokamax.dot_product_attention, precision=HIGHEST,
                          implementation=implementation)
    _check_vjp(f, _reference, (q, k, v), seed=5, atol=2e-6, rtol=2e-7, atol_grads=5e-6,
               rtol_grads=5e-7)


@pytest.mark.parametrize("batch", [(), (3, 2)])
def test_value_head_dim_with_other_batch_ranks(batch):
    """No batch axis, or several (upstream's public function takes both), with a value
    head dim other than the query's: the output takes the value's head dim."""
    q, k, v = random_arrays(11, ((*batch, 64, 4, 32), jnp.float32),
                            ((*batch, 64, 2, 32), jnp.float32), ((*batch, 64, 2, 8), jnp.float32))
    f = functools.partial(tokamax.dot_product_attention, precision=HIGHEST, implementation="xla")
    _check_vjp(f, _reference, (q, k, v), seed=12, atol=2e-6, rtol=2e-7, atol_grads=5e-6,
               rtol_grads=5e-7)


def _triton_interpreted():
    from tokamax_kernels.attention.pallas_triton import (
        PallasTritonFlashAttention,
        PallasTritonFlashAttentionConfig,
    )
    from tokamax_kernels.attention.pallas_triton_vjp import (
        PallasTritonFlashAttentionVjp,
        PallasTritonFlashAttentionVjpConfig,
    )

    return PallasTritonFlashAttention(
        interpret=True,
        config=PallasTritonFlashAttentionConfig(block_q=16, block_k=16, num_warps=4,
                                                num_stages=2),
        vjp=PallasTritonFlashAttentionVjp(
            interpret=True, config=PallasTritonFlashAttentionVjpConfig(16, 16, 4, 2, 16, 16, 4, 2)))


@pytest.mark.parametrize(("value_dim", "keywords"), [
    (48, {}), pytest.param(8, {"is_causal": True}, marks=pytest.mark.slow),
    pytest.param(40, {"key_value_seq_lengths": jnp.array([20, 40])}, marks=pytest.mark.slow)])
def test_triton_value_head_dim(value_dim, keywords):
    """The Triton kernels (Pallas interpret mode) take a value head dim other than the
    query's: padded, causal and length-masked calls with GQA, forward and gradient."""
    q, k, v = random_arrays(9, ((2, 40, 4, 32), jnp.float32), ((2, 40, 2, 32), jnp.float32),
                            ((2, 40, 2, value_dim), jnp.float32))
    f = functools.partial(tokamax.dot_product_attention, precision=HIGHEST,
                          implementation=_triton_interpreted(), **keywords)
    _check_vjp(f, functools.partial(_reference, **keywords), (q, k, v), seed=10, atol=2e-5,
               rtol=1e-5)


def test_value_head_dim_moves_past_kernels():
    """A kernel that tiles one head dim for query and value (here the Mosaic TPU one, in
    interpret mode) raises `NotImplementedError` for another value head dim, so a sequence
    moves on."""
    from tokamax_kernels.attention.pallas_mosaic_tpu import PallasMosaicTpuFlashAttention

    q, v = random_arrays(6, ((2, 64, 4, 32), jnp.float32), ((2, 64, 4, 16), jnp.float32))
    kernel = PallasMosaicTpuFlashAttention(interpret=True)
    with pytest.raises(NotImplementedError, match="value head_dim"):
        tokamax.dot_product_attention(q, q, v, implementation=kernel)
    out = tokamax.dot_product_attention(q, q, v, implementation=(kernel, "xla"))
    assert out.shape == (2, 64, 4, 16)


# Upstream's base-test cases that the public function takes: query shape, and where they
# differ from the defaults, key/value shape, bias and mask shapes, dtype, keywords and the
# forward atol (upstream's rules: rtol = atol / 10, gradients at 2 * atol, at least 5e-6).
F32 = jnp.float32
SHAPE_CASES = {
    "self_attention_float32": dict(q=(2, 1024, 4, 64)),
    "self_attention_bfloat16": dict(q=(2, 1024, 4, 64), dtype=jnp.bfloat16, atol=1e-2),
    "self_attention_float16": dict(q=(2, 1024, 4, 64), dtype=jnp.float16, atol=5e-4),
    "cross_attention": dict(q=(2, 1024, 4, 64), kv=(2, 1536, 4, 64)),
    "cross_attention_bias": dict(q=(2, 1024, 4, 64), kv=(2, 1536, 4, 64),
                                 bias=(2, 4, 1024, 1536), atol=3e-6),
    "multi_query": dict(q=(2, 1024, 4, 64), kv=(2, 1024, 1, 64)),
    "grouped_query": dict(q=(2, 1024, 16, 64), kv=(2, 1024, 4, 64)),
    "no_batch_dim": dict(q=(1024, 4, 64)),
    "multiple_batch_dims": dict(q=(2, 3, 4, 256, 4, 64)),
    "non_power_of_two_q_seq_len": dict(q=(2, 112, 4, 64), kv=(2, 1024, 4, 64)),
    "non_power_of_two_head_dim": dict(q=(2, 1024, 4, 48)),
    "small_non_power_of_two_head_dim": dict(q=(2, 1024, 4, 24)),
    "causal_mask": dict(q=(2, 1024, 4, 64), keywords={"is_causal": True}),
    "causal_mask_cross_attention_512": dict(q=(2, 1024, 4, 64), kv=(2, 512, 4, 64),
                                            keywords={"is_causal": True}, atol=1e-5),
    "causal_mask_cross_attention_539": dict(q=(2, 1024, 4, 64), kv=(2, 539, 4, 64),
                                            keywords={"is_causal": True}, atol=1e-5),
    "padding_mask": dict(q=(2, 1024, 4, 64), keywords={
        "query_seq_lengths": jnp.array([456, 987]),
        "key_value_seq_lengths": jnp.array([123, 999])}),
    # Upstream's `CausalMask(window_size=128)`: each row sees itself and 127 keys before.
    "local_attention": dict(q=(2, 1024, 4, 64),
                            keywords={"is_causal": True, "local_window_size": (127, 0)}),
    "tanh_clipping": dict(q=(2, 1024, 4, 64), keywords={"logits_soft_cap": 10.0}, atol=2e-6),
    "tanh_clipping_bias": dict(q=(2, 1024, 4, 64), bias=(2, 4, 1024, 1024),
                               keywords={"logits_soft_cap": 10.0}, atol=2e-6),
    **{f"small_sequences_{sq}_{sk}": dict(q=(2, sq, 4, 64), kv=(2, sk, 4, 64), uniform=True,
                                          atol_grads=2e-5)
       for sq, sk in ((8, 256), (256, 8), (7, 8), (15, 16), (15, 15))},
    **{f"bias_{'x'.join(map(str, shape))}": dict(q=(2, 1024, 4, 64), bias=shape, atol=5e-6)
       for shape in ((2, 4, 1024, 1024), (2, 4, 1024, 1), (2, 4, 1, 1024), (2, 1, 1024, 1024),
                     (1, 4, 1024, 1024), (4, 1024, 1024))},
    **{f"mask_{'x'.join(map(str, shape))}": dict(q=(2, 1024, 4, 64), mask=shape)
       for shape in ((2, 4, 1024, 1024), (2, 4, 1024, 1), (2, 4, 1, 1024), (2, 1, 1024, 1024),
                     (1, 4, 1024, 1024), (2, 1, 1024, 1), (1, 4, 1024, 1), (2, 1, 1, 1024),
                     (1, 4, 1, 1024))},
}


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_attention_shapes(implementation, case):
    spec = SHAPE_CASES[case]
    dtype, q_shape = spec.get("dtype", F32), spec["q"]
    kv_shape = spec.get("kv", q_shape)
    if spec.get("uniform"):  # upstream keeps values away from 0 here (heavy padding)
        keys = jax.random.split(jax.random.key(7), 3)
        q, k, v = (jax.random.uniform(key, shape, F32, 1.0, 2.0) for key, shape in
                   zip(keys, (q_shape, kv_shape, kv_shape), strict=True))
    else:
        q, k, v = random_arrays(7, (q_shape, dtype), (kv_shape, dtype), (kv_shape, dtype))
    bias = None if "bias" not in spec else random_arrays(15, (spec["bias"], dtype))[0]
    mask = None if "mask" not in spec else random_arrays(16, (spec["mask"], jnp.bool_))[0]
    keywords = spec.get("keywords", {})
    precision = HIGHEST if dtype == F32 else None
    atol = spec.get("atol", 1e-6)

    def f(q, k, v, bias):
        return tokamax.dot_product_attention(q, k, v, bias, mask, precision=precision,
                                             implementation=implementation, **keywords)

    def f_ref(q, k, v, bias):
        return _reference(q, k, v, bias, mask, **keywords)

    atol_grads = spec.get("atol_grads", max(2 * atol, 5e-6))
    _check_vjp(f, f_ref, (q, k, v, bias), seed=8, atol=atol, rtol=max(atol / 10, 1e-6),
               atol_grads=atol_grads, rtol_grads=max(atol_grads / 10, 1e-6))
