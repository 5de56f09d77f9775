"""PallasMosaicTpuFlashAttention and its VJP on CPU: forward and gradients in Pallas interpret
mode against the float32 reference (causal, GQA, lengths, window, soft cap, bf16), the
forward kernel in the TPU interpreter, and lowering for TPUs (`tpu_custom_call`) by
`jax.export` from this CPU machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import assert_close, measured, random_normal, reference_precision
from tokamax_kernels.attention import _mosaic_tpu_common as tpu
from tokamax_kernels.attention import api
from tokamax_kernels.attention._mosaic_tpu_fwd_kernel import flash_attention_forward
from tokamax_kernels.attention.base import DotProductAttention
from tokamax_kernels.attention.pallas_mosaic_tpu import Config, PallasMosaicTpuFlashAttention
from tokamax_kernels.attention.pallas_mosaic_tpu_vjp import PallasMosaicTpuFlashAttentionVjp
from tokamax_pass import core

# GQA (4 query heads over 2 kv heads), cross attention, lengths the 32-row blocks do not
# divide (padded), and a grid of 2 x 2 blocks per head so blocks are skipped.
B, SQ, SK, H, HKV, D = 2, 40, 56, 4, 2, 64
BLOCKS = Config(32, 32)
OPTIONS = {
    "full": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(8, 3)),
    "soft_cap_causal": dict(logits_soft_cap=2.0, is_causal=True),
    # Batch row 0 sees 3 keys; row 1 has 17 queries (the rest return zeros).
    "lengths_causal": dict(query_seq_lengths=np.array([40, 17], np.int32),
                           key_value_seq_lengths=np.array([3, 50], np.int32), is_causal=True),
}


def _inputs(dtype=jnp.float32, d=D):
    return (random_normal(0, (B, SQ, H, d), dtype), random_normal(1, (B, SK, HKV, d), dtype),
            random_normal(2, (B, SK, HKV, d), dtype))


def _op():
    return PallasMosaicTpuFlashAttention(
        interpret=True, config=BLOCKS,
        vjp=PallasMosaicTpuFlashAttentionVjp(interpret=True, config=BLOCKS))


def _reference(q, k, v, **options):
    with reference_precision():
        return DotProductAttention()(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), **options)


@pytest.mark.parametrize("name", OPTIONS)
def test_forward_matches_reference(name):
    q, k, v = _inputs()
    got = _op()(q, k, v, **OPTIONS[name])
    assert_close(got, _reference(q, k, v, **OPTIONS[name]))
    if name == "lengths_causal":
        np.testing.assert_array_equal(np.asarray(got[1, 17:]), 0.0)


GRADIENT_OPTIONS = {
    "causal": OPTIONS["causal"],
    "window_soft_cap": dict(local_window_size=(8, 3), logits_soft_cap=2.0),
    "lengths_causal": OPTIONS["lengths_causal"],
}


@pytest.mark.parametrize("name", GRADIENT_OPTIONS)
def test_gradients_match_reference(name):
    q, k, v = _inputs()
    ct = random_normal(3, q.shape)

    def loss(impl, q, k, v):
        return (impl(q, k, v, **GRADIENT_OPTIONS[name]) * ct).sum()

    with reference_precision():
        want = jax.grad(lambda *a: loss(DotProductAttention(), *a), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: loss(_op(), *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_bf16_against_float32_reference():
    q, k, v = _inputs(jnp.bfloat16)
    got = _op()(q, k, v, is_causal=True)
    assert got.dtype == jnp.bfloat16
    assert_close(got, _reference(q, k, v, is_causal=True), jnp.bfloat16)


def test_forward_kernel_in_the_tpu_interpreter():
    """The kernel alone under `pltpu.InterpretParams` (TPU block pipelining, NaN VMEM)."""
    q, k, v = _inputs()
    options = dict(OPTIONS["lengths_causal"], scale=D ** -0.5, local_window_size=None,
                   logits_soft_cap=None, precision=None)
    spec = tpu.kernel_spec(options, SQ, SK)
    out, _ = flash_attention_forward(
        tpu.to_kernel_layout(q, 64), tpu.to_kernel_layout(k, 64), tpu.to_kernel_layout(v, 64),
        tpu.lengths(jnp.asarray(options["query_seq_lengths"]), B, SQ),
        tpu.lengths(jnp.asarray(options["key_value_seq_lengths"]), B, SK),
        spec=spec, block_q=32, block_k=32, interpret=pltpu.InterpretParams())
    assert_close(tpu.from_kernel_layout(out, SQ), _reference(q, k, v, **OPTIONS["lengths_causal"]))


def test_unsupported_inputs_fall_back():
    q, k, v = _inputs()
    bias = random_normal(4, (1, 1, SQ, SK))
    with pytest.raises(NotImplementedError, match="no bias"):
        _op()(q, k, v, bias)
    got = api.dot_product_attention(q, k, v, bias, implementation=(_op(), "xla"))
    assert_close(got, DotProductAttention()(q, k, v, bias))
    with pytest.raises(ValueError, match="block_q must be a positive multiple of 16"):
        Config(24, 32)


def test_heuristics_follow_the_tpu_generation():
    ba = PallasMosaicTpuFlashAttention().bind(*(jax.ShapeDtypeStruct((4, 8192, 16, 128),
                                                                     jnp.bfloat16),) * 3)
    with core.targeting("TPU v6 lite"):
        assert ba.heuristics_config == Config(512, 256)
    with core.targeting("TPU v5p"):
        assert ba.heuristics_config == Config(256, 128)
        assert len(ba.autotuning_configs) == 9


@pytest.mark.parametrize("head_dim", [128, 256])
def test_lowers_for_tpu_forward_and_gradients(head_dim):
    def f(q, k, v):
        def loss(q, k, v):
            out = api.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")
            return out.astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((2, 1024, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16)
    with core.targeting("TPU v6 lite"):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(q, kv, kv).mlir_module()
    assert text.count("tpu_custom_call") == 3  # forward, dK/dV, dQ
    assert "PallasMosaicTpuFlashAttention" in text
    assert "PallasMosaicTpuFlashAttentionVjp" in text


def test_seed_snippet_binds_on_cpu():
    import tokamax_pass as tokamax

    q, k, v = _inputs(jnp.bfloat16)
    ba = tokamax.PallasMosaicTpuAttention.bind(q, k, v)
    assert type(ba.op) is tokamax.PallasMosaicTpuFlashAttention
    with pytest.raises(NotImplementedError, match="tpu"):
        tokamax.PallasMosaicTpuAttention()(q, k, v)  # on CPU only with interpret=True


@pytest.mark.parametrize("name", ["cudnn", "triton", "mosaic_gpu"])
def test_gpu_implementations_refuse_a_tpu(name):
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    with core.targeting("TPU v5 lite"), pytest.raises(NotImplementedError, match="not on tpu"):
        jax.export.export(jax.jit(lambda q: api.dot_product_attention(
            q, q, q, implementation=name)), platforms=["tpu"])(q)


class _UnderTpuInterpreter(PallasMosaicTpuFlashAttentionVjp):
    """The VJP op with its kernels under `pltpu.InterpretParams` (called directly: the
    TPU interpreter's ordered callbacks cannot run inside a `tokamax_call` lowering)."""

    def pallas_interpret(self):
        return pltpu.InterpretParams()


def test_backward_kernels_in_the_tpu_interpreter():
    """dK/dV keeps its output block in VMEM across the query heads and blocks of its inner
    grid axis: the TPU interpreter models that residency (Pallas's own does not)."""
    q, k, v = _inputs()
    dout = random_normal(3, q.shape)
    options = dict(DotProductAttention().bind(q, k, v, **OPTIONS["lengths_causal"]).arguments)
    statics = {n: options[n] for n in options if n not in ("query", "key", "value")}
    with reference_precision():
        out, residuals = DotProductAttention()._fwd(q, k, v, **statics, config=None,
                                                     return_residuals=True)
        want = jax.vjp(lambda q, k, v: DotProductAttention()(q, k, v, **OPTIONS["lengths_causal"]),
                       q, k, v)[1](dout)
    grads, _ = _UnderTpuInterpreter(interpret=True)._fwd(
        residuals, out, dout, query=q, key=k, value=v, **statics, config=BLOCKS,
        return_residuals=False)
    for name, w in zip(("query", "key", "value"), want, strict=True):
        assert_close(grads[name], w)


@pytest.mark.parametrize("name", ["causal", "lengths_causal"])
def test_gradient_through_lse_matches_reference(name):
    """`return_residual=True` with both outputs in the loss (random cotangents): the lse
    cotangent enters the kernels' delta."""
    q, k, v = _inputs()
    ct, ct_lse = random_normal(3, q.shape), random_normal(4, q.shape[:-1])
    rows = np.ones(q.shape[:-1], bool)
    if name == "lengths_causal":
        rows[1, 17:] = False  # past the query length: no row to differentiate

    def loss(impl, q, k, v):
        out, lse = api.dot_product_attention(q, k, v, implementation=impl,
                                             return_residual=True, **GRADIENT_OPTIONS[name])
        return (out * ct).sum() + jnp.where(rows, lse * ct_lse, 0.0).sum()

    with reference_precision():
        want = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: loss(_op(), *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_gradient_through_lse_lowers_for_tpu():
    def f(q, k, v):
        def loss(q, k, v):
            out, lse = api.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic",
                                                 return_residual=True)
            return out.astype(jnp.float32).sum() + lse.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
    with core.targeting("TPU v6 lite"):
        text = jax.export.export(jax.jit(f), platforms=["tpu"])(q, kv, kv).mlir_module()
    assert text.count("tpu_custom_call") == 3
    assert "PallasMosaicTpuFlashAttentionVjp" in text and "dresiduals" in text


# vmap: an outer level over "models" (query and lengths mapped, keys and values shared,
# so the fold broadcasts them) around a per-example level (everything mapped, the
# per-example lengths mapped: Pallas alone would loop over those one kernel at a time).
OUTER, INNER = 2, 3


def _vmapped(impl, q, k, v, q_len, kv_len):
    def one(q, k, v, q_len, kv_len):
        return api.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_len,
                                         key_value_seq_lengths=kv_len, implementation=impl)
    per_example = jax.vmap(one)
    return jax.vmap(per_example, in_axes=(0, None, None, 0, None))(q, k, v, q_len, kv_len)


