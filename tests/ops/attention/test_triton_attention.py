"""PallasTritonFlashAttention (+ VJP) on CPU beyond the base suite (`test_attention.py`, which
runs its numerics in Pallas interpret mode): windows wider than a block, the soft cap with a
per-batch bias, head dims that are not powers of two, the lse residual and its gradient,
configs and heuristics, cuda lowering through jax.export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_kernels.attention import (
    PallasTritonFlashAttention,
    PallasTritonFlashAttentionConfig,
    PallasTritonFlashAttentionVjp,
    PallasTritonFlashAttentionVjpConfig,
    _flash_tiles,
)
from tokamax_kernels.attention.api import dot_product_attention
from tokamax_pass import core

FWD_CONFIG = PallasTritonFlashAttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)
VJP_CONFIG = PallasTritonFlashAttentionVjpConfig(16, 16, 4, 2, 16, 16, 4, 2)
OP = PallasTritonFlashAttention(
    interpret=True, config=FWD_CONFIG,
    vjp=PallasTritonFlashAttentionVjp(interpret=True, config=VJP_CONFIG))


BATCH = 2  # batch > 1: a kernel that mixes up batch elements must fail


def inputs(seq_q=32, seq_k=32, heads=2, kv_heads=2, head_dim=16, dtype=jnp.float32):
    q = random_normal(0, (BATCH, seq_q, heads, head_dim), dtype)
    k = random_normal(1, (BATCH, seq_k, kv_heads, head_dim), dtype)
    v = random_normal(2, (BATCH, seq_k, kv_heads, head_dim), dtype)
    return q, k, v


def check(q, k, v, bias=None, *, grad=True, **options):
    """Forward and (optionally) the gradient of a nonlinear loss with a random cotangent,
    kernel vs reference."""
    cotangent = random_normal(7, q.shape)

    def loss(impl, q, k, v, bias):
        out = dot_product_attention(q, k, v, bias, implementation=impl, precision="highest",
                                    **options)
        return jnp.sum(jnp.sin(out) * cotangent)

    with reference_precision():
        out = dot_product_attention(q, k, v, bias, implementation=OP, precision="highest",
                                    **options)
        ref = dot_product_attention(q, k, v, bias, implementation="xla", precision="highest",
                                    **options)
        assert_close(out, ref, q.dtype, scale_rtol=1e-4 if q.dtype == jnp.float32 else None)
        if not grad:
            return
        argnums = (1, 2, 3) if bias is None else (1, 2, 3, 4)
        grads = jax.grad(loss, argnums=argnums)(OP, q, k, v, bias)
        refs = jax.grad(loss, argnums=argnums)("xla", q, k, v, bias)
    for g, r in zip(grads, refs, strict=True):
        assert_close(g, r, q.dtype, scale_rtol=1e-4 if q.dtype == jnp.float32 else None)


def test_local_window_wider_than_a_block_with_edges_inside_blocks():
    """Windows that span several 16-wide blocks with both edges inside a block: the blocks
    wholly inside the window run unmasked, and the edge blocks stay masked."""
    check(*inputs(seq_q=48, seq_k=48, heads=1, kv_heads=1), local_window_size=(21, 19))


def test_soft_cap_with_bias_causal():
    q, k, v = inputs(heads=1, kv_heads=1)
    # Per batch element, broadcast over heads and query rows.
    check(q, k, v, random_normal(5, (BATCH, 1, 1, 32)), is_causal=True, logits_soft_cap=3.0)


def test_head_dim_not_a_power_of_two():
    check(*inputs(head_dim=24, heads=1, kv_heads=1), grad=False, is_causal=True)


def test_residuals_are_the_family_lse():
    q, k, v = inputs()
    ba = OP.bind(q, k, v, is_causal=True)
    ref = ba.op.reference_op()
    with reference_precision():
        _, (lse,) = OP._fwd(**ba.arguments, config=FWD_CONFIG, return_residuals=True)
        _, (ref_lse,) = ref._fwd(**ba.arguments, config=core.NullConfig(),
                                 return_residuals=True)
    assert lse.shape == (BATCH, 2, 32) and lse.dtype == jnp.float32
    assert_close(lse, ref_lse, scale_rtol=1e-5)


def test_triton_without_interpret_on_cpu_raises():
    q, k, v = inputs()
    with pytest.raises(NotImplementedError, match="cuda"):
        dot_product_attention(q, k, v, implementation="triton")
    # implementation=None moves on to a CPU implementation.
    assert dot_product_attention(q, k, v).shape == q.shape


def test_configs_reject_bad_blocks():
    with pytest.raises(ValueError, match="block_q"):
        PallasTritonFlashAttentionConfig(block_q=48)
    with pytest.raises(ValueError, match="block_k_dq"):
        PallasTritonFlashAttentionVjpConfig(block_k_dq=8)


def test_heuristics_and_search_space():
    q, k, v = (jax.ShapeDtypeStruct((4, 8192, 16, 128), jnp.bfloat16),) * 3
    ba = PallasTritonFlashAttention().bind(q, k, v, is_causal=True)
    config = ba.heuristics_config
    assert isinstance(config, PallasTritonFlashAttentionConfig)
    assert len(ba.autotuning_configs) > 10
    vjp_ba = PallasTritonFlashAttentionVjp().bind((None,), None, None, **ba.arguments)
    assert isinstance(vjp_ba.heuristics_config, PallasTritonFlashAttentionVjpConfig)
    assert len(vjp_ba.autotuning_configs) > 10


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_for_cuda_forward_and_gradient(causal):
    import tokamax_pass

    shapes = [jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)]

    def forward(q, k, v):
        return dot_product_attention(q, k, v, is_causal=causal, implementation="triton")

    def gradient(q, k, v):
        return jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(
            q, k, v)

    for fn in (forward, gradient):
        with core.targeting(H200):
            exported = jax.export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*shapes)
        text = exported.mlir_module()
        assert "__gpu$xla.gpu.triton" in text
        assert core.METADATA_KEY in text
        if fn is gradient:
            assert "PallasTritonFlashAttentionVjp" in text


def test_causal_bias_gradient_is_zero_in_the_blocks_the_kernel_skips():
    """Causal with a bias over 48 keys in 16-wide blocks: the dq kernel never visits the
    blocks above the diagonal, so it writes their bias gradient as zeros itself."""
    q, k, v = inputs(seq_q=48, seq_k=48)
    check(q, k, v, random_normal(3, (BATCH, 2, 48, 48)), is_causal=True)


def test_a_bias_gradient_lowers_for_cuda_at_any_padded_key_length():
    """A bias gradient at 384 keys (three 128-key blocks: no power of 2) lowers for the
    GPU; Triton's arrays are powers of 2 long, so the kernel never makes one the length
    of the padded key axis."""
    import tokamax_pass

    q = jax.ShapeDtypeStruct((2, 384, 4, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((2, 4, 384, 384), jnp.bfloat16)

    def gradient(q, k, v, bias):
        def loss(*args):
            out = dot_product_attention(*args, is_causal=True, implementation="triton")
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    with core.targeting(H200):
        text = jax.export.export(jax.jit(gradient), platforms=["cuda"],
                                 disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(
                                     q, q, q, bias).mlir_module()
    assert "PallasTritonFlashAttentionVjp" in text


def test_gradient_through_lse_with_bias_mask_and_lengths():
    """`return_residual=True`, both outputs in the loss: dq, dk, dv and dbias against the
    reference (the lse cotangent enters the kernels' delta; rows that see nothing, from
    the mask or past the query length, get none)."""
    q, k, v = inputs(seq_q=32, seq_k=48, heads=4, kv_heads=2)
    bias = random_normal(3, (BATCH, 4, 32, 48))
    mask = jax.random.bernoulli(jax.random.key(4), 0.8, (BATCH, 1, 32, 48)).at[0, :, 5].set(False)
    lengths = dict(query_seq_lengths=jnp.array([32, 20], jnp.int32),
                   key_value_seq_lengths=jnp.array([40, 48], jnp.int32))
    ct, ct_lse = random_normal(5, q.shape), random_normal(6, q.shape[:-1])

    def loss(impl, q, k, v, bias):
        out, lse = dot_product_attention(q, k, v, bias, mask, implementation=impl,
                                         precision="highest", return_residual=True, **lengths)
        return jnp.sum(out * ct) + jnp.sum(jnp.where(lse > -1e30, lse, 0.0) * ct_lse)

    with reference_precision():
        grads = jax.grad(loss, argnums=(1, 2, 3, 4))(OP, q, k, v, bias)
        refs = jax.grad(loss, argnums=(1, 2, 3, 4))("xla", q, k, v, bias)
    for g, r in zip(grads, refs, strict=True):
        assert_close(g, r, scale_rtol=1e-4)


def test_gradient_through_lse_lowers_for_cuda():
    import tokamax_pass

    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

    def gradient(q, k, v):
        def loss(q, k, v):
            out, lse = dot_product_attention(q, k, v, implementation="triton",
                                             return_residual=True)
            return out.astype(jnp.float32).sum() + lse.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with core.targeting(H200):
        text = jax.export.export(jax.jit(gradient), platforms=["cuda"],
                                 disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(
                                     q, kv, kv).mlir_module()
    assert "PallasTritonFlashAttentionVjp" in text and "dresiduals" in text


HEAD_DIMS = (32, 64, 96, 128, 192, 256)
A100 = "NVIDIA A100-SXM4-80GB"


def _pipelines(d, dv, dtype, pair_bytes=0):
    """The shared memory of the heuristic configs' three pipelines at head dims d, dv:
    per stage, the streamed rows of the two head-dim tiles (padded to a power of 2) and
    of the bias and mask tiles across the other block."""
    from tokamax_kernels.attention import pallas_triton, pallas_triton_vjp

    width = (1 << (d - 1).bit_length()) + (1 << (dv - 1).bit_length())

    def needed(stages, rows, across):
        return stages * rows * (width * jnp.dtype(dtype).itemsize + across * pair_bytes)

    fwd = pallas_triton.heuristics_config(d, 4096, 4096, False, dtype, dv, pair_bytes)
    found = [needed(fwd.num_stages, fwd.block_k, fwd.block_q)]
    for causal in (False, True):
        vjp = pallas_triton_vjp.heuristics_config(d, 4096, 4096, causal, dtype, dv, pair_bytes)
        found += [needed(vjp.num_stages_dkv, vjp.block_q_dkv, vjp.block_k_dkv),
                  needed(vjp.num_stages_dq, vjp.block_k_dq, vjp.block_q_dq)]
    return found


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_heuristic_pipelines_fit_the_gpu_in_every_dtype_and_head_dim(dtype):
    """Every heuristic config's streamed tiles fit the H200's shared memory, with a float32
    bias and a mask too: the bf16 tiles at head dim 128 in float32 asked for 384 KiB and
    failed to compile; shrinking keeps the measured bf16 choices. On an A100 they fit
    its smaller shared memory."""
    from tokamax_kernels.attention import pallas_triton

    head_dims = [(d, d) for d in HEAD_DIMS] + [(192, 128), (64, 256), (128, 256)]
    for d, dv in head_dims:
        assert max(_pipelines(d, dv, dtype)) <= 227 * 1024
        assert max(_pipelines(d, dv, dtype, pair_bytes=4 + 1)) <= 227 * 1024
    with core.targeting(A100):
        for d, dv in head_dims:
            assert max(_pipelines(d, dv, dtype)) <= 163 * 1024
    measured = pallas_triton.heuristics_config(128, 8192, 8192, True)
    assert (measured.block_q, measured.block_k, measured.num_stages) == (128, 128, 3)
    if dtype == jnp.float32:
        f32 = pallas_triton.heuristics_config(128, 8192, 8192, True, dtype)
        assert f32.block_k < 128 and f32.num_stages >= 2


def test_autotuning_offers_only_configs_whose_pipelines_fit():
    """Candidates that cannot compile (float32 at head dim 128 with 128-key blocks and 4
    stages asks 512 KiB) are not offered, so autotuning spends no compile on them."""
    from tokamax_kernels.attention import _triton_common as common

    q = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.float32)
    ba = PallasTritonFlashAttention().bind(q, q, q)
    vjp_ba = PallasTritonFlashAttentionVjp().bind((None,), None, None, **ba.arguments)
    assert ba.autotuning_configs and vjp_ba.autotuning_configs
    for config in ba.autotuning_configs:
        assert common.pipeline_fits(stages=config.num_stages, rows=config.block_k,
                                    head_dims=(128, 128), dtype=jnp.float32)
    for config in vjp_ba.autotuning_configs:
        for rows, stages in ((config.block_q_dkv, config.num_stages_dkv),
                             (config.block_k_dq, config.num_stages_dq)):
            assert common.pipeline_fits(stages=stages, rows=rows, head_dims=(128, 128),
                                        dtype=jnp.float32)


def test_a_config_whose_pipeline_cannot_fit_is_refused_before_it_reaches_xla():
    """A pinned config that needs more shared memory than the GPU has is a
    `NotImplementedError` naming its fields when lowered for the GPU, not a compile
    failure inside XLA; the same shape with the heuristic config lowers, on an H200 and
    on an A100 (whose shared memory the bf16 tiles at head dim 128 would overflow)."""
    import tokamax_pass

    q = jax.ShapeDtypeStruct((2, 512, 4, 128), jnp.float32)
    too_big = PallasTritonFlashAttentionConfig(block_q=128, block_k=128, num_warps=8,
                                               num_stages=3)

    def forward(impl):
        return lambda q, k, v: dot_product_attention(q, k, v, implementation=impl)

    def export(fn, *args):
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)

    with core.targeting(H200):
        with pytest.raises(NotImplementedError, match=r"block_k and num_stages .*shared memory"):
            export(forward(PallasTritonFlashAttention(config=too_big)), q, q, q)
        assert "__gpu$xla.gpu.triton" in export(forward("triton"), q, q, q).mlir_module()
    bf16 = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
    with core.targeting(A100):
        assert "__gpu$xla.gpu.triton" in export(forward("triton"), bf16, bf16,
                                                bf16).mlir_module()



def test_logits_a_bias_hides_are_held_at_one_floor():
    """A bias at float32's lowest value times log2(e) overflowed to -inf (a row of them
    gave NaN); a bias of -1e10 left logits so large that the fused `s - max` of a row
    of them was off by thousands (inf or 0). Every hidden logit is one exact floor."""
    spec = _flash_tiles.KernelSpec(
        scale=0.125, left=None, right=None, offset=0, soft_cap=None, seq_q=2, seq_k=4,
        has_bias=True, has_mask=False, has_q_lengths=False, has_kv_lengths=False,
        precision=None)
    qk = jnp.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, 2.0, -1.0]])
    lowest = jnp.finfo(jnp.float32).min
    bias = jnp.array([[0.0, lowest, 0.0, -1e10], [lowest, -1e10, lowest, -1e6]])
    s2, _ = _flash_tiles.logits2(spec, qk, bias)
    visible = bias == 0
    assert_close(s2[visible], (qk * 0.125)[visible] * _flash_tiles.LOG2E, scale_rtol=1e-6)
    floor = jnp.float32(_flash_tiles.HIDDEN_LOGIT * _flash_tiles.LOG2E)
    assert bool((s2[~visible] == floor).all()), s2


@pytest.mark.parametrize("fill", [float(jnp.finfo(jnp.float32).min), -1e10])
def test_a_padding_bias_with_an_example_all_padding_matches_xla(fill):
    """Hugging Face's padding bias (0, or a fill on padding keys) with one example all
    padding: the forward matches XLA's everywhere (the padded example's rows average the
    values, as plain JAX's do; the kernel gave NaN or zeros there), and so do the
    gradients of a loss that leaves that example out, as training does (NaN times the
    loss's zero weight was NaN)."""
    q, k, v = inputs()
    keep = jnp.arange(32)[None, :] < jnp.array([[20], [0]])  # example 1: all padding
    bias = jnp.where(keep, 0.0, fill)[:, None, None, :]
    weight = random_normal(7, q.shape) * jnp.array([1.0, 0.0])[:, None, None, None]

    def loss(impl, q, k, v):
        out = dot_product_attention(q, k, v, bias, implementation=impl, precision="highest")
        return jnp.sum(out * weight), out

    with reference_precision():
        (_, out), grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(
            OP, q, k, v)
        (_, ref), refs = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(
            "xla", q, k, v)
    assert_close(out, ref, scale_rtol=1e-4)
    for g, r in zip(grads, refs, strict=True):
        assert_close(g, r, scale_rtol=1e-4)
