"""Predictions: roofline math, calibration files (and bad ones), the interpolation."""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from tokamax_pass.core import calibration, prediction
from tokamax_pass.core.roofline import Ceilings, Work

CEILINGS = {"bf16_tflops": 800.0, "f32_tflops": 50.0, "hbm_tbps": 4.0}


# A point of no op, measured at a picosecond: the shortest measured call, which floors
# every prediction (`Calibration.fastest_seconds`), stays below what these tests predict.
# `test_no_prediction_goes_below_the_shortest_measured_call` tests the floor itself.
NO_FLOOR = ("no op", "bfloat16", 1.0, 1.0, 1.0)


def calibration_file(points, device_kind="NVIDIA H200", *, floor=NO_FLOOR, **changes):
    points = [*points, *([floor] if floor else [])]
    data = {"schema": calibration.SCHEMA, "version": calibration.VERSION,
            "device_kind": device_kind, "ceilings": CEILINGS,
            "points": [dict(zip(("op", "dtype", "flops", "bytes", "efficiency", "features"),
                                p, strict=False)) for p in points]}
    return {**data, **changes}


def ragged_dot_calls(op, m, k, n, groups):
    """`(forward, vjp)`: `op`'s bf16 call of (m, k) rows against (groups, k, n) weights,
    and its VJP op's call, on shapes only."""
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
    forward = op.bind(lhs, rhs, jax.ShapeDtypeStruct((groups,), jnp.int32))
    out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    return forward, op.vjp_op().bind(None, out, out, **forward.arguments)


def test_roofline_is_the_slower_of_compute_and_memory_per_dtype():
    ceilings = Ceilings(**CEILINGS)
    compute_bound = Work(flops=8e12, bytes=4e9)
    assert ceilings.roofline_seconds(compute_bound, "bfloat16") == pytest.approx(1e-2)
    assert ceilings.roofline_seconds(compute_bound, "float32") == pytest.approx(0.16)
    memory_bound = Work(flops=1e9, bytes=4e10)
    assert ceilings.roofline_seconds(memory_bound, "bfloat16") == pytest.approx(1e-2)
    assert ceilings.roofline_seconds(memory_bound, "int8") is None


def test_efficiency_interpolates_near_points_and_falls_back_to_the_nearest():
    cal = calibration.parse(json.dumps(calibration_file([
        ("K", "bfloat16", 1e12, 1e9, 0.8), ("K", "bfloat16", 2e12, 2e9, 0.4),
        ("K", "bfloat16", 1e15, 1e12, 0.1), ("K", "float32", 1e12, 1e9, 0.3)])))
    assert prediction.efficiency(cal, "K", "bfloat16", Work(1e12, 1e9)) == pytest.approx(
        (0.8, True), rel=0.05)
    between, near = prediction.efficiency(cal, "K", "bfloat16", Work(1.41e12, 1.41e9))
    assert near and 0.4 < between < 0.8
    # Far from every point: the nearest few, weighted by closeness, not counted as near.
    small, near = prediction.efficiency(cal, "K", "bfloat16", Work(1e6, 1e6))
    large, _ = prediction.efficiency(cal, "K", "bfloat16", Work(1e18, 1e15))
    assert not near and 0.1 < large < small < 0.8
    # No point of the dtype: the op's median over all of them.
    assert prediction.efficiency(cal, "K", "float16", Work(1e12, 1e9)) == (
        pytest.approx(0.35), False)
    assert prediction.efficiency(cal, "other", "bfloat16", Work(1e12, 1e9)) is None


def test_points_are_matched_on_the_familys_shape_features_too():
    cal = calibration.parse(json.dumps(calibration_file([
        ("K", "float32", 1e12, 1e9, 0.8, [6.0]), ("K", "float32", 1e12, 1e9, 0.2, [8.0])])))
    assert cal.points[0].features == (6.0,)
    assert prediction.efficiency(cal, "K", "float32", Work(1e12, 1e9), (6.0,)) == (
        pytest.approx(0.8, rel=0.01), True)
    assert prediction.efficiency(cal, "K", "float32", Work(1e12, 1e9), (8.0,)) == (
        pytest.approx(0.2, rel=0.01), True)
    # A call without features (another family's rule) is matched on its work alone.
    assert prediction.efficiency(cal, "K", "float32", Work(1e12, 1e9))[0] == pytest.approx(0.4)


