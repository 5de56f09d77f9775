"""`implementation=None` with predictions: a calibration for the target ranks kernels
against the plain-JAX paths where nothing was measured (exported for an H200 from CPU)."""


import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from conftest import H200, calibrate, measured
from tokamax_pass import core

LHS = jax.ShapeDtypeStruct((64 * 96, 2048), jnp.bfloat16)
RHS = jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16)
SIZES = jax.ShapeDtypeStruct((64,), jnp.int32)
X = jax.ShapeDtypeStruct((20000, 768), jnp.float32)
SCALE = jax.ShapeDtypeStruct((768,), jnp.float32)


def ragged_loss(lhs, rhs, sizes):
    return tokamax.ragged_dot(lhs, rhs, sizes).astype(jnp.float32).sum()


def norm_loss(x, scale):
    return tokamax.layer_norm(x, scale, None).sum()


def plan(f, *args, device_kind=H200):
    with core.targeting(device_kind):
        return tokamax.optimize(f).plan(*args)


def inner_name(row):
    """The op class a row runs; for a ragged dot VJP op, the ragged dot it runs inside."""
    op = row.bound["op"]
    inner = op["fields"].get("inner")
    return (inner or op)["dataclass"].rpartition(".")[2]


def test_without_a_calibration_none_runs_the_plain_path():
    (row,) = plan(ragged_loss, LHS, RHS, SIZES)
    assert row.op == "RaggedDot" and "predicted" not in row.source


def test_a_kernel_predicted_ten_times_faster_runs_at_an_unmeasured_shape(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonRaggedDot": 0.5, "PallasMosaicGpuRaggedDot": 0.4,
                                "RaggedDot": 0.5})
    (row,) = plan(ragged_loss, LHS, RHS, SIZES)
    # jax.lax.ragged_dot's dense product per group makes XLA 64x the kernels' FLOPs.
    assert row.op == "PallasTritonRaggedDot"
    assert row.source.startswith("heuristics; predicted: PallasTritonRaggedDot")
    assert "PallasMosaicGpuRaggedDot" in row.source and "RaggedDot " in row.source


def test_a_kernel_predicted_within_its_margin_leaves_the_plain_path(calibration_dir):
    # The Triton norm must be predicted faster by more than its margin (0.4).
    calibrate(calibration_dir, {"PallasTritonLayerNorm": 0.8, "LayerNorm": 0.6})
    (row,) = plan(norm_loss, X, SCALE)
    assert row.op == "LayerNorm" and "predicted: PallasTritonLayerNorm" in row.source
    calibrate(calibration_dir, {"PallasTritonLayerNorm": 0.9, "LayerNorm": 0.3})
    (row,) = plan(norm_loss, X, SCALE)
    assert row.op == "PallasTritonLayerNorm"


def test_the_backward_is_predicted_and_chosen_apart_from_the_forward(calibration_dir):
    calibrate(calibration_dir, {
        "PallasTritonLayerNorm": 0.1, "LayerNorm": 0.9,  # forward: XLA stays
        "PallasTritonLayerNormVjp": 0.9, "AutodiffVjp(LayerNorm)": 0.1})  # backward: Triton
    forward, backward = plan(jax.grad(norm_loss, argnums=(0, 1)), X, SCALE)
    assert forward.op == "LayerNorm"
    assert backward.op == "PallasTritonLayerNormVjp"
    assert "predicted: PallasTritonLayerNormVjp" in backward.source
    calibrate(calibration_dir, {
        "PallasTritonRaggedDot": 0.5, "RaggedDot": 0.5,
        "RaggedDotVjp(PallasTritonRaggedDot)": 0.5, "RaggedDotVjp(RaggedDot)": 0.5})
    forward, backward = plan(jax.grad(ragged_loss, argnums=(0, 1)), LHS, RHS, SIZES)
    assert inner_name(forward) == inner_name(backward) == "PallasTritonRaggedDot"
    # The plan names the kernel the VJP's ragged dots run, not the XLA code around them.
    assert (backward.implementation, backward.op) == (
        "triton", "RaggedDotVjp(PallasTritonRaggedDot)")


