"""Unusual but valid shapes and options, forward and gradient, against plain-jnp float32
HIGHEST references written here (not the families' own XLA references): lengths no block
divides, cross attention causal both ways, GQA 3:1 and MQA, odd head dims, zero-length
rows, windows wider than the sequence or (0, 0), tiny soft caps, norms over other axes,
empty groups, all-ignored labels, and activations that are not plain functions. Also the
regressions this audit found (see each test)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from conftest import assert_close, random_normal
from tokamax_kernels.attention.pallas_mosaic_tpu import PallasMosaicTpuFlashAttention
from tokamax_kernels.attention.pallas_mosaic_tpu_vjp import PallasMosaicTpuFlashAttentionVjp
from tokamax_kernels.attention.xla_chunked import XlaChunkedConfig, XlaChunkedDotProductAttention
from tokamax_kernels.gated_linear_unit.pallas_mosaic_tpu import PallasMosaicTpuGatedLinearUnit
from tokamax_kernels.layer_norm.pallas_mosaic_tpu import PallasMosaicTpuLayerNorm
from tokamax_kernels.layer_norm.pallas_mosaic_tpu_vjp import PallasMosaicTpuLayerNormVjp
from tokamax_kernels.linear_softmax_cross_entropy_loss.xla_chunked import (
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLossConfig,
)
from tokamax_kernels.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot

HIGHEST = jax.lax.Precision.HIGHEST


def _tpu_attention():
    return PallasMosaicTpuFlashAttention(
        interpret=True, vjp=PallasMosaicTpuFlashAttentionVjp(interpret=True))


ATTENTION_IMPLEMENTATIONS = {
    "none": lambda: None,
    "xla": lambda: "xla",
    "xla_chunked_odd": lambda: XlaChunkedDotProductAttention(config=XlaChunkedConfig(3, 5)),
}


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _out_and_grads(f, args, cotangent_seed, dtype=jnp.float32):
    """`(f(*args), vjp(random cotangent))` in one compiled program (eager op-by-op
    dispatch compiles every small op on its own, which dominated these tests' time)."""

    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(f, *args)
        cotangent = jax.tree.map(
            lambda a: random_normal(cotangent_seed, a.shape, dtype).astype(a.dtype), out)
        return out, vjp(cotangent)

    return run(*args)


def _attention_reference(q, k, v, *, is_causal=False, window=None, cap=None, q_lengths=None,
                         kv_lengths=None):
    """Plain jnp attention in float32 at HIGHEST; rows that see nothing give zeros."""
    q, k, v = _f32(q), _f32(k), _f32(v)
    t, n, d = q.shape[1:]
    s, kv_heads = k.shape[1:3]
    k, v = (jnp.repeat(x, n // kv_heads, axis=2) for x in (k, v))
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision=HIGHEST) / np.sqrt(d)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    qp, kp = jnp.arange(t)[:, None], jnp.arange(s)[None]
    keep = jnp.ones((q.shape[0], 1, t, s), bool)
    if is_causal:
        keep &= kp <= qp
    if window is not None:
        keep &= (kp >= qp - window[0]) & (kp <= qp + window[1])
    if q_lengths is not None:
        keep &= (qp[None] < jnp.asarray(q_lengths)[:, None, None])[:, None]
    if kv_lengths is not None:
        keep &= (kp[None] < jnp.asarray(kv_lengths)[:, None, None])[:, None]
    logits = jnp.where(keep, logits, -jnp.inf)
    peak = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True))
    p = jnp.where(keep, jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bnts,bsnd->btnd", p, v, precision=HIGHEST)


def _assert_gradient_close(got, expected):
    """`assert_close`, except that a gradient that is zero in math (dq and dk where every
    row sees one key: its softmax is constant) is compared in absolute terms: it comes
    out as float32 rounding around zero."""
    if float(jnp.max(jnp.abs(expected))) > 1e-3:
        assert_close(got, expected)
    else:
        assert float(jnp.max(jnp.abs(got - expected))) < 1e-5


# (batch, q_len, kv_len, heads, kv_heads, head_dim, options)
ATTENTION_CASES = {
    "t1_s1": (2, 1, 1, 2, 2, 8, {}),
    "causal_t5_s3": (2, 5, 3, 2, 1, 8, dict(is_causal=True)),
    "causal_gqa3_d40_t13_s17": (2, 13, 17, 6, 2, 40, dict(is_causal=True)),
    "mqa_d72": (2, 9, 11, 3, 1, 72, {}),
    "lengths_with_zero_rows": (3, 13, 17, 4, 2, 8, dict(
        is_causal=True, q_lengths=np.array([13, 0, 5], np.int32),
        kv_lengths=np.array([0, 17, 3], np.int32))),
    "window_0_0": (2, 13, 17, 2, 2, 8, dict(window=(0, 0))),
    "window_asymmetric_not_causal": (2, 13, 17, 2, 2, 8, dict(window=(1, 4))),
    "window_right_wider_than_seq": (2, 13, 17, 2, 2, 8, dict(window=(2, 100))),
    "soft_cap_tiny_window_gqa": (2, 11, 13, 6, 2, 16, dict(cap=0.5, is_causal=True,
                                                           window=(3, 0))),
}


# Every case in the chunked form (chunks of 3 x 5: no length here is a multiple, and the
# t1_s1 case holds a chunk longer than a length-1 sequence, which must still reshape);
# `None` (which runs `xla` on a CPU) and `xla` on a few.
_XLA_ONLY = ("mqa_d72", "window_right_wider_than_seq")
_ATTENTION_PARAMS = [
    *((case, "xla" if case in _XLA_ONLY else "xla_chunked_odd") for case in ATTENTION_CASES),
    ("soft_cap_tiny_window_gqa", "none")]


@pytest.mark.parametrize(("case", "implementation"), _ATTENTION_PARAMS)
def test_attention_unusual(case, implementation):
    _check_attention_case(case, ATTENTION_IMPLEMENTATIONS[implementation]())


def _check_attention_case(case: str, implementation) -> None:
    """Output and q/k/v gradients of `ATTENTION_CASES[case]` through `implementation`
    against the float32 reference, in one compiled program each."""
    b, t, s, n, kv, d, options = ATTENTION_CASES[case]
    q, k, v = (random_normal(0, (b, t, n, d)), random_normal(1, (b, s, kv, d)),
               random_normal(2, (b, s, kv, d)))

    def f(q, k, v):
        return tokamax.dot_product_attention(
            q, k, v, is_causal=options.get("is_causal", False),
            local_window_size=options.get("window"), logits_soft_cap=options.get("cap"),
            query_seq_lengths=options.get("q_lengths"),
            key_value_seq_lengths=options.get("kv_lengths"), implementation=implementation)

    out, grads = _out_and_grads(f, (q, k, v), 3)
    want, grads_ref = _out_and_grads(
        functools.partial(_attention_reference, **options), (q, k, v), 3)
    assert_close(out, want)
    for got, expected in zip(grads, grads_ref, strict=True):
        _assert_gradient_close(got, expected)


@pytest.mark.parametrize("case", ["causal_t5_s3", "lengths_with_zero_rows"])
def test_attention_unusual_mosaic_tpu_interpreted(case):
    _check_attention_case(case, _tpu_attention())


@pytest.mark.parametrize(("rank", "implementation"), [
    (4, "none"), (4, "xla_chunked_odd"), (3, "xla")])
def test_attention_sequence_lengths_as_lists(rank, implementation):
    """Regression: lengths given as Python lists (documented, as `jax.nn` takes them)
    raised `ValueError: ... must be an array, got list` for rank-4 inputs, where no
    folding ran to convert them."""
    b = 2 if rank == 4 else 1
    q, k = random_normal(0, (b, 5, 4, 8)), random_normal(1, (b, 7, 2, 8))
    q_lengths, kv_lengths = [5, 2][:b], [3, 7][:b]
    impl = ATTENTION_IMPLEMENTATIONS[implementation]()
    squeeze = (lambda x: x) if rank == 4 else (lambda x: x[0])
    got = tokamax.dot_product_attention(
        squeeze(q), squeeze(k), squeeze(k), query_seq_lengths=q_lengths,
        key_value_seq_lengths=tuple(kv_lengths), implementation=impl)
    want = _attention_reference(q, k, k, q_lengths=np.array(q_lengths),
                                kv_lengths=np.array(kv_lengths))
    assert_close(got, squeeze(want))


def test_attention_bias_moves_a_kernel_list_on():
    """A bias the Mosaic TPU kernel cannot take: named, it raises NotImplementedError
    naming the bias; in a list of implementations the call moves on to `xla`."""
    q, k = random_normal(0, (2, 5, 2, 8)), random_normal(1, (2, 7, 2, 8))
    bias = random_normal(2, (5, 7))
    with pytest.raises(NotImplementedError, match="bias"):
        tokamax.dot_product_attention(q, k, k, bias=bias, implementation=_tpu_attention())
    got = tokamax.dot_product_attention(q, k, k, bias=bias,
                                        implementation=[_tpu_attention(), "xla"])
    want = tokamax.dot_product_attention(q, k, k, bias=bias, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- layer norm --------------------------------------------------------------------------


def _norm_reference(x, scale, offset, axis, subtract_mean, residual):
    s = x if residual is None else x + residual
    xf = _f32(s)
    mean = jnp.mean(xf, axis, keepdims=True) if subtract_mean else 0.0
    centered = xf - mean
    y = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis, keepdims=True) + 1e-6)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    if scale is not None:
        y = y * _f32(scale).reshape(shape)
    if offset is not None:
        y = y + _f32(offset).reshape(shape)
    return y if residual is None else (y, _f32(s))