def test_a_point_of_the_calls_own_feature_beats_a_closer_size_of_another():
    # The call: work (1e12, 1e9) at feature 8. One point of feature 6 at the call's work,
    # two log2 steps away in its feature alone; one of feature 8 at 4x the FLOPs and
    # bytes, 2.8 steps away in work. A feature step counts `FEATURE_WEIGHT` times a step
    # in work, so the point of the call's own feature decides.
    cal = calibration.parse(json.dumps(calibration_file([
        ("K", "float32", 1e12, 1e9, 0.8, [6.0]), ("K", "float32", 4e12, 4e9, 0.1, [8.0])])))
    found, _ = prediction.efficiency(cal, "K", "float32", Work(1e12, 1e9), (8.0,))
    assert found < 0.3


def test_attention_head_dim_sets_which_points_a_prediction_uses():
    from tokamax_kernels.attention import DotProductAttention, PallasTritonFlashAttention

    q64 = jax.ShapeDtypeStruct((2, 1024, 8, 64), jnp.float32)
    q256 = jax.ShapeDtypeStruct((2, 1024, 8, 256), jnp.float32)
    calls = [PallasTritonFlashAttention().bind(q, q, q) for q in (q64, q256)]
    assert [prediction.call_features(ba) for ba in calls] == [(6.0,), (8.0,)]
    vjp = PallasTritonFlashAttention().vjp_op().bind(None, q256, q256, query=q256, key=q256,
                                                     value=q256)
    assert prediction.call_features(vjp) == (8.0,)
    works = [DotProductAttention().roofline(ba) for ba in calls]
    # Both points at each call's work: only the head dim tells them apart.
    cal = calibration.parse(json.dumps(calibration_file([
        ("PallasTritonFlashAttention", "float32", w.flops, w.bytes, e, [f])
        for w in works for e, f in ((0.6, 6.0), (0.1, 8.0))])))
    fast, slow = (prediction.predict(ba, cal) for ba in calls)
    assert fast.efficiency > 0.5 and slow.efficiency < 0.15


def test_predict_divides_the_roofline_of_the_performed_work_by_the_efficiency():
    from tokamax_kernels.ragged_dot import PallasTritonRaggedDot, RaggedDot

    lhs = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    cal = calibration.parse(json.dumps(calibration_file([
        ("PallasTritonRaggedDot", "bfloat16", 1e9, 1e9, 0.5),
        ("RaggedDot", "bfloat16", 1e9, 1e9, 0.5)])))
    kernel = prediction.predict(PallasTritonRaggedDot().bind(lhs, rhs, sizes), cal)
    flops = 2.0 * 4096 * 2048 * 1408
    moved = 2 * (4096 * 2048 + 64 * 2048 * 1408 + 4096 * 1408)
    assert kernel.seconds == pytest.approx(max(flops / 800e12, moved / 4e12) / 0.5)
    # The `xla` form on a GPU: tiles of T rows padded at group boundaries, each tile's
    # matrix gathered (read and written) and read again by its matmul.
    from tokamax_kernels.ragged_dot import xla_tiled

    problem = xla_tiled.Problem(m=4096, groups=64, k=2048, n=1408, itemsize=2)
    assert xla_tiled.DEFAULT_RULE.prefers_tiled(problem)
    tile = xla_tiled.DEFAULT_RULE.tile_rows(problem)
    tiles = -(-4096 // tile) + 64
    tiled = prediction.predict(RaggedDot().bind(lhs, rhs, sizes), cal)
    assert tiled.seconds == pytest.approx(max(2.0 * tiles * tile * 2048 * 1408 / 800e12,
                                              (moved + 3 * tiles * 2048 * 1408 * 2) / 4e12) / 0.5)
    # Where the rule keeps `jax.lax.ragged_dot` (one matrix per group read once dominates):
    # a dense product per group, the groups times the FLOPs.
    few_rows = jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16)
    problem = xla_tiled.Problem(m=64, groups=64, k=2048, n=1408, itemsize=2)
    assert not xla_tiled.DEFAULT_RULE.prefers_tiled(problem)
    lax = prediction.predict(RaggedDot().bind(few_rows, rhs, sizes), cal)
    moved = 2 * (64 * 2048 + 64 * 2048 * 1408 + 64 * 1408)
    flops = 2.0 * 64 * 2048 * 1408
    assert lax.seconds == pytest.approx(max(64 * flops / 800e12, moved / 4e12) / 0.5)