def test_a_fine_grained_grouped_glu_runs_the_kernel_its_ragged_dot_predicts(calibration_dir):
    """A grouped GLU has no calibration points of its own: it is predicted as the ragged
    dot it runs, so at 64 experts (XLA's dense product per group) the Mosaic GPU kernel
    runs, forward and gradient, on a shape nobody measured."""
    calibrate(calibration_dir, {"PallasMosaicGpuRaggedDot": 0.5, "RaggedDot": 0.5,
                                "RaggedDotVjp(PallasMosaicGpuRaggedDot)": 0.5,
                                "RaggedDotVjp(RaggedDot)": 0.5,
                                "GatedLinearUnit": 0.9, "GatedLinearUnitVjp": 0.9})
    x = jax.ShapeDtypeStruct((64 * 24, 2048), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((64, 2048, 2, 1408), jnp.bfloat16)

    def glu_loss(x, weights, sizes):
        out = tokamax.gated_linear_unit(x, weights, group_sizes=sizes, activation=jax.nn.silu)
        return out.astype(jnp.float32).sum()

    forward, backward = plan(jax.grad(glu_loss, argnums=(0, 1)), x, weights, SIZES)
    assert forward.op == "PallasMosaicGpuGatedLinearUnit"
    assert "predicted: PallasMosaicGpuGatedLinearUnit" in forward.source
    assert backward.op == "PallasMosaicGpuGatedLinearUnitVjp"


def test_measurements_override_predictions(calibration_dir):
    from tokamax_kernels.ragged_dot import PallasTritonRaggedDot, RaggedDot

    calibrate(calibration_dir, {"PallasTritonRaggedDot": 0.5, "RaggedDot": 0.5})
    result = measured(H200, {RaggedDot(): 1.0, PallasTritonRaggedDot(): 2.0}, LHS, RHS, SIZES)
    with result:
        (row,) = plan(ragged_loss, LHS, RHS, SIZES)
    assert row.op == "RaggedDot" and "predicted" not in row.source


def test_a_calibration_for_another_device_kind_predicts_nothing_here(calibration_dir):
    calibrate(calibration_dir, {"PallasTritonRaggedDot": 0.5, "RaggedDot": 0.5},
              device_kind="NVIDIA H100 80GB HBM3")
    (row,) = plan(ragged_loss, LHS, RHS, SIZES)
    assert row.op == "RaggedDot"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_predicted_choice_on_this_machine_computes_the_loss(calibration_dir, dtype):
    """With a calibration for this CPU predicting the chunked XLA loss far faster, `None`
    runs it forward and backward (the plan says so), with the reference's loss and
    gradients."""
    from conftest import assert_close, random_normal
    from tokamax_kernels.linear_softmax_cross_entropy_loss import LinearSoftmaxCrossEntropyLoss

    calibrate(calibration_dir, {
        "XlaChunkedLinearSoftmaxCrossEntropyLoss": 0.9, "LinearSoftmaxCrossEntropyLoss": 0.01,
        "XlaChunkedLinearSoftmaxCrossEntropyLossVjp": 0.9,
        "LinearSoftmaxCrossEntropyLossVjp": 0.01}, device_kind=jax.devices()[0].device_kind)
    x, w = random_normal(0, (2, 48, 32), dtype), random_normal(1, (32, 200), dtype)
    labels = jax.random.randint(jax.random.key(2), (2, 48), 0, 200)
    cotangent = random_normal(3, (), jnp.float32)

    def f(x, w):
        return tokamax.linear_softmax_cross_entropy_loss(x, labels, w) * cotangent

    def reference(x, w):
        with jax.default_matmul_precision("highest"):
            return LinearSoftmaxCrossEntropyLoss()(
                x.astype(jnp.float32), labels, w.astype(jnp.float32)) * cotangent

    rows = tokamax.optimize(jax.grad(f, argnums=(0, 1))).plan(x, w)
    assert [r.op for r in rows] == ["XlaChunkedLinearSoftmaxCrossEntropyLoss",
                                    "XlaChunkedLinearSoftmaxCrossEntropyLossVjp"]
    assert all("predicted: XlaChunked" in r.source for r in rows)
    assert_close(f(x, w), reference(x, w), dtype)
    for grad, ref_grad in zip(jax.grad(f, argnums=(0, 1))(x, w),
                              jax.grad(reference, argnums=(0, 1))(x, w), strict=True):
        assert_close(grad, ref_grad, dtype)


def test_a_gradient_that_reruns_its_forward_counts_at_its_share(calibration_dir):
    """XLA's dense GLU gradient reruns the products, which XLA merges with the forward's
    inside a program: a kernel gradient predicted 1.6x faster than it alone is not
    faster than its share of it, and XLA's stays; 2.5x faster is."""
    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2048, 2, 5632), jnp.bfloat16)

    def glu_loss(x, w):
        return tokamax.gated_linear_unit(x, w).astype(jnp.float32).sum()

    for kernel, expected in ((0.8, "GatedLinearUnitVjp"),
                             (0.5 * 2.5, "PallasTritonGatedLinearUnitVjp")):
        calibrate(calibration_dir, {"GatedLinearUnit": 0.5, "GatedLinearUnitVjp": 0.5,
                                    "PallasTritonGatedLinearUnitVjp": kernel})
        _, backward = plan(jax.grad(glu_loss, argnums=(0, 1)), x, w)
        assert backward.op == expected, backward.source