# (shape, axis, x dtype, scale dtype, offset?, subtract_mean, residual?)
NORM_CASES = {
    "features_1": ((2, 3, 1), -1, jnp.float32, jnp.float32, True, True, False),
    "features_3_4d": ((2, 3, 2, 3), -1, jnp.float32, jnp.float32, True, True, False),
    "features_1000": ((2, 2, 1000), -1, jnp.float32, jnp.float32, True, True, False),
    "axis_1_of_4d": ((2, 3, 4, 5), 1, jnp.float32, jnp.float32, True, True, False),
    "axis_0_residual": ((3, 2, 5), 0, jnp.float32, jnp.float32, False, True, True),
    "rms_bf16_f32_scale_residual": ((2, 4, 33), -1, jnp.bfloat16, jnp.float32, False, False,
                                    True),
    "f16_residual": ((2, 3, 17), -1, jnp.float16, jnp.float16, True, True, True),
    "rank_1": ((7,), -1, jnp.float32, jnp.float32, True, True, False),
}


def _tpu_norm():
    return PallasMosaicTpuLayerNorm(interpret=True,
                                    vjp=PallasMosaicTpuLayerNormVjp(interpret=True))


@pytest.mark.parametrize(("case", "implementation"), [
    *((case, "xla") for case in NORM_CASES if case != "rank_1"),
    ("rms_bf16_f32_scale_residual", "none"), ("axis_1_of_4d", "none"),
    *((case, "mosaic_tpu_or_xla") for case in (
        "features_1", "axis_1_of_4d", "rms_bf16_f32_scale_residual", "rank_1"))])
