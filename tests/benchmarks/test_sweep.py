"""The calibration sweep and its grids, tiny on CPU."""

import argparse
import json
import os

import numpy as np
import pytest

from benchmarks import shapes, sweep


def test_grids_stay_under_the_byte_bound_and_cover_the_moe_space():
    for family in shapes.FAMILIES:
        calls = shapes.grid(family)
        assert calls
        assert all(shapes.call_bytes(family, p) <= shapes.MAX_CALL_BYTES for p in calls)
    ragged = shapes.grid("ragged_dot")
    assert {p["groups"] for p in ragged} >= {8, 64, 256}
    assert {(p["k"], p["n"]) for p in ragged} >= {(2048, 1408), (7168, 2048), (4096, 14336)}
    assert {p["skewed"] for p in ragged} == {False, True}
    assert {p["dtype"] for p in ragged} == {"bfloat16", "float32"}


def test_skewed_group_sizes_sum_to_the_rows_and_are_uneven():
    sizes = shapes.group_sizes(16, 64, skewed=True, seed=3)
    assert sizes.sum() == 16 * 64 and sizes.min() >= 0
    assert sizes.max() > 4 * np.median(sizes)
    assert (shapes.group_sizes(4, 8, skewed=False, seed=0) == 8).all()


def test_tiny_run_writes_rows_incrementally_and_resumes(tmp_path):
    out = tmp_path / "sweep.jsonl"
    args = ["run", "--tiny", "--families", "layer_norm,ragged_dot", "--iterations", "3",
            "--method", "wallclock", "--out", str(out)]
    assert sweep.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = [r for r in rows if "ms" in r and r["kind"] != "ceiling"]
    assert {r["implementation"] for r in rows if r["kind"] == "ceiling" and "ms" in r} == {
        "matmul bfloat16", "matmul float32", "copy"}
    assert {(r["family"], r["implementation"], r["direction"]) for r in timed} == {
        ("layer_norm", "xla", "forward"), ("layer_norm", "xla", "vjp"),
        ("ragged_dot", "xla", "forward"), ("ragged_dot", "xla", "vjp"),
        ("ragged_dot", "jax.lax.ragged_dot", "forward"),
        ("ragged_dot", "jax.lax.ragged_dot", "vjp")}
    assert all(r["ms"] > 0 and r["iterations"] >= sweep.MIN_ITERATIONS for r in timed)
    # Kernels this machine cannot run are recorded as such, not dropped.
    assert any(r["implementation"] == "triton" and "error" in r for r in rows)
    assert sweep.main(args) == 0  # everything is measured: nothing is added
    assert len(out.read_text().splitlines()) == len(rows)


def test_a_run_stops_at_its_deadline(tmp_path):
    out = tmp_path / "sweep.jsonl"
    assert sweep.main(["run", "--tiny", "--families", "layer_norm", "--max-seconds", "0",
                       "--out", str(out)]) == 0
    assert out.read_text() == ""


def test_worker_shards_split_the_plan_without_overlap():
    families = ["layer_norm", "ragged_dot"]
    whole = [json.dumps(c, sort_keys=True) for c in sweep._plan(families, 3, tiny=True)]
    shards = [[json.dumps(c, sort_keys=True) for c in sweep._plan(families, 3, True, (i, 3))]
              for i in range(3)]
    assert sorted(c for shard in shards for c in shard) == sorted(whole)
    assert all(shards)
    with pytest.raises(argparse.ArgumentTypeError):
        sweep.shard_argument("3/3")