def test_a_grouped_glu_is_predicted_as_its_ragged_dot_and_its_gradient_as_theirs():
    from tokamax_kernels.gated_linear_unit import GatedLinearUnit
    from tokamax_kernels.gated_linear_unit.pallas_mosaic_gpu import PallasMosaicGpuGatedLinearUnit
    from tokamax_kernels.ragged_dot import PallasMosaicGpuRaggedDot, RaggedDot

    x = jax.ShapeDtypeStruct((1536, 2048), jnp.bfloat16)
    fused = jax.ShapeDtypeStruct((64, 2048, 2, 1408), jnp.bfloat16)
    pair = (jax.ShapeDtypeStruct((64, 2048, 1408), jnp.bfloat16),) * 2
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    both = jax.ShapeDtypeStruct((64, 2048, 2816), jnp.bfloat16)
    # The family's own points are dense calls: a grouped call must not be read off them.
    cal = calibration.parse(json.dumps(calibration_file([
        ("PallasMosaicGpuRaggedDot", "bfloat16", 1e9, 1e9, 0.6),
        ("RaggedDot", "bfloat16", 1e9, 1e9, 0.2),
        ("GatedLinearUnit", "bfloat16", 1e9, 1e9, 0.9)])))
    for op, ragged in ((PallasMosaicGpuGatedLinearUnit(), PallasMosaicGpuRaggedDot()),
                       (GatedLinearUnit(), RaggedDot())):
        gemm = prediction.predict(ragged.bind(x, both, sizes), cal)
        for weights in (fused, pair):
            call = op.bind(x, weights, group_sizes=sizes, activation=jax.nn.silu)
            assert prediction.predict(call, cal) == gemm
    # The gradient: the (G, K, 2N) ragged dot's gradient, read off the gradient's points
    # (half the forward's efficiency here), for either weights form.
    with_vjp = calibration.parse(json.dumps(calibration_file([
        ("PallasMosaicGpuRaggedDot", "bfloat16", 1e9, 1e9, 0.6),
        ("RaggedDotVjp(PallasMosaicGpuRaggedDot)", "bfloat16", 1e9, 1e9, 0.3)])))
    _, ragged_vjp = ragged_dot_calls(PallasMosaicGpuRaggedDot(), 1536, 2048, 2816, 64)
    want = prediction.predict(ragged_vjp, with_vjp)
    assert want.efficiency == pytest.approx(0.3)
    kernel = PallasMosaicGpuGatedLinearUnit()
    out = jax.ShapeDtypeStruct((1536, 1408), jnp.bfloat16)
    for weights in (fused, pair):
        call = kernel.bind(x, weights, group_sizes=sizes, activation=jax.nn.silu)
        vjp = kernel.vjp_op().bind(None, out, out, **call.arguments)
        assert prediction.predict(vjp, with_vjp) == want
    # A dense call keeps the family's points.
    dense = GatedLinearUnit().bind(x, jax.ShapeDtypeStruct((2048, 2, 1408), jnp.bfloat16),
                                   activation=jax.nn.silu)
    assert prediction.predict(dense, cal).efficiency == pytest.approx(0.9)