def test_layer_norm_unusual(case, implementation):
    shape, axis, dtype, scale_dtype, with_offset, subtract_mean, with_residual = NORM_CASES[case]
    impl = {"none": None, "xla": "xla",
            # The TPU kernel normalizes the last axis only; other axes move on to xla.
            "mosaic_tpu_or_xla": [_tpu_norm(), "xla"]}[implementation]
    features = shape[axis]
    x = random_normal(0, shape, dtype)
    scale = random_normal(1, (features,), scale_dtype)
    offset = random_normal(2, (features,), scale_dtype) if with_offset else None
    residual = random_normal(3, shape, dtype) if with_residual else None

    def f(x, scale, offset, residual):
        return tokamax.layer_norm(x, scale, offset, axis=axis, subtract_mean=subtract_mean,
                                  residual=residual, implementation=impl)

    def reference(x, scale, offset, residual):
        return _norm_reference(x, scale, offset, axis, subtract_mean, residual)

    out, grads = _out_and_grads(f, (x, scale, offset, residual), 4, dtype)
    f32 = lambda a: None if a is None else _f32(a)
    want, grads_ref = _out_and_grads(reference, tuple(map(f32, (x, scale, offset, residual))),
                                     4, dtype)
    for got, expected in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
        assert got.dtype == dtype
        assert_close(got, expected, dtype)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        # RMSNorm over one feature has a gradient that is rounding around zero.
        assert_close(got, expected, dtype, scale_rtol=2e-4 if case == "features_1" else None)


