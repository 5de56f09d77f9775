"""Upstream Tokamax's `tokamax.ops` namespace (`ops.gpu`, `ops.tpu`), its top-level names
`DotProductAttentionImplementation` and `__git_revision__`, and its
`ExceptionGroup("all implementations failed")`, in tokamax_pass."""

from __future__ import annotations

import importlib
import typing

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import random_normal

OPS = ("dot_product_attention", "gated_linear_unit", "layer_norm",
       "linear_softmax_cross_entropy_loss", "ragged_dot", "ragged_dot_general",
       "triangle_multiplication")
# Upstream's `ops.gpu` / `ops.tpu` names -> this library's class of the same kernel.
GPU = {
    "Normalization": tokamax.PallasTritonLayerNorm,
    "PallasMosaicFlashAttention": tokamax.PallasMosaicGpuFlashAttention,
    "PallasMosaicGatedLinearUnit": tokamax.PallasMosaicGpuGatedLinearUnit,
    "PallasMosaicRaggedDot": tokamax.PallasMosaicGpuRaggedDot,
    "PallasTritonFlashAttention": tokamax.PallasTritonFlashAttention,
    "PallasTritonGatedLinearUnit": tokamax.PallasTritonGatedLinearUnit,
    "PallasTritonRaggedDot": tokamax.PallasTritonRaggedDot,
}
TPU = {
    "FlashAttention": tokamax.PallasMosaicTpuFlashAttention,
    "LinearSoftmaxCrossEntropyLoss": tokamax.PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
    "RaggedDot": tokamax.PallasMosaicTpuRaggedDot,
}


def test_ops_namespace_holds_the_ops():
    ops = importlib.import_module("tokamax_pass.ops")
    assert tokamax.ops is ops
    for name in OPS:
        assert getattr(ops, name) is getattr(tokamax, name)
    assert ops.DotProductAttentionImplementation is tokamax.DotProductAttentionImplementation
    namespace: dict = {}
    exec("from tokamax_pass.ops import *", namespace)
    assert set(OPS) | {"gpu", "tpu"} <= set(namespace)
    # Upstream's ops that have no implementation here are absent, not stand-ins.
    for missing in ("top_k", "ragged_paged_attention", "experimental"):
        assert not hasattr(ops, missing)


@pytest.mark.parametrize(("platform", "names"), [("gpu", GPU), ("tpu", TPU)])
def test_ops_gpu_and_tpu_name_our_kernels_and_their_configs(platform, names):
    module = getattr(tokamax.ops, platform)
    assert set(module.__all__) == set(names) | {f"{n}Config" for n in names}
    for name, cls in names.items():
        assert getattr(module, name) is cls
        assert getattr(module, f"{name}Config") is cls.config_cls
    assert not hasattr(tokamax.ops.tpu, "V2RaggedDot")


def test_configs_ordered_unlike_upstreams_refuse_positional_fields():
    """Upstream's `PallasTritonFlashAttentionConfig(block_q, block_k, num_stages, num_warps)`
    and TPU `LinearSoftmaxCrossEntropyLossConfig(b, h, v)` order their fields unlike ours:
    a positional call raises rather than swapping two of them."""
    with pytest.raises(TypeError):
        tokamax.ops.gpu.PallasTritonFlashAttentionConfig(64, 64, 3, 4)
    with pytest.raises(TypeError):
        tokamax.ops.tpu.LinearSoftmaxCrossEntropyLossConfig(16, 128, 128)
    config = tokamax.ops.gpu.PallasTritonFlashAttentionConfig(block_q=64, num_stages=2)
    assert (config.block_q, config.num_stages) == (64, 2)


def test_dot_product_attention_implementation_lists_the_accepted_names():
    names = typing.get_args(tokamax.DotProductAttentionImplementation.__value__)
    family = tokamax.dot_product_attention.__globals__["FAMILY"]
    assert set(names) == set(family.implementations) | set(family.aliases)


def test_git_revision_is_a_string_as_upstreams_in_a_source_checkout():
    assert tokamax.__git_revision__ == ""


def test_star_import_brings_the_ops():
    namespace: dict = {}
    exec("from tokamax_pass import *", namespace)
    for name in (*OPS, "DotProductAttentionImplementation", "RaggedDotGroupSizes",
                 "generate_ragged_dot_group_sizes", "moe_dispatch", "moe_combine", "ops",
                 "AllImplementationsFailedError"):
        assert namespace[name] is getattr(tokamax, name)


def _declines(*args, **keywords):
    raise NotImplementedError("declines")


def test_every_implementation_failing_is_an_exception_group_and_not_implemented():
    x = random_normal(0, (2, 8, 64))
    scale = random_normal(1, (64,))
    calls = [
        lambda: tokamax.layer_norm(x, scale, None, implementation=("triton", "mosaic_tpu")),
        # A function in the sequence goes through the callables' dispatch.
        lambda: tokamax.layer_norm(x, scale, None, implementation=(
            _declines, "triton")),
    ]
    for call in calls:
        with pytest.raises(ExceptionGroup, match="no implementation") as info:
            call()
        error = info.value
        assert isinstance(error, NotImplementedError)
        assert isinstance(error, tokamax.AllImplementationsFailedError)
        assert len(error.exceptions) == 2
        assert all(isinstance(e, NotImplementedError) for e in error.exceptions)
        assert "triton" in str(error).lower()
    with pytest.raises(NotImplementedError):  # the clause code written for us uses
        calls[0]()
    try:
        calls[0]()
    except* NotImplementedError as group:
        assert isinstance(group, tokamax.AllImplementationsFailedError)


def test_a_split_group_keeps_its_class():
    error = tokamax.AllImplementationsFailedError(
        "none", [NotImplementedError("a"), NotImplementedError("b")])
    part = error.split(lambda e: str(e) == "a")[0]
    assert isinstance(part, tokamax.AllImplementationsFailedError)
    assert [str(e) for e in part.exceptions] == ["a"]


def test_ragged_dot_every_kernel_failing_under_jit():
    lhs, rhs = random_normal(2, (8, 16)), random_normal(3, (2, 16, 8))
    sizes = jnp.array([3, 5], jnp.int32)
    with pytest.raises(ExceptionGroup):
        jax.jit(lambda a, b: tokamax.ragged_dot(a, b, sizes, implementation=(
            "mosaic_tpu_v2", "mosaic_gpu")))(lhs, rhs)