def test_a_work_rule_that_fails_gives_no_prediction_not_a_failed_call(calibration_dir,
                                                                      monkeypatch, caplog):
    from tokamax_kernels.ragged_dot import RaggedDot
    from tokamax_pass.core import roofline

    calibrate(calibration_dir, {"PallasTritonRaggedDot": 0.5, "RaggedDot": 0.5})

    def broken(ba):
        raise KeyError("a field the rule expected")

    monkeypatch.setitem(roofline.FAMILY_WORK, RaggedDot, roofline.FamilyWork(broken))
    monkeypatch.delitem(roofline.PERFORMED_WORK, RaggedDot)
    (row,) = plan(ragged_loss, LHS, RHS, SIZES)
    assert row.op == "RaggedDot" and "predicted" not in row.source
    assert "no prediction for PallasTritonRaggedDot" in caplog.text


def test_a_cpu_export_weighs_kernels_against_cudnn_it_cannot_lower(calibration_dir):
    """cuDNN's attention runs on the H200 but cannot be lowered here: its prediction still
    bounds the kernels. Mosaic predicted 3x faster runs; within the margin too, the export
    runs the fused kernel rather than the materializing XLA attention, and says the target
    would run cuDNN."""
    q = jax.ShapeDtypeStruct((2, 4096, 16, 128), jnp.float16)  # no float16 call was measured

    def attention(q):
        return tokamax.dot_product_attention(q, q, q, is_causal=True)

    calibrate(calibration_dir, {"CudnnDotProductAttention": 0.3, "DotProductAttention": 0.05,
                                "PallasMosaicGpuFlashAttention": 0.9})
    (row,) = plan(attention, q)
    assert row.op == "PallasMosaicGpuFlashAttention", row.source
    assert "predicted: PallasMosaicGpuFlashAttention" in row.source
    calibrate(calibration_dir, {"CudnnDotProductAttention": 0.3, "DotProductAttention": 0.05,
                                "PallasMosaicGpuFlashAttention": 0.31})
    (row,) = plan(attention, q)
    assert row.op == "PallasMosaicGpuFlashAttention", row.source
    assert "cudnn on the target" in row.source


def test_a_norm_gradient_is_predicted_at_its_whole_time(calibration_dir):
    """XLA's norm gradient reruns only the row statistics: a Triton gradient predicted at
    0.7 of its time runs (it would not against half of it), one at 0.9 does not (the
    kernel's margin)."""
    for kernel, expected in ((0.5 / 0.7, "PallasTritonLayerNormVjp"),
                             (0.5 / 0.9, "AutodiffVjp(LayerNorm)")):
        calibrate(calibration_dir, {"PallasTritonLayerNorm": 0.5, "LayerNorm": 0.5,
                                    "PallasTritonLayerNormVjp": kernel,
                                    "AutodiffVjp(LayerNorm)": 0.5})
        _, backward = plan(jax.grad(norm_loss, argnums=(0, 1)), X, SCALE)
        assert backward.op == expected, backward.source