# --- ragged dot --------------------------------------------------------------------------


def _ragged_reference(lhs, rhs, sizes):
    lhs, rhs = _f32(lhs), _f32(rhs)
    ends = np.cumsum(sizes)
    rows = jnp.arange(lhs.shape[0])
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends, strict=True)):
        inside = ((rows >= start) & (rows < end))[:, None]
        out = out + jnp.where(inside, jnp.dot(lhs, rhs[g], precision=HIGHEST), 0.0)
    return out


# (m, k, n, group sizes, dtype)
RAGGED_CASES = {
    "empty_groups": (10, 5, 7, [0, 4, 0, 6, 0], jnp.float32),
    "one_group": (9, 3, 5, [9], jnp.float32),
    "all_rows_in_the_middle_group": (9, 3, 5, [0, 9, 0], jnp.float32),
    "sum_below_rows": (11, 3, 5, [2, 3], jnp.float32),
    "no_rows_in_any_group": (6, 3, 5, [0, 0], jnp.float32),
    "k1_n1": (8, 1, 1, [3, 5], jnp.float32),
    "odd_bf16": (37, 33, 17, [10, 0, 20], jnp.bfloat16),
}


@pytest.mark.parametrize(("case", "implementation"), [
    *((case, "xla") for case in RAGGED_CASES if case != "k1_n1"),
    ("empty_groups", "none"),
    *((case, "mosaic_tpu") for case in ("sum_below_rows", "k1_n1", "odd_bf16"))])
def test_ragged_dot_unusual(case, implementation):
    m, k, n, sizes, dtype = RAGGED_CASES[case]
    impl = {"none": None, "xla": "xla",
            "mosaic_tpu": PallasMosaicTpuRaggedDot(interpret=True)}[implementation]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = random_normal(0, (m, k), dtype), random_normal(1, (len(sizes), k, n), dtype)
    out, grads = _out_and_grads(
        lambda a, b: tokamax.ragged_dot(a, b, group_sizes, implementation=impl), (lhs, rhs), 2,
        dtype)
    want, grads_ref = _out_and_grads(lambda a, b: _ragged_reference(a, b, sizes),
                                     (_f32(lhs), _f32(rhs)), 2, dtype)
    assert out.dtype == dtype
    assert_close(out, want, dtype)
    for got, expected in zip(grads, grads_ref, strict=True):
        assert_close(got, expected, dtype)


# --- gated linear unit -------------------------------------------------------------------


class _Relu:
    """A callable instance as the activation (no `__qualname__` of its own)."""

    def __call__(self, z):
        return jax.nn.relu(z)


ACTIVATIONS = {
    "default_bilinear": (None, jax.nn.identity),
    "swish": (jax.nn.swish, jax.nn.swish),
    "gelu": (jax.nn.gelu, jax.nn.gelu),
    "partial_exact_gelu": (functools.partial(jax.nn.gelu, approximate=False),
                           functools.partial(jax.nn.gelu, approximate=False)),
    "callable_instance": (_Relu(), jax.nn.relu),
}


@pytest.mark.parametrize(("activation", "grouped"), [
    *((activation, False) for activation in ACTIVATIONS),
    ("default_bilinear", True), ("swish", True), ("partial_exact_gelu", True)])
def test_gated_linear_unit_unusual(activation, grouped):
    """Odd K and N, x with two leading axes (dense) or empty groups (grouped).

    Regression: a `functools.partial` or a callable instance as the activation raised
    `AttributeError: ... no attribute '__qualname__'` while the call's spec was written."""
    act, act_ref = ACTIVATIONS[activation]
    k, n = 7, 13
    sizes = [0, 4, 0, 3]
    x = random_normal(0, (10, k) if grouped else (2, 3, k))
    lead = (len(sizes),) if grouped else ()
    w = random_normal(1, (*lead, k, 2, n)) / np.sqrt(k)
    w_gate, w_up = w[..., 0, :], w[..., 1, :]
    group_sizes = jnp.asarray(sizes, jnp.int32) if grouped else None

    def reference(x, w_gate, w_up):
        if grouped:
            gate = jax.lax.ragged_dot(x, w_gate, group_sizes, precision=HIGHEST)
            up = jax.lax.ragged_dot(x, w_up, group_sizes, precision=HIGHEST)
        else:
            gate = jnp.einsum("...k,kn->...n", x, w_gate, precision=HIGHEST)
            up = jnp.einsum("...k,kn->...n", x, w_up, precision=HIGHEST)
        return act_ref(gate) * up

    # One reference (compiled once) for both calls below: the cotangent is the same.
    want, (dx_ref, dgate_ref, dup_ref) = _out_and_grads(reference, (x, w_gate, w_up), 2)
    for impl, fused in ((None, True), ("xla", False)):
        def f(x, weights, impl=impl):
            return tokamax.gated_linear_unit(x, weights, group_sizes=group_sizes,
                                             activation=act, implementation=impl)

        out, (dx, dw) = _out_and_grads(f, (x, w if fused else (w_gate, w_up)), 2)
        assert_close(out, want)
        assert_close(dx, dx_ref)
        dgate, dup = (dw[..., 0, :], dw[..., 1, :]) if fused else dw
        assert_close(dgate, dgate_ref)
        assert_close(dup, dup_ref)