def test_fit_writes_a_calibration_that_loads_and_predicts_the_measured_calls(tmp_path, capsys):
    from benchmarks import sweep_fit
    from tokamax_pass.core import calibration, prediction

    results = tmp_path / "sweep.jsonl"
    assert sweep.main(["run", "--tiny", "--families", "layer_norm,ragged_dot",
                       "--iterations", "3", "--method", "wallclock", "--out",
                       str(results)]) == 0
    out = tmp_path / "cal.json"
    capsys.readouterr()
    assert sweep.main(["fit", str(results), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.split("\nwrote ")[0])
    rule = printed["held_out"]["rule"]
    assert rule and all(0 <= e["within"] <= e["calls"] for e in rule.values())
    loaded = calibration.parse(out.read_text())
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert loaded.ceilings == sweep_fit.measured_ceilings(rows)
    assert {p.op for p in loaded.points} == {
        "LayerNorm", "AutodiffVjp(LayerNorm)", "RaggedDot", "RaggedDotVjp(RaggedDot)"}
    # A measured call is predicted from its own point: its measured time comes back.
    row = next(r for r in rows if r["implementation"] == "xla" and r["family"] == "layer_norm"
               and r["direction"] == "vjp" and "ms" in r)
    predicted = prediction.predict(sweep_fit.bound_call(row), loaded)
    assert predicted is not None and predicted.near
    assert 0.3 < predicted.seconds / (row["ms"] * 1e-3) < 3.0


def _calibrated(family, params, efficiencies, dtype="float32"):
    """A calibration holding a point at `params` for each implementation's forward and VJP
    op, at the efficiency `efficiencies` gives it."""
    from benchmarks import sweep_fit
    from tokamax_pass.core import calibration, prediction
    from tokamax_pass.core.roofline import Ceilings

    points = []
    for name, efficiency in efficiencies.items():
        for direction in ("forward", "vjp"):
            ba = sweep_fit.bound_call({"family": family, "params": params,
                                       "implementation": name, "direction": direction})
            work = prediction.call_work(ba)
            points.append(calibration.Point(prediction.op_name(ba.op), dtype, work.flops,
                                            work.bytes, efficiency,
                                            prediction.call_features(ba)))
    return calibration.Calibration("NVIDIA H200", Ceilings(800.0, 400.0, 4.0), tuple(points))


def test_the_rule_s_choice_follows_the_calibration_and_the_kernel_margin(monkeypatch,
                                                                       tmp_path):
    """`sweep_fit.rule_choice` asks the selection rule itself: with the Triton layer norm
    predicted far faster than XLA's it runs Triton, with the two alike XLA (the kernel's
    margin); a VJP op shared by several implementations is named by all of them; cuDNN,
    which this machine cannot lower, and the Mosaic GPU gradient, which reads the
    forward's residuals, are chosen where predicted fastest; the calibration folder the
    process had is back afterwards."""
    from benchmarks import sweep_fit
    from tokamax_pass.core import calibration

    monkeypatch.setenv(calibration.ENV_DIR, "/nonexistent/calibration")
    norm = {"rows": 4096, "width": 1024, "offset": True, "subtract_mean": True,
            "dtype": "float32"}
    for direction in ("forward", "vjp"):
        fast = _calibrated("layer_norm", norm, {"xla": 0.4, "triton": 0.9})
        alike = _calibrated("layer_norm", norm, {"xla": 0.4, "triton": 0.42})
        assert sweep_fit.rule_choice("layer_norm", norm, direction, fast)[0] == "triton"
        assert sweep_fit.rule_choice("layer_norm", norm, direction, alike)[0] == "xla"
    glu = {"rows": 1024, "k": 1024, "n": 1408, "dtype": "float32"}
    # No GLU point: the plain path, whose VJP op the TPU kernel's forward shares.
    assert sweep_fit.rule_choice("gated_linear_unit", glu, "vjp",
                                 _calibrated("layer_norm", norm, {"xla": 0.4})) == (
        "mosaic_tpu", "xla")
    attention = {"batch": 2, "seq": 1024, "heads": 8, "gqa": 1, "head_dim": 64,
                 "causal": True, "dtype": "bfloat16"}
    for best in ("cudnn", "mosaic_gpu"):
        efficiencies = {"xla": 0.1, "triton": 0.3, "cudnn": 0.3, "mosaic_gpu": 0.3, best: 0.6}
        fitted = _calibrated("dot_product_attention", attention, efficiencies, "bfloat16")
        for direction in ("forward", "vjp"):
            assert sweep_fit.rule_choice("dot_product_attention", attention, direction,
                                         fitted) == (best,)
    assert os.environ[calibration.ENV_DIR] == "/nonexistent/calibration"
    with pytest.raises(RuntimeError), sweep_fit._calibration_folder(str(tmp_path), fast):
        raise RuntimeError
    assert os.environ[calibration.ENV_DIR] == "/nonexistent/calibration"