def test_vjp_work_is_the_sum_of_its_nested_calls_or_the_familys_gradient():
    from tokamax_kernels.layer_norm import LayerNorm
    from tokamax_kernels.ragged_dot import PallasTritonRaggedDot

    forward, vjp = ragged_dot_calls(PallasTritonRaggedDot(), 512, 256, 128, 8)
    assert prediction.op_name(vjp.op) == "RaggedDotVjp(PallasTritonRaggedDot)"
    assert prediction.call_work(vjp).flops == pytest.approx(2 * forward.op.roofline(forward).flops)
    x = jax.ShapeDtypeStruct((4, 1024), jnp.float32)
    norm = LayerNorm().bind(x, jax.ShapeDtypeStruct((1024,), jnp.float32), None)
    norm_vjp = LayerNorm().vjp_op().bind(None, x, x, **norm.arguments)
    assert prediction.op_name(norm_vjp.op) == "AutodiffVjp(LayerNorm)"
    assert prediction.call_work(norm_vjp) == LayerNorm().vjp_roofline(norm)


def test_causal_attention_does_about_half_the_work():
    from tokamax_kernels.attention import DotProductAttention

    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    full = DotProductAttention().bind(q, q, q)
    causal = DotProductAttention().bind(q, q, q, is_causal=True)
    ratio = causal.op.roofline(causal).flops / full.op.roofline(full).flops
    assert ratio == pytest.approx(1025 / 2048)


def _write(folder, text):
    path = folder / "nvidia_h200.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return path


@pytest.mark.parametrize("bad", [
    calibration_file([], schema="something else"),
    calibration_file([], version=2),
    calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5)], ceilings={"bf16_tflops": 1.0}),
    # Roofline times overflowed: every prediction was infinite, silently.
    calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5)],
                     ceilings={**CEILINGS, "bf16_tflops": 1e-300}),
    calibration_file([("K", "bfloat16", 1e9, 1e9, -0.5)]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, 50.0)]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, "0.5")]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, True)]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5, "6")]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5, [1e300])]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5, [1.0] * 20)]),
    calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5, [True])]),
    calibration_file([(["K"], "bfloat16", 1e9, 1e9, 0.5)]),
    calibration_file([("K" * 1000, "bfloat16", 1e9, 1e9, 0.5)]),
    calibration_file([], extra={"code": "import os"}),
    calibration_file([], provenance={"commit": {"nested": "object"}}),
    {**calibration_file([]), "points": {"not": "a list"}},
    # A file with its points given twice (hand-merged) would load the last list alone.
    json.dumps(calibration_file([("K", "bfloat16", 1e9, 1e9, 0.5)]))[:-1] + ', "points": []}',
    '{"schema": "tokamax_pass.calibration", "version": 1, "device_kind": "NVIDIA H200", '
    '"ceilings": {"bf16_tflops": NaN, "f32_tflops": 1, "hbm_tbps": 1}, "points": []}',
    '{"schema": "tokamax_pass.calibration", "version": 1, "device_kind": "NVIDIA H200", '
    '"ceilings": {"bf16_tflops": 1, "f32_tflops": Infinity, "hbm_tbps": 1}, "points": []}',
    '{"schema": "tokamax_pass.calibration", "version": 1, "device_kind": "NVIDIA H200", '
    '"ceilings": {"bf16_tflops": 1' + "0" * 400 + ', "f32_tflops": 1, "hbm_tbps": 1}, '
    '"points": []}',
    '{"schema": "tokamax_pass.calibration", "version": 1, "device_kind": "NVIDIA H200", '
    '"ceilings": {"bf16_tflops": 1' + "0" * 5000 + ', "f32_tflops": 1, "hbm_tbps": 1}, '
    '"points": []}',
    "[" * 100_000 + "]" * 100_000,
    "not json",
    " " * (calibration.MAX_FILE_BYTES + 1),
], ids=lambda bad: str(bad)[:40])
def test_a_bad_calibration_file_is_reported_and_ignored(calibration_dir, bad):
    _write(calibration_dir, bad)
    with pytest.warns(UserWarning, match="ignoring the calibration file"):
        assert calibration.for_device_kind("NVIDIA H200") is None


