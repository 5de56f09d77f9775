"""Bad input to any public op or API is a clear error naming the argument, never a crash
deep inside JAX, XLA or a kernel's lowering and never a silently wrong result.

Each op family's own test file has its table of bad shapes and dtypes; this file holds
what cuts across families (`implementation=`, static flags and numbers, the
activation of a gated linear unit) and the cases an audit found crashing deep or
returning silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from tokamax_kernels.attention import (
    CudnnDotProductAttention,
    PallasMosaicGpuFlashAttention,
    PallasTritonFlashAttention,
)
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.linear_softmax_cross_entropy_loss.base import LinearSoftmaxCrossEntropyLoss
from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot
from tokamax_kernels.ragged_dot.base import RaggedDot
from tokamax_pass.core.spec import SpecError

Q = jnp.ones((2, 16, 4, 32))
KV = jnp.ones((2, 16, 2, 32))
X = jnp.ones((8, 32))
LHS, RHS = jnp.ones((32, 16)), jnp.ones((4, 16, 8))
SIZES = jnp.array([8, 8, 8, 8], jnp.int32)
W = jnp.ones((32, 2, 8))
LABELS = jnp.arange(8, dtype=jnp.int32)
LCE_W = jnp.ones((32, 64))


def _attention(**kwargs):
    return lambda implementation: tokamax.dot_product_attention(
        Q, KV, KV, **kwargs, implementation=implementation)


def _norm(**kwargs):
    return lambda implementation: tokamax.layer_norm(X, None, None, **kwargs,
                                                     implementation=implementation)


def _lce(**kwargs):
    return lambda implementation: tokamax.linear_softmax_cross_entropy_loss(
        X, LABELS, LCE_W, **kwargs, implementation=implementation)


def _glu(**kwargs):
    return lambda implementation: tokamax.gated_linear_unit(X, W, **kwargs,
                                                            implementation=implementation)


def _ragged(lhs=LHS, **kwargs):
    return lambda implementation: tokamax.ragged_dot(lhs, RHS.astype(lhs.dtype), SIZES,
                                                     **kwargs, implementation=implementation)


def _traced_epsilon(implementation):
    return jax.jit(lambda e: tokamax.layer_norm(X, None, None, epsilon=e,
                                                implementation=implementation))(1e-5)


def _sum_activation(a):
    return a.sum(-1)  # a reduction: broadcast against `up`, it would give wrong values


# (error, match, call): the call takes `implementation`; `match` names the argument.
BAD_ARGUMENTS = [
    # Crashed deep or returned silently before (the audit's findings).
    (ValueError, "logits_soft_cap", _attention(logits_soft_cap=float("inf"))),
    (ValueError, "logits_soft_cap", _attention(logits_soft_cap=True)),
    (TypeError, "is_causal", _attention(is_causal="no")),
    (TypeError, "is_causal", _attention(is_causal=None)),
    (TypeError, "is_causal", _attention(is_causal=jnp.array(True))),
    (ValueError, "epsilon", _norm(epsilon="a")),
    (ValueError, "epsilon", _norm(epsilon=float("inf"))),
    (ValueError, "epsilon", _traced_epsilon),
    (TypeError, "subtract_mean", _norm(subtract_mean="no")),
    (TypeError, "activation", _glu(activation=lambda a, b: a)),
    (ValueError, "activation", _glu(activation=_sum_activation)),
    (ValueError, "lhs", _ragged(lhs=LHS.astype(jnp.complex64))),
    (ValueError, "logits_soft_cap", _lce(logits_soft_cap=float("inf"))),
    # Already clear: kept so they stay so.
    (ValueError, "logits_soft_cap", _attention(logits_soft_cap=float("nan"))),
    (ValueError, "logits_soft_cap", _attention(logits_soft_cap=0.0)),
    (ValueError, "local_window_size", _attention(local_window_size=2.5)),
    (ValueError, "local_window_size", _attention(local_window_size=(1, None))),
    (ValueError, "precision", _attention(precision=7)),
    (ValueError, "epsilon", _norm(epsilon=float("nan"))),
    (ValueError, "axis", _norm(axis=0.5)),
    (ValueError, "activation", _glu(activation="swish")),
    (ValueError, "reduction", _lce(reduction=None)),
    (ValueError, "logits_soft_cap", _lce(logits_soft_cap=-1.0)),
    (ValueError, "preferred_element_type", _ragged(preferred_element_type="bogus")),
]


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("error,match,call", BAD_ARGUMENTS,
                         ids=[f"{m}-{i}" for i, (_, m, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_name_the_argument(error, match, call, implementation):
    with pytest.raises(error, match=match):
        call(implementation)


FOUND = 13  # BAD_ARGUMENTS[:FOUND] are the audit's findings; the last has no Triton kernel


@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("error,match,call", BAD_ARGUMENTS[:FOUND],
                         ids=[f"{m}-{i}" for i, (_, m, _) in enumerate(BAD_ARGUMENTS[:FOUND])])
def test_kernels_report_bad_arguments_before_the_platform(error, match, call, implementation):
    """A kernel's `bind` (the family's) reports a bad argument, not 'runs on cuda, not cpu'."""
    if implementation == "triton" and call is BAD_ARGUMENTS[FOUND - 1][2]:
        pytest.skip("the LM-head loss has no Triton kernel")
    with pytest.raises(error, match=match):
        call(implementation)


def test_static_numbers_accept_numpy_and_concrete_scalars():
    """What users pass for a number: NumPy scalars and concrete 0-d arrays still work.
    An attention `scale` of them was rejected ("must be a finite Python number"), though
    `jax.nn.dot_product_attention` takes `scale=1 / jnp.sqrt(head_dim)`."""
    expected = tokamax.layer_norm(X, None, None, epsilon=1e-5)
    for epsilon in (np.float32(1e-5), jnp.float32(1e-5), 1e-5):
        np.testing.assert_allclose(tokamax.layer_norm(X, None, None, epsilon=epsilon), expected)
    q = jax.random.normal(jax.random.key(0), Q.shape)
    expected = tokamax.dot_product_attention(q, KV, KV, scale=0.125)
    for scale in (np.float32(0.125), 1 / jnp.sqrt(64.0)):
        np.testing.assert_allclose(tokamax.dot_product_attention(q, KV, KV, scale=scale),
                                   expected)
    tokamax.dot_product_attention(Q, KV, KV, logits_soft_cap=np.float32(30.0),
                                  is_causal=np.bool_(True))
    tokamax.gated_linear_unit(X, W, activation=lambda a: a.astype(jnp.int32))


def _jitted(function, *args, **statics):
    """`jax.jit(function)(*args, **statics)`: jit traces keyword arguments too, so each
    static option arrives as a tracer although the user passed a Python value."""
    return lambda implementation: jax.jit(function, static_argnames="implementation")(
        *args, **statics, implementation=implementation)


KEYS = jax.random.split(jax.random.key(0), 8)  # PRNG keys where floats belong: a mix-up


# A third audit: each crashed deep (a segmentation fault; JAX's "Cannot interpret
# 'key<fry>' as a data type") or named the argument with a message that misled ("is_causal
# must be True or False" for `is_causal=True` traced by an enclosing jit).
THIRD_AUDIT = [
    (ValueError, "is_causal is a static argument",
     _jitted(tokamax.dot_product_attention, Q, KV, KV, is_causal=True)),
    (ValueError, "scale is a static argument",
     _jitted(tokamax.dot_product_attention, Q, KV, KV, scale=0.125)),
    (ValueError, "local_window_size is a static argument",
     _jitted(tokamax.dot_product_attention, Q, KV, KV, local_window_size=(4, 0))),
    (ValueError, "return_residual is a static argument",
     _jitted(tokamax.dot_product_attention, Q, KV, KV, return_residual=True)),
    (ValueError, "axis is a static argument .*static_argnames",
     _jitted(tokamax.layer_norm, X, None, None, axis=-1)),
    (ValueError, "subtract_mean is a static argument",
     _jitted(tokamax.layer_norm, X, None, None, subtract_mean=False)),
    # A NumPy ufunc: "cannot create weak reference to 'numpy.ufunc' object" the first
    # time, a segmentation fault inside jax.jit the next.
    (ValueError, "activation must be a function JAX can trace", _glu(activation=np.tanh)),
    (ValueError, "x must be a floating-point array .*got key<fry>",
     lambda implementation: tokamax.layer_norm(KEYS, None, None,
                                               implementation=implementation)),
    (ValueError, "bias must be a floating-point array .*got key<fry>",
     _attention(bias=KEYS[:1].reshape(1, 1, 1, 1))),
    (ValueError, "weights must be a floating-point array .*got key<fry>",
     lambda implementation: tokamax.gated_linear_unit(
         X, jax.random.split(jax.random.key(0), W.shape), implementation=implementation)),
]


@pytest.mark.parametrize("implementation", [None, "xla", "triton", "mosaic"])
@pytest.mark.parametrize("error,match,call", THIRD_AUDIT,
                         ids=[f"{i}-{m.split()[0]}" for i, (_, m, _) in enumerate(THIRD_AUDIT)])
def test_third_audit_names_the_argument(error, match, call, implementation):
    """Kernels too: the family's `bind` (or the public function) reports it, not the
    platform."""
    with pytest.raises(error, match=match):
        call(implementation)


def test_static_argnames_is_the_fix_the_message_gives():
    """What the traced-static message tells the user to do works."""
    out = jax.jit(tokamax.dot_product_attention, static_argnames=("is_causal",))(
        Q, KV, KV, is_causal=True)
    np.testing.assert_allclose(out, tokamax.dot_product_attention(Q, KV, KV, is_causal=True))


def test_numpy_float64_arrays_are_the_float32_jax_takes_them_as():
    """NumPy's default float64 is float32 to JAX without x64; the checks saw two dtypes
    where a NumPy array met a JAX one or a `jax.grad` tracer of one ("query, key and value
    must share a dtype, got float32, float64, float64" for three NumPy arrays)."""
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((2, 8, 4, 16)), rng.standard_normal((2, 8, 2, 16))
    grad = jax.grad(lambda q: tokamax.dot_product_attention(q, kv, kv).sum())(q)
    expected = jax.grad(lambda q: jax.nn.dot_product_attention(q, kv, kv).sum())(
        jnp.asarray(q))
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    x = rng.standard_normal((8, 32))
    y, s = tokamax.layer_norm(x, None, None, residual=X)
    np.testing.assert_allclose(s, x + X, rtol=1e-6)
    assert y.dtype == jnp.float32
    loss = tokamax.linear_softmax_cross_entropy_loss(x, LABELS, LCE_W)
    np.testing.assert_allclose(loss, tokamax.linear_softmax_cross_entropy_loss(
        jnp.asarray(x), LABELS, LCE_W))
    weights = rng.standard_normal((2, 32, 2, 8))
    out = tokamax.gated_linear_unit(X, weights, group_sizes=jnp.array([4, 4], jnp.int32))
    assert out.shape == (8, 8) and out.dtype == jnp.float32


@pytest.mark.parametrize("implementation,match", [
    (5, "implementation must be None, a name"),
    (LayerNorm, "implementation must be None, a name"),  # a class, not an instance
    (LayerNorm(), "another family.*layer_norm"),
    (PallasTritonFlashAttention(), None),  # the family's own op: fine
    ([LayerNorm(), "xla"], "another family"),
])
def test_implementation_of_another_family_is_a_type_error(implementation, match):
    if match is None:
        with pytest.raises(NotImplementedError, match="not on cpu"):
            tokamax.dot_product_attention(Q, KV, KV, implementation=implementation)
        return
    with pytest.raises(TypeError, match=match):
        tokamax.dot_product_attention(Q, KV, KV, implementation=implementation)


@pytest.mark.parametrize("call", [
    lambda: tokamax.layer_norm(X, None, None, implementation=RaggedDot()),
    lambda: tokamax.ragged_dot(LHS, RHS, SIZES, implementation=GatedLinearUnit()),
    lambda: tokamax.gated_linear_unit(X, W, implementation=LinearSoftmaxCrossEntropyLoss()),
    lambda: tokamax.linear_softmax_cross_entropy_loss(X, LABELS, LCE_W,
                                                      implementation=LayerNorm()),
    lambda: tokamax.layer_norm(X, None, None, implementation=LayerNorm().vjp_op()),
])
def test_every_family_rejects_foreign_ops_and_vjp_ops(call):
    with pytest.raises(TypeError, match="implementation=.*another family"):
        call()


def test_ragged_dot_float64_preferred_type_is_float32_without_x64():
    """It crashed in MLIR verification; `jax.lax` takes it as float32 without x64."""
    out = tokamax.ragged_dot(LHS, RHS, SIZES, preferred_element_type=jnp.float64)
    assert out.dtype == jnp.float32


def test_empty_batch_attention():
    """`xla_chunked` crashed (integer modulo by zero) on an empty batch; kernels decline it
    (a grid with no blocks) so `None` computes it in XLA."""
    q, kv = Q[:0], KV[:0]
    for implementation in (None, "xla", "xla_chunked"):
        out = tokamax.dot_product_attention(q, kv, kv, implementation=implementation)
        assert out.shape == q.shape
    for op in (PallasTritonFlashAttention(interpret=True), CudnnDotProductAttention(),
               PallasMosaicGpuFlashAttention()):
        with pytest.raises(NotImplementedError, match="batch=0"):
            op.check_supported(op.bind(q, kv, kv), None)


def test_mosaic_gpu_ragged_dot_declines_zero_groups():
    op = PallasMosaicGpuRaggedDot()
    lhs, rhs = jnp.ones((128, 128), jnp.bfloat16), jnp.ones((0, 128, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="at least one group"):
        op.check_supported(op.bind(lhs, rhs, jnp.zeros((0,), jnp.int32)), None)
    out = tokamax.ragged_dot(lhs, rhs, jnp.zeros((0,), jnp.int32))
    assert out.shape == (128, 128) and not np.any(np.asarray(out))


@pytest.mark.parametrize("bad,error,match", [
    (None, TypeError, "path_or_file"),
    ("missing.json", FileNotFoundError, "missing.json"),
    ("corrupt.json", SpecError, "not valid JSON"),
    ("list.json", SpecError, "not a tokamax_pass AutotuningResult"),
])
def test_autotuning_result_load_errors(tmp_path, bad, error, match):
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(error, match=match):
        tokamax.AutotuningResult.load(None if bad is None else tmp_path / bad)


@pytest.mark.parametrize("call,error,match", [
    (lambda: tokamax.autotune(5, X), TypeError, "f must be a callable"),
    (lambda: tokamax.optimize(5), TypeError, "fun must be callable"),
    (lambda: tokamax.autotune(lambda a: tokamax.layer_norm(a, None, None), "x"), ValueError,
     "x must be an array"),
])
def test_autotune_and_optimize_reject_what_they_cannot_run(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_gpu_kernel_exported_from_cpu_says_how_to_name_the_device():
    """`jax.export(..., platforms=["cuda"])` does not change the platform ops are traced
    for: the error names the device-kind argument that does."""
    f = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation="triton"))
    with pytest.raises(NotImplementedError, match=r"not on cpu.*device_kind='NVIDIA H200'"):
        jax.export.export(f, platforms=["cuda"])(Q, KV, KV)
    with pytest.raises(NotImplementedError) as raised:
        tokamax.dot_product_attention(Q, KV, KV, implementation="triton")
    assert "tokamax_pass.export(fun" in str(raised.value)
    assert "tokamax-pass export --platforms cuda --device-kind 'NVIDIA H200'" in str(raised.value)
    with tokamax.core.targeting("TPU v6 lite"), pytest.raises(NotImplementedError) as raised:
        jax.jit(f).trace(Q, KV, KV)
    assert "not on tpu" in str(raised.value) and "device_kind" not in str(raised.value)
    x = jnp.ones((4, 128), jnp.float32)
    with pytest.raises(NotImplementedError,
                       match=r"platforms=\['tpu'\], device_kind='TPU v6 lite'"):
        tokamax.layer_norm(x, None, None, implementation="mosaic_tpu")
