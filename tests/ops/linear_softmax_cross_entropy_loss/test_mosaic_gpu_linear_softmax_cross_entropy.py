"""The Mosaic GPU LM-head loss (`implementation="mosaic"`).

On CPU: the forward and the gradient lower for an H200 through `jax.export` (the
`mosaic_gpu_v2` custom calls, with their JSON specs) at several shapes; the kernels run in
Pallas's GPU interpret mode (`_mosaic_gpu_interpret.interpret_mode`) for the loss and its
gradients against the float32 HIGHEST reference; unsupported inputs and devices raise
`NotImplementedError`; configs and heuristics. On the GPU, at larger shapes:

    PYTHONPATH=src:kernels:. python -m pytest -m gpu \
        tests/ops/linear_softmax_cross_entropy_loss/test_mosaic_gpu_linear_softmax_cross_entropy.py

(loss and gradients against the float32 HIGHEST reference; the backward's compiled
temporary memory against the `xla` implementation's at 16384 x 4096 x 128256).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass as tokamax
from _mosaic_gpu_interpret import interpret_mode
from conftest import H200, assert_close, random_normal
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    MosaicGpuLossConfig,
    PallasMosaicGpuLinearSoftmaxCrossEntropyLoss,
    PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss import _mosaic_gpu_common as common
from tokamax_kernels.linear_softmax_cross_entropy_loss import api as lce_api

lce = tokamax.linear_softmax_cross_entropy_loss
Op = PallasMosaicGpuLinearSoftmaxCrossEntropyLoss
Vjp = PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp
BIG = (16384, 4096, 128256)  # Llama 3 8B's head
# A 512-wide backward chunk: V=1088 takes three, the last starting early at 576.
SMALL_CHUNKS = MosaicGpuLossConfig(block_tokens=128, block_vocab=256, block_h=64,
                                   num_stages=3, chunk_vocab=512)
# dx from a second pass over 128-token chunks: 300 tokens (304 padded) take three.
TWO_PASS = MosaicGpuLossConfig(chunk_vocab=512, dx_token_chunk=128)
# The least memory: 512-wide vocabulary chunks, dx over 128-token chunks (at 1024 and 128:
# 79 MiB on the H200, 1/101 of xla's).
LEAST_MEMORY = MosaicGpuLossConfig(chunk_vocab=512, dx_token_chunk=128)


def _target(kind: str = H200):
    return jax.sharding.use_abstract_mesh(AbstractMesh(
        (1,), ("_target",), axis_types=(AxisType.Auto,),
        abstract_device=AbstractDevice(kind, None, "cuda")))


def _shapes(lead=(2, 150), h=128, v=1088, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((*lead, h), dtype), jax.ShapeDtypeStruct(lead, jnp.int32),
            jax.ShapeDtypeStruct((h, v), dtype))


def _export_text(fn, *args) -> str:
    with _target():
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)
    return exported.mlir_module()


def _specs(text: str) -> list[str]:
    found = re.findall(r'tokamax_pass_spec = "((?:[^"\\]|\\.)*)"', text)
    return [s.replace("\\22", '"') for s in found]


def _loss(implementation="mosaic", reduction="sum", cap=None):
    def f(x, labels, w):
        return lce(x, labels, w, implementation=implementation, reduction=reduction,
                   logits_soft_cap=cap)
    return f


@pytest.mark.parametrize("lead, h, v", [((2, 150), 128, 1088), ((60,), 64, 64),
                                        ((4, 8, 33), 256, 32000), ((BIG[0],), *BIG[1:])])
def test_forward_lowers_to_one_mosaic_kernel(lead, h, v):
    text = _export_text(_loss(cap=30.0), *_shapes(lead, h, v))
    assert text.count("mosaic_gpu_v2") == 1
    specs = _specs(text)
    assert specs and all("PallasMosaicGpuLinearSoftmaxCrossEntropyLoss" in s for s in specs)


@pytest.mark.exhaustive
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("lead, h, v", [((2, 150), 128, 1088), ((16384,), 2048, 32000)])
def test_gradient_lowers_forward_and_dlogits_kernels(reduction, lead, h, v):
    def f(x, labels, w):
        out = _loss(reduction=reduction, cap=30.0)(x, labels, w)
        return jnp.sum(out * jnp.arange(1, out.size + 1, dtype=out.dtype).reshape(out.shape))

    text = _export_text(jax.value_and_grad(f, argnums=(0, 2)), *_shapes(lead, h, v))
    assert text.count("mosaic_gpu_v2") == 2  # the forward; the dlogits of the chunk loop
    specs = _specs(text)
    assert any("PallasMosaicGpuLinearSoftmaxCrossEntropyLossVjp" in s for s in specs)


def test_label_smoothing_and_z_loss_lower_the_same_two_kernels():
    """The options are terms around the op's call: the gradient still lowers one forward
    kernel and one dlogits kernel."""
    def f(x, labels, w):
        return lce(x, labels, w, implementation="mosaic", reduction="mean",
                   label_smoothing=0.1, z_loss=1e-4)

    text = _export_text(jax.value_and_grad(f, argnums=(0, 2)), *_shapes())
    assert text.count("mosaic_gpu_v2") == 2


def test_vmap_lowers_and_keeps_per_example_gradients():
    def per_example(x, labels, w):
        return _loss(reduction="mean")(x, labels, w)

    def f(x, labels, w):
        return jax.vmap(per_example, in_axes=(0, 0, None))(x, labels, w).sum()

    text = _export_text(jax.grad(f, argnums=(0, 2)), *_shapes((3, 40), 64, 128))
    assert text.count("mosaic_gpu_v2") == 2


@pytest.mark.parametrize("shapes, kwargs, why", [
    (_shapes(dtype=jnp.float32), {}, "xla_chunked"),
    (_shapes(h=96), {}, "multiple of 64"),
    (_shapes(v=1000), {}, "multiple of 64"),
    (_shapes(), dict(precision="highest"), "default precision"),
])
def test_unsupported_inputs_raise_not_implemented(shapes, kwargs, why):
    with _target(), pytest.raises(NotImplementedError, match=why):
        jax.eval_shape(
            lambda x, lab, w: lce(x, lab, w, implementation="mosaic_gpu", **kwargs), *shapes)


def test_old_gpus_and_cpu_raise_not_implemented_and_none_falls_back():
    with _target("NVIDIA A100-SXM4-40GB"), pytest.raises(NotImplementedError, match="Hopper"):
        jax.eval_shape(_loss("mosaic_gpu"), *_shapes())
    x = random_normal(0, (2, 5, 64), jnp.bfloat16)
    labels = jnp.array([[0, 3, -1, 7, 2], [1, 1, 5, -1, 0]])
    w = random_normal(1, (64, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="cuda"):
        jax.jit(_loss())(x, labels, w)
    assert np.isfinite(float(jax.jit(_loss(None))(x, labels, w)))


def test_pinned_config_that_does_not_fit_raises():
    op = Op(config=MosaicGpuLossConfig(block_h=128))
    with _target(), pytest.raises(NotImplementedError, match="does not fit"):
        jax.eval_shape(_loss(op), *_shapes(h=192))


def test_mosaic_alias_and_registration():
    assert lce_api.FAMILY.aliases["mosaic"] == ("mosaic_gpu", "mosaic_tpu")
    assert lce_api.FAMILY.implementations["mosaic_gpu"] is Op
    assert isinstance(Op().vjp_op(), Vjp)


def test_two_pass_gradient_lowers_a_second_dlogits_kernel():
    op = Op(vjp=Vjp(config=TWO_PASS))
    text = _export_text(jax.grad(_loss(op), argnums=(0, 2)), *_shapes())
    assert text.count("mosaic_gpu_v2") == 3  # forward, vocabulary pass, token pass


@pytest.mark.parametrize("kwargs", [dict(block_tokens=64), dict(block_vocab=96),
                                    dict(block_vocab=512, chunk_vocab=512), dict(block_h=32),
                                    dict(num_stages=1), dict(chunk_vocab=1000),
                                    dict(block_tokens=True), dict(dx_token_chunk=100),
                                    dict(dx_token_chunk=-128)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        MosaicGpuLossConfig(**kwargs)


@pytest.mark.parametrize("shape", [BIG, (16384, 2048, 32000), (300, 64, 64)])
@pytest.mark.parametrize("backward", [False, True])
def test_heuristics_and_search_space_fit(shape, backward):
    tokens, h, v = shape
    config = common.heuristic_config(h, v)
    assert common.fits(config, h, v, backward=backward)
    assert config.smem_bytes(2, backward=backward) <= common.SMEM_BYTES
    if shape != (300, 64, 64):
        assert (config.block_tokens, config.block_vocab, config.block_h) == (128, 256, 64)
        assert config.num_stages == 3
    space = common.search_space(h, v, backward=backward)
    assert space and all(common.fits(c, h, v, backward=backward) for c in space)


def test_vocab_splits_fill_the_sms_without_empty_splits():
    assert common.vocab_splits(16384, 501, 128) == 2  # 128 token blocks, 132 SMs
    for tokens, blocks in ((128, 501), (1000, 7), (40, 3)):
        splits = common.vocab_splits(tokens, blocks, 128)
        per = -(-blocks // splits)
        assert 1 <= splits <= blocks and (splits - 1) * per < blocks


# --- numerics: the float32 HIGHEST reference ------------------------------------------

def _reference(x, labels, w, reduction, cap):
    logits = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    losses = jnp.where(labels >= 0, lse - picked, 0.0)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / jnp.maximum((labels >= 0).sum(), 1)


def _inputs(lead, h, v, dtype, seed=0):
    x = random_normal(seed, (*lead, h), dtype)
    w = (random_normal(seed + 1, (h, v)) * (2 / np.sqrt(h))).astype(dtype)
    labels = jax.random.randint(jax.random.key(seed + 2), lead, 0, v)
    ignored = jax.random.bernoulli(jax.random.key(seed + 3), 0.2, lead)
    return x, jnp.where(ignored, -1, labels), w


def _check(implementation, lead, h, v, dtype, reduction, cap, seed=0):
    x, labels, w = _inputs(lead, h, v, dtype, seed)
    f = _loss(implementation, reduction, cap)
    out = jax.jit(f)(x, labels, w)
    want = _reference(x, labels, w, reduction, cap)
    assert_close(out, want, dtype)
    cotangent = random_normal(seed + 7, want.shape)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, labels, w) * cotangent),
                             argnums=(0, 1)))(x, w)
    wants = jax.grad(lambda x, w: jnp.sum(_reference(x, labels, w, reduction, cap)
                                          * cotangent), argnums=(0, 1))(
        x.astype(jnp.float32), w.astype(jnp.float32))
    for got, expected in zip(grads, wants, strict=True):
        assert got.dtype == dtype
        assert_close(got, expected, dtype)
    dx = np.asarray(grads[0], np.float32)
    assert not np.any(dx[np.asarray(labels) < 0])  # ignored tokens get no gradient


SMALL_OP = Op(config=SMALL_CHUNKS, vjp=Vjp(config=SMALL_CHUNKS))
# Interpret-mode tiles: 128-wide vocabulary blocks, 256-wide backward chunks (V=320: two,
# the last starting early), dx over 128-token chunks when two_pass.
INTERPRET = MosaicGpuLossConfig(block_tokens=128, block_vocab=128, block_h=64, num_stages=2,
                                chunk_vocab=256)


def _interpreted(lead, h, v, reduction, cap, backward_config, seed):
    """The op's forward and VJP computations (`_fwd`: no platform check) with the kernels in
    GPU interpret mode, against the reference, forward and gradients."""
    x, labels, w = _inputs(lead, h, v, jnp.bfloat16, seed)
    statics = dict(reduction=reduction, logits_soft_cap=cap, precision=None)
    with interpret_mode():
        out, residuals = Op()._fwd(x, labels, w, **statics, config=INTERPRET,
                                   return_residuals=True)
        cotangent = random_normal(seed + 7, out.shape)
        grads, _ = Vjp()._fwd(residuals, out, cotangent, config=backward_config,
                              return_residuals=False, x=x, labels=labels, weights=w, **statics)
    assert_close(out, _reference(x, labels, w, reduction, cap), jnp.bfloat16)
    wants = jax.grad(lambda x, w: jnp.sum(_reference(x, labels, w, reduction, cap)
                                          * cotangent), argnums=(0, 1))(
        x.astype(jnp.float32), w.astype(jnp.float32))
    for got, want in zip((grads["x"], grads["weights"]), wants, strict=True):
        assert got.dtype == jnp.bfloat16
        assert_close(got, want, jnp.bfloat16)
    assert not np.any(np.asarray(grads["x"], np.float32)[np.asarray(labels) < 0])


@pytest.mark.parametrize("reduction, cap, two_pass", [("sum", None, False),
                                                      ("mean", 2.0, True),
                                                      ("none", None, True)])
def test_interpreted_kernels_match_reference(reduction, cap, two_pass):
    # 150 tokens (padded to 152; the last token block and dx chunk start early), V=320 (the
    # last vocabulary block and backward chunk start early).
    config = dataclasses.replace(INTERPRET, dx_token_chunk=128 if two_pass else 0)
    _interpreted((2, 75), 64, 320, reduction, cap, config, seed=31)


def test_interpreted_few_tokens_and_vmap():
    """60 tokens a sequence (padded to a block). `jax.vmap` with shared weights folds the
    sequences into one launch; with per-sequence weights it launches once per sequence."""
    x, labels, w = _inputs((2, 60), 64, 128, jnp.bfloat16, seed=41)
    ws = jnp.stack([w, (w.astype(jnp.float32) * -1.5).astype(w.dtype)])

    def per_example(x, labels, w):
        out, _ = Op()._fwd(x, labels, w, reduction="mean", logits_soft_cap=None,
                           precision=None, config=INTERPRET, return_residuals=False)
        return out

    def reference(x, labels, w):
        return _reference(x, labels, w, "mean", None)

    for weights, axis in ((w, None), (ws, 0)):
        with interpret_mode():
            out = jax.vmap(per_example, in_axes=(0, 0, axis))(x, labels, weights)
        want = jax.vmap(reference, in_axes=(0, 0, axis))(x, labels, weights)
        assert_close(out, want, jnp.bfloat16)


# --- on the GPU ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_matches_reference(reduction, dtype):
    # 300 tokens (not a multiple of 128 nor 8), V=1088 (not a multiple of 256).
    _check(SMALL_OP, (2, 150), 256, 1088, dtype, reduction, None)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_gpu_two_pass_backward_matches_reference(reduction):
    _check(Op(config=SMALL_CHUNKS, vjp=Vjp(config=TWO_PASS)), (2, 150), 256, 1088,
           jnp.bfloat16, reduction, 4.0, seed=21)


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [None, 3.0])
def test_gpu_soft_cap_and_heuristic_config(cap):
    _check("mosaic", (2, 3, 100), 128, 2048, jnp.bfloat16, "mean", cap, seed=3)


@pytest.mark.gpu
def test_gpu_few_tokens_and_many_splits():
    _check("mosaic", (2, 20), 64, 4096, jnp.bfloat16, "sum", 2.0, seed=5)


@pytest.mark.gpu
def test_gpu_vmap_per_example_losses():
    x, labels, w = _inputs((3, 200), 128, 576, jnp.bfloat16, seed=11)

    def per_example(impl):
        return jax.vmap(lambda x, lab: lce(x, lab, w, reduction="mean", implementation=impl))

    assert_close(jax.jit(per_example("mosaic"))(x, labels),
                 jax.vmap(lambda x, lab: _reference(x, lab, w, "mean", None))(x, labels),
                 jnp.bfloat16)
    cotangent = random_normal(12, (3,))
    dx = jax.jit(jax.grad(lambda x: jnp.sum(per_example("mosaic")(x, labels) * cotangent)))(x)
    want = jax.grad(lambda x: jnp.sum(jax.vmap(
        lambda x, lab: _reference(x, lab, w, "mean", None))(x, labels) * cotangent))(
        x.astype(jnp.float32))
    assert_close(dx, want, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_backward_temp_memory_against_xla():
    """The compiled gradient's temporaries at Llama 3's head against `xla`'s (its logits):
    below 1/100 with `dx_token_chunk` (the slabs alone); the default's float32 dx
    accumulator (tokens x H x 4 bytes, 256 MiB here) keeps it near 1/25."""
    tokens, h, v = BIG
    args = (jax.ShapeDtypeStruct((tokens, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((tokens,), jnp.int32), jax.ShapeDtypeStruct((h, v), jnp.bfloat16))

    def temp_bytes(impl):
        grad = jax.jit(jax.grad(_loss(impl, "mean"), argnums=(0, 2)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    xla = temp_bytes("xla")
    least = temp_bytes(Op(vjp=Vjp(config=LEAST_MEMORY)))
    default = temp_bytes("mosaic")
    print(f"temp MiB: xla {xla / 2**20:.0f}, mosaic {default / 2**20:.0f} "
          f"(1/{xla / default:.0f}), mosaic dx_token_chunk {least / 2**20:.0f} "
          f"(1/{xla / least:.0f})")
    assert least * 100 < xla
    assert default < tokens * h * 4 + tokens * 2048 * 2 + (16 << 20)  # accumulator + slab