def test_too_many_points_are_refused():
    point = ("K", "bfloat16", 1e9, 1e9, 0.5)
    with pytest.raises(calibration.CalibrationError, match="at most"):
        calibration.parse(json.dumps(calibration_file([point] * (calibration.MAX_POINTS + 1))))


def test_ceilings_of_a_slow_machine_load():
    """A CPU timing tiny calls by wall clock measures well under a gigabyte a second (a
    sweep fitted there read 0.00074 TB/s); such ceilings are a machine's, not damage."""
    slow = {"bf16_tflops": 0.05, "f32_tflops": 0.02, "hbm_tbps": 0.0005}
    loaded = calibration.parse(json.dumps(calibration_file([], ceilings=slow)))
    assert loaded.ceilings == Ceilings(**slow)


def test_a_good_file_loads_for_its_device_kind_only(calibration_dir):
    _write(calibration_dir, calibration_file([("K", "float32", 1e9, 1e9, 0.5)], floor=None,
                                             provenance={"commit": "abc"}))
    loaded = calibration.for_device_kind("NVIDIA H200")
    assert loaded.ceilings == Ceilings(**CEILINGS)
    assert loaded.points == (calibration.Point("K", "float32", 1e9, 1e9, 0.5),)
    assert calibration.for_device_kind("NVIDIA H100") is None  # no file
    assert calibration.for_device_kind(None) is None
    # A file whose device kind is not the one its name says is not used.
    (calibration_dir / "nvidia_h100.json").write_text(json.dumps(calibration_file([])))
    assert calibration.for_device_kind("NVIDIA H100") is None
    # An edited file is read again.
    _write(calibration_dir, calibration_file([("K", "float32", 1e9, 1e9, 0.25)],
                                             provenance={"commit": "abcd"}))
    assert calibration.for_device_kind("NVIDIA H200").points[0].efficiency == 0.25
    assert math.isfinite(loaded.ceilings.hbm_tbps)


def test_the_vjp_argument_names_are_the_vjp_modules():
    from tokamax_pass.core import vjp

    assert set(vjp.RESERVED_NAMES) == prediction.NOT_FORWARD


def test_no_prediction_goes_below_the_shortest_measured_call():
    """Efficiencies fitted on large calls would put a tiny call far below anything the
    device ever ran (0.1 us attention); every implementation then waits the shortest
    measured call, and none is predicted faster than another there."""
    from tokamax_kernels.ragged_dot import PallasTritonRaggedDot, RaggedDot

    cal = calibration.parse(json.dumps(calibration_file([
        ("PallasTritonRaggedDot", "bfloat16", 1e9, 1e9, 0.5),
        ("RaggedDot", "bfloat16", 1e9, 1e9, 0.25)], floor=None)))
    shortest = max(1e9 / 800e12, 1e9 / 4e12) / 0.5  # the kernel's point: 0.5 ms
    assert cal.fastest_seconds == pytest.approx(shortest)
    tiny = [op.bind(jax.ShapeDtypeStruct((64, 128), jnp.bfloat16),
                    jax.ShapeDtypeStruct((4, 128, 128), jnp.bfloat16),
                    jax.ShapeDtypeStruct((4,), jnp.int32))
            for op in (PallasTritonRaggedDot(), RaggedDot())]
    kernel, plain = (prediction.predict(ba, cal) for ba in tiny)
    assert kernel.seconds == plain.seconds == pytest.approx(shortest)
    large = tiny[0].op.bind(jax.ShapeDtypeStruct((65536, 8192), jnp.bfloat16),
                            jax.ShapeDtypeStruct((4, 8192, 8192), jnp.bfloat16),
                            jax.ShapeDtypeStruct((4,), jnp.int32))
    assert prediction.predict(large, cal).seconds > 2 * shortest  # no floor up there