def test_nested_vmap_forward_and_gradients_match_reference():
    q = random_normal(10, (OUTER, INNER, B, SQ, H, D))
    k, v = random_normal(11, (INNER, B, SK, HKV, D)), random_normal(12, (INNER, B, SK, HKV, D))
    q_len = jax.random.randint(jax.random.key(13), (OUTER, INNER, B), 1, SQ + 1)
    kv_len = jax.random.randint(jax.random.key(14), (INNER, B), 1, SK + 1)
    ct = random_normal(15, q.shape)

    def loss(impl, q, k, v):
        out = _vmapped(impl, q, k, v, q_len, kv_len)
        return (out * ct).sum(), out

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, got), got_grads = grad(_op(), q, k, v)
    with reference_precision():
        (_, want), want_grads = grad("xla", q, k, v)
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w)


def _export_vmapped(implementation, kind="TPU v5p"):
    def f(q, k, v, q_len, kv_len):
        def loss(q, k, v):
            out = _vmapped(implementation, q, k, v, q_len, kv_len)
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((OUTER, INNER, 2, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((INNER, 2, 1024, 2, 128), jnp.bfloat16)
    lengths = (jax.ShapeDtypeStruct((OUTER, INNER, 2), jnp.int32),
               jax.ShapeDtypeStruct((INNER, 2), jnp.int32))
    with core.targeting(kind, "tpu"):
        return jax.export.export(jax.jit(f), platforms=["tpu"])(q, kv, kv, *lengths).mlir_module()


def test_nested_vmap_lowers_for_tpu_as_one_launch_per_kernel():
    text = _export_vmapped("mosaic")
    assert text.count("tpu_custom_call") == 3  # forward, dK/dV, dQ
    assert "stablehlo.while" not in text  # folded into the batch, not a loop of launches
    assert "PallasMosaicTpuFlashAttentionVjp" in text


def test_none_keeps_the_tpu_kernel_under_vmap_where_measured_faster():
    """The evidence for a vmapped call is a measurement of that call (its vmap levels
    are part of the key), as the autotuner takes it."""
    assert "tpu_custom_call" not in _export_vmapped(None)
    args = (jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16),
            *(jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16),) * 2)
    lengths = dict(query_seq_lengths=jax.ShapeDtypeStruct((2,), jnp.int32),
                   key_value_seq_lengths=jax.ShapeDtypeStruct((2,), jnp.int32))
    # Leaves in tree order: key, key_value_seq_lengths, query, query_seq_lengths, value.
    vmap = (core.bound_arguments.VmapLevel((None, None, 0, 0, None), OUTER),
            core.bound_arguments.VmapLevel((0, 0, 0, 0, 0), INNER))
    times = {PallasMosaicTpuFlashAttention(): 1.0, DotProductAttention(): 3.0}
    forward = measured("TPU v5p", times, *args, is_causal=True, vmap=vmap, **lengths)
    with forward:
        text = _export_vmapped(None)
    assert text.count("tpu_custom_call") == 1  # the forward; its gradient was not measured
    assert "stablehlo.while" not in text
