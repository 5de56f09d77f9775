"""CPU tests of the Mosaic GPU attention kernels: lowering for an H200, support checks.

Their numerics are checked on the device by `tests/gpu/test_mosaic_attention_gpu.py`, and
on CPU in GPU interpret mode for soft cap and local windows by
`tests/test_mosaic_attention_window_softcap.py` and for head dim 256 (forward and
backward) by `tests/test_mosaic_attention_d256.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import H200, measured
from tokamax_kernels.attention import (
    CudnnDotProductAttention,
    DotProductAttention,
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    dot_product_attention,
)
from tokamax_kernels.attention import _mosaic_gpu_common as common
from tokamax_kernels.attention import pallas_mosaic_gpu_vjp as vjp_module
from tokamax_kernels.attention._mosaic_gpu_common import (
    MosaicAttentionConfig,
    MosaicAttentionVjpConfig,
)
from tokamax_pass import core


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export(fn, *args, device_kind=H200):
    with core.targeting(device_kind):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)


def _mosaic(q, k, v, **kwargs):
    return dot_product_attention(q, k, v, implementation="mosaic", **kwargs)


@pytest.mark.parametrize("head_dim,kv_heads,causal", [
    (64, 4, False), (128, 4, True), (256, 4, False), (64, 2, True), (128, 1, False),
])
def test_forward_lowers_to_mosaic_gpu(head_dim, kv_heads, causal):
    q = _sds((2, 256, 4, head_dim))
    kv = _sds((2, 256, kv_heads, head_dim))
    text = _export(lambda q, k, v: _mosaic(q, k, v, is_causal=causal), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1
    assert "tokamax_pass_spec" in text and "PallasMosaicGpuFlashAttention" in text


@pytest.mark.parametrize("head_dim,kv_heads,causal", [
    (64, 4, True), (128, 4, False), (64, 2, False), (128, 1, True),
])
def test_gradient_lowers_to_three_mosaic_kernels(head_dim, kv_heads, causal):
    q = _sds((1, 256, 4, head_dim))
    kv = _sds((1, 256, kv_heads, head_dim))

    def loss(q, k, v):
        return _mosaic(q, k, v, is_causal=causal).astype(jnp.float32).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3  # forward, dq, dk/dv
    assert "PallasMosaicGpuFlashAttentionVjp" in text


@pytest.mark.parametrize("head_dim", [64, 128])
def test_self_attention_gradient_lowers_to_one_backward_kernel(head_dim):
    """attention(x, x, x): dq + dk + dv come from one kernel (the shared-input VJP)."""
    x = _sds((1, 256, 2, head_dim))

    def loss(x, causal=False):
        return _mosaic(x, x, x, is_causal=causal).astype(jnp.float32).sum()

    text = _export(jax.grad(loss), x).mlir_module()
    assert text.count("mosaic_gpu_v2") == 2  # forward, dx
    assert "shared_inputs" in text
    causal = _export(jax.grad(lambda x: loss(x, causal=True)), x).mlir_module()
    assert causal.count("mosaic_gpu_v2") == 3  # causal keeps dq and dk/dv


def test_shared_kernel_configs_tune_its_own_tiles():
    x = _sds((32, 2048, 16, 64))
    vjp = PallasMosaicGpuFlashAttentionVjp()
    forward = PallasMosaicGpuFlashAttention().bind(x, x, x).arguments
    ba = vjp.bind((_sds((32, 16, 2048), jnp.float32),), x, x,
                  shared_inputs=(("key", "query", "value"),), **forward)
    assert vjp_module.runs_shared_kernel(ba.arguments)
    assert ba.heuristics_config == MosaicAttentionVjpConfig(block_q_dkv=64, block_kv_dkv=64)
    configs = ba.autotuning_configs
    dq_fields = {(c.block_q_dq, c.block_kv_dq) for c in configs}
    assert dq_fields == {(64, 64)} and {c.num_stages for c in configs} == {2, 3}
    assert all(vjp_module.shared_fits(c, 2048, 64) for c in configs)
    assert not vjp_module.runs_shared_kernel({**ba.arguments, "is_causal": True})


@pytest.mark.parametrize("lengths", ["query", "key_value", "both"])
def test_sequence_lengths_lower_forward_and_gradient(lengths):
    q, kv = _sds((2, 256, 4, 64)), _sds((2, 256, 2, 64))
    seq_lengths = _sds((2,), jnp.int32)

    def loss(q, k, v, n):
        kwargs = {}
        if lengths in ("query", "both"):
            kwargs["query_seq_lengths"] = n
        if lengths in ("key_value", "both"):
            kwargs["key_value_seq_lengths"] = n
        return _mosaic(q, k, v, is_causal=True, **kwargs).astype(jnp.float32).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seq_lengths).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3


def test_automatic_picks_mosaic_for_h200_where_measured_faster_and_xla_otherwise():
    q = _sds((1, 256, 2, 64))
    f = lambda q: dot_product_attention(q, q, q)  # noqa: E731
    assert "mosaic_gpu_v2" not in _export(f, q).mlir_module()  # unmeasured: plain paths
    evidence = measured(H200, {PallasMosaicGpuFlashAttention(): 1.0, DotProductAttention(): 3.0,
                               CudnnDotProductAttention(): 2.0}, q, q, q)
    with evidence:
        text = _export(f, q).mlir_module()
    assert "mosaic_gpu_v2" in text
    mask = _sds((1, 1, 256, 256), jnp.bool_)
    text = _export(lambda q, m: dot_product_attention(q, q, q, mask=m), q, mask).mlir_module()
    assert "mosaic_gpu_v2" not in text


def test_explicit_configs_lower():
    q = _sds((1, 512, 2, 128))
    op = PallasMosaicGpuFlashAttention(
        config=MosaicAttentionConfig(block_q=128, block_kv=64, compute_wgs=1),
        vjp=PallasMosaicGpuFlashAttentionVjp(config=MosaicAttentionVjpConfig(
            block_q_dq=64, block_kv_dq=128, compute_wgs=1)))
    text = _export(jax.grad(lambda q: op(q, q, q, is_causal=True).astype(jnp.float32).sum()),
                   q).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3


@pytest.mark.parametrize("name", ["bias", "mask"])
def test_unsupported_features_raise(name):
    q = _sds((1, 256, 2, 64))
    extra = _sds((1, 2, 256, 256), jnp.bfloat16 if name == "bias" else jnp.bool_)
    with pytest.raises(NotImplementedError, match=name):
        _export(lambda q, x: _mosaic(q, q, q, **{name: x}), q, extra)


@pytest.mark.parametrize("shape,dtype,message", [
    ((1, 256, 2, 64), jnp.float32, "bf16/f16"),
    ((1, 256, 2, 96), jnp.bfloat16, "head dims"),
    ((1, 200, 2, 64), jnp.bfloat16, "multiple"),
])
def test_unsupported_inputs_raise(shape, dtype, message):
    q = _sds(shape, dtype)
    with pytest.raises(NotImplementedError, match=message):
        _export(lambda q: _mosaic(q, q, q), q)


def test_older_gpu_raises():
    q = _sds((1, 256, 2, 64))
    with pytest.raises(NotImplementedError, match="Hopper"):
        _export(lambda q: _mosaic(q, q, q), q, device_kind="NVIDIA A100-SXM4-80GB")


def test_cpu_raises_and_none_falls_back_to_xla():
    q = jax.random.normal(jax.random.key(0), (1, 128, 2, 64), jnp.float32).astype(jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="cuda"):
        _mosaic(q, q, q)
    out = dot_product_attention(q, q, q)
    reference = dot_product_attention(q, q, q, implementation="xla")
    assert jnp.array_equal(out, reference)


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="multiples of 64"):
        MosaicAttentionConfig(block_q=96)
    with pytest.raises(ValueError, match="num_stages"):
        MosaicAttentionVjpConfig(num_stages=1)


def test_heuristics_and_search_space_fit_the_benchmark_shapes():
    for seq, head_dim, causal in ((2048, 64, False), (8192, 128, False), (8192, 128, True),
                                  (4096, 256, False)):
        q = _sds((4, seq, 16, head_dim))
        ba = PallasMosaicGpuFlashAttention().bind(q, q, q, is_causal=causal)
        config = ba.heuristics_config
        assert seq % (config.block_q * config.compute_wgs) == 0
        assert config in ba.autotuning_configs
        # At d256 only 64 x 64 tiles fit SMEM and registers: the heuristics config is the space.
        assert len(ba.autotuning_configs) >= (2 if head_dim < 256 else 1)


def test_one_compute_warpgroup_is_tuned_only_when_two_leave_sms_idle():
    assert common.compute_wg_choices(32 * 16, 2048) == (2,)  # 4096 blocks of 2 x 64 rows
    assert common.compute_wg_choices(4 * 16, 8192, 256) == (1, 2)  # 128 dk/dv blocks
    for batch, heads, wgs in ((32, 16, {2}), (1, 4, {1, 2})):
        q = _sds((batch, 2048, heads, 64))
        configs = PallasMosaicGpuFlashAttention().bind(q, q, q).autotuning_configs
        assert {c.compute_wgs for c in configs} == wgs


def test_negative_scale_lowers():
    """A scale <= 0 cannot ride in the exponent's FMA (the max would flip): its path lowers."""
    q = _sds((1, 256, 2, 64))
    text = _export(lambda q: _mosaic(q, q, q, scale=-0.125, is_causal=True), q).mlir_module()
    assert text.count("mosaic_gpu_v2") == 1


def test_gradient_through_lse_lowers_to_three_mosaic_kernels():
    """`return_residual=True` with lse in the loss: the lse cotangent enters the backward's
    delta (XLA), so the same three kernels run; the VJP call carries `dresiduals`."""
    q = _sds((1, 256, 4, 64))
    kv = _sds((1, 256, 2, 64))

    def loss(q, k, v):
        out, lse = _mosaic(q, k, v, is_causal=True, return_residual=True)
        return out.astype(jnp.float32).sum() + (lse.astype(jnp.float32) ** 2).sum()

    text = _export(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv).mlir_module()
    assert text.count("mosaic_gpu_v2") == 3
    assert "PallasMosaicGpuFlashAttentionVjp" in text and "dresiduals" in text