def test_gated_linear_unit_odd_sizes_move_the_tpu_kernel_on():
    x, w = random_normal(0, (2, 3, 7)), random_normal(1, (7, 2, 13))
    kernel = PallasMosaicTpuGatedLinearUnit(interpret=True)
    with pytest.raises(NotImplementedError, match="K .* and N .* multiples of 128"):
        tokamax.gated_linear_unit(x, w, implementation=kernel)
    got = tokamax.gated_linear_unit(x, w, implementation=[kernel, "xla"])
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(tokamax.gated_linear_unit(x, w, implementation="xla")))


# --- linear softmax cross entropy --------------------------------------------------------


def _loss_reference(x, labels, w, reduction, cap):
    logits = jnp.einsum("...h,hv->...v", _f32(x), _f32(w), precision=HIGHEST)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    valid = labels >= 0
    picked = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], -1)[..., 0]
    losses = jnp.where(valid, jax.nn.logsumexp(logits, -1) - picked, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / jnp.maximum(valid.sum(), 1)


LOSS_IMPLEMENTATIONS = {
    "none": lambda: None,
    "xla": lambda: "xla",
    "xla_chunked_odd": lambda: XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=XlaChunkedLossConfig(3, 7)),
}


@pytest.mark.parametrize(("dtype", "labels_kind", "reduction", "implementation"), [
    *((jnp.float32, labels, reduction, "xla_chunked_odd")
      for labels in ("some_ignored", "all_ignored") for reduction in ("sum", "mean", "none")),
    (jnp.float32, "some_ignored", "mean", "xla"),
    (jnp.bfloat16, "some_ignored", "none", "xla_chunked_odd"),
    (jnp.bfloat16, "some_ignored", "mean", "none"), (jnp.float32, "all_ignored", "mean", "none")])
def test_linear_softmax_cross_entropy_unusual(dtype, labels_kind, reduction, implementation):
    """V = 1001, leading dims (b, s), a soft cap with "mean"."""
    lead, h, vocab = (2, 5), 24, 1001
    x = random_normal(0, (*lead, h), dtype)
    w = (random_normal(1, (h, vocab)) / np.sqrt(h)).astype(dtype)
    labels = jax.random.randint(jax.random.key(2), lead, 0, vocab)
    ignored = (jax.random.uniform(jax.random.key(3), lead) < 0.3
               if labels_kind == "some_ignored" else jnp.ones(lead, bool))
    labels = jnp.where(ignored, -1, labels)
    cap = 2.0 if reduction == "mean" else None
    impl = LOSS_IMPLEMENTATIONS[implementation]()

    def f(x, w):
        return tokamax.linear_softmax_cross_entropy_loss(
            x, labels, w, reduction=reduction, logits_soft_cap=cap, implementation=impl)

    out, grads = _out_and_grads(f, (x, w), 4)
    want, grads_ref = _out_and_grads(
        lambda x, w: _loss_reference(x, labels, w, reduction, cap), (_f32(x), _f32(w)), 4)
    assert out.dtype == jnp.float32 and out.shape == want.shape
    assert_close(out, want, dtype)  # the logits are x @ w in the inputs' dtype
    for got, expected in zip(grads, grads_ref, strict=True):
        assert got.dtype == dtype
        assert_close(got, expected, dtype)
