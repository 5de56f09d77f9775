"""Exports for a GPU from this CPU machine under an abstract mesh that carries the device
(`AbstractMesh(..., abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))`, the way
JAX documents ahead-of-time lowering), with Explicit axes (the default) and Auto axes.

Every Triton kernel family lowers there (the Explicit mesh keeps its device, or the
lowering fails with "No supported GPU devices found"), and the attention gradient at b4 s8192 h16
d128, where the target would run cuDNN (which cannot be lowered here), holds the fused
Mosaic kernels, never the materializing XLA attention, and the export says so."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass as tokamax
from tokamax_pass.core import Target
from tokamax_pass.export import ExportFallbackWarning

H200 = AbstractDevice("NVIDIA H200", None, "cuda")
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _mesh(axes: str) -> AbstractMesh:
    return AbstractMesh((1,), ("x",), axis_types=(AXIS_TYPES[axes],), abstract_device=H200)


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export_grad(axes, loss, *specs, argnums=None):
    argnums = tuple(range(len(specs))) if argnums is None else argnums
    with jax.sharding.use_abstract_mesh(_mesh(axes)):
        return tokamax.export(jax.grad(loss, argnums=argnums), *specs, platforms=["cuda"])


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_attention_gradient_for_the_h200_holds_the_fused_kernels_and_says_so(axes):
    spec = _sds((4, 8192, 16, 128))

    def loss(q, k, v):
        return jnp.sum(tokamax.dot_product_attention(q, k, v).astype(jnp.float32))

    with pytest.warns(ExportFallbackWarning, match="mosaic in place of cudnn") as warned:
        artifact = _export_grad(axes, loss, spec, spec, spec)
    # The warning names the caller's line (`_export_grad`'s export call), not the library's.
    assert {w.filename for w in warned} == {__file__}
    rows = {row["path"]: row for row in artifact.manifest["ops"]}
    assert {path: row["implementation"] for path, row in rows.items()} == {
        "dot_product_attention": "mosaic", "dot_product_attention_vjp": "mosaic"}
    assert artifact.manifest["fallbacks"] == [
        {"path": path, "platform": "cuda", "device_kind": "NVIDIA H200",
         "target_runs": "cudnn", "exported": "mosaic"}
        for path in ("dot_product_attention", "dot_product_attention_vjp")]
    assert artifact.manifest["custom_calls"] == ["mosaic_gpu_v2"]
    # No materialized (b, h, s, s) logits: the XLA backward's 4x16x8192x8192 tensors.
    assert "tensor<4x16x8192x8192" not in artifact.mlir_text()


def _attention(q, k, v):
    return tokamax.dot_product_attention(q, k, v, implementation="triton")


def _layer_norm(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, implementation="triton")


def _glu(x, weights):
    return tokamax.gated_linear_unit(x, weights, activation=jax.nn.swish,
                                     implementation="triton")


def _ragged_dot(lhs, rhs):
    return tokamax.ragged_dot(lhs, rhs, jnp.array([64, 0, 128, 64], jnp.int32),
                              implementation="triton")


# Each family's call and the implementations of its forward and gradient rows: the
# ragged dot's gradient is the family's XLA one (ragged dots of their own, resolved apart).
TRITON_CALLS = {
    "attention": (_attention, [_sds((2, 256, 4, 64))] * 3, ["triton", "triton"]),
    "layer_norm": (_layer_norm, [_sds((2, 128, 256)), _sds((256,)), _sds((256,))],
                   ["triton", "triton"]),
    "gated_linear_unit": (_glu, [_sds((2, 64, 128)), _sds((128, 2, 128))],
                          ["triton", "triton"]),
    "ragged_dot": (_ragged_dot, [_sds((256, 128)), _sds((4, 128, 128))], ["triton", "triton"]),
}


@pytest.mark.parametrize("family", list(TRITON_CALLS))
def test_every_triton_kernel_family_lowers_under_the_explicit_abstract_mesh(family):
    fn, specs, implementations = TRITON_CALLS[family]

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32))

    artifact = _export_grad("explicit", loss, *specs)
    assert [row["implementation"] for row in artifact.manifest["ops"]] == implementations
    assert any(call.startswith("__gpu") for call in artifact.manifest["custom_calls"])


@pytest.mark.parametrize("device_kind, exported", [
    # A Hopper GPU with nothing measured or calibrated: the target itself runs cuDNN's
    # attention (the family's first plain path), so the fused kernel stands in for it.
    ("NVIDIA H100 80GB HBM3", "mosaic"),
    # No device kind: any GPU. No kernel lowers without knowing it (Triton) or runs on
    # every GPU (Mosaic needs Hopper): the XLA attention, and the export says so.
    (None, "xla"),
])
def test_a_gpu_nothing_was_measured_on_gets_what_its_plain_path_stands_for(device_kind,
                                                                           exported):
    spec = _sds((4, 2048, 16, 128))

    def loss(q, k, v):
        return jnp.sum(tokamax.dot_product_attention(q, k, v).astype(jnp.float32))

    named = re.escape(device_kind or "any device kind")  # not "(None)"
    with pytest.warns(ExportFallbackWarning,
                      match=f"on cuda \\({named}\\): {exported} in place of cudnn"):
        artifact = tokamax.export(jax.grad(loss, argnums=(0, 1, 2)), spec, spec, spec,
                                  platforms=["cuda"], device_kind=device_kind)
    assert [row["implementation"] for row in artifact.manifest["ops"]] == [exported] * 2


def test_kernels_refuse_a_gpu_of_no_known_kind_naming_the_fix():
    """What `None` skipped above: a Triton kernel cannot lower without the GPU's kind (JAX
    failed deep in the lowering), and a Mosaic kernel needs to know it is a Hopper GPU."""
    q = _sds((2, 256, 2, 64))
    anonymous = Target("cuda", None)
    for op, why in ((tokamax.PallasTritonFlashAttention(), "lowers for a known GPU: name it"),
                    (tokamax.PallasMosaicGpuFlashAttention(), "needs a Hopper GPU"),
                    (tokamax.PallasTritonLayerNorm(), "lowers for a known GPU: name it")):
        args = (q, None, None) if isinstance(op, tokamax.LayerNorm) else (q, q, q)
        with pytest.raises(NotImplementedError, match=why):
            op.check_supported(op.bind(*args), anonymous)
        op.check_supported(op.bind(*args), Target("cuda", "NVIDIA H200"))
