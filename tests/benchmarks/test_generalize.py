"""The generalization benchmark, tiny on CPU, and its summary."""

import json
import random

import pytest

from benchmarks import generalize, shapes


def test_draws_stay_in_range_and_change_with_the_seed():
    for family in shapes.FAMILIES:
        first = [shapes.draw(family, random.Random(1)) for _ in range(3)]
        assert all(shapes.call_bytes(family, p) <= shapes.MAX_CALL_BYTES for p in first)
        assert first == [shapes.draw(family, random.Random(1)) for _ in range(3)]
    draws = {json.dumps(shapes.draw("ragged_dot", random.Random(seed))) for seed in range(8)}
    assert len(draws) > 4
    p = shapes.draw("ragged_dot", random.Random(3))
    assert 8 <= p["groups"] <= 256 and 8 <= p["rows_per_group"] <= 8192
    assert (p["k"], p["n"]) in shapes.MOE_K_N


def test_summary_counts_shapes_within_ten_percent_and_the_worst_ratio():
    def rows(params, none_ms, others):
        return [{"family": "f", "mode": "fwd", "params": params, "kind": "none",
                 "implementation": "None", "ms": none_ms}] + [
            {"family": "f", "mode": "fwd", "params": params, "kind": "ours",
             "implementation": name, "ms": ms} for name, ms in others.items()]

    summary = generalize.summarize(
        rows({"a": 1}, 1.05, {"xla": 1.05, "triton": 1.0})
        + rows({"a": 2}, 3.0, {"xla": 3.0, "triton": 1.5})
        + rows({"a": 3}, 1.0, {"xla": 1.0, "triton": 2.0}))
    entry = summary["f fwd"]
    assert entry["shapes"] == 3 and entry["within_fraction"] == pytest.approx(2 / 3)
    assert entry["worst_ratio"] == pytest.approx(2.0)
    assert entry["worst_params"] == {"a": 2} and entry["worst_fastest"] == "triton"


def test_none_and_the_fastest_are_timed_again_in_turns_and_judged_on_those_times(
        monkeypatch):
    """After every candidate's first timing, `None` and the fastest other are timed again
    in the order A B B A, and the summary reads the ratio from those re-timings."""
    from benchmarks import sweep

    first = {"None": 1.2, "xla": 1.0, "triton": 1.5}
    again = {"None": [1.01, 1.0], "xla": [1.0, 1.0]}
    calls = []

    def fake_time_call(fn, *args, **kwargs):
        name = fn()
        calls.append(name)
        seen = calls.count(name)
        return {"ms": first[name] if seen == 1 else again[name][seen - 2]}

    monkeypatch.setattr(sweep, "time_call", fake_time_call)
    monkeypatch.setattr(generalize, "MODES", {"fwd": "forward"})
    monkeypatch.setattr(generalize, "_chosen", lambda *a: "XlaThing")
    monkeypatch.setattr(generalize, "_none", lambda family: lambda: "None")
    monkeypatch.setattr(sweep, "ours", lambda family: {"xla": lambda: "xla",
                                                        "triton": lambda: "triton"})
    monkeypatch.setattr(sweep, "peers", lambda family: {})
    monkeypatch.setattr(shapes, "build", lambda *a: ((), {}))
    rows = generalize.measure_shape("f", {"a": 1}, seed=0, iterations=3, call_seconds=1.0,
                                    method=None)
    assert calls == ["None", "xla", "triton", "None", "xla", "xla", "None"]
    by_name = {r["implementation"]: r for r in rows}
    assert by_name["None"]["confirmed_ms"] == again["None"]
    assert "confirmed_ms" not in by_name["triton"]
    entry = generalize.summarize(rows)["f fwd"]
    assert entry["within_fraction"] == 1.0 and entry["worst_ratio"] == pytest.approx(1.005)
    # Without full re-timings (one failed) the first timings decide.
    by_name["xla"]["confirmed_ms"][1] = None
    assert generalize.summarize(rows)["f fwd"]["worst_ratio"] == pytest.approx(1.2)


def test_a_tiny_run_writes_one_file_with_provenance(tmp_path):
    out = tmp_path / "generalization.json"
    args = ["--tiny", "--families", "layer_norm,ragged_dot", "--shapes", "1",
            "--iterations", "3", "--method", "wallclock", "--out", str(out)]
    assert generalize.main([*args, "--seed", "5"]) == 0
    data = json.loads(out.read_text())
    assert set(data["provenance"]) == {"commit", "jax", "device_kind", "date", "seed"}
    assert data["provenance"]["seed"] == 5
    assert set(data["summary"]) == {"layer_norm fwd", "layer_norm fwd+bwd", "ragged_dot fwd",
                                    "ragged_dot fwd+bwd"}
    none_rows = [r for r in data["rows"] if r["kind"] == "none"]
    assert all(r["ms"] > 0 and r["chosen"] in ("LayerNorm", "RaggedDot") for r in none_rows)
    assert {r["implementation"] for r in data["rows"] if "ms" in r} >= {
        "None", "xla", "jax.lax.ragged_dot"}
    assert generalize.main(args) == 0  # a fresh draw replaces the file
    assert len(json.loads(out.read_text())["rows"]) == len(data["rows"])


@pytest.mark.slow  # the one-worker run below covers the measuring path
def test_workers_split_the_shapes_and_append_keeps_earlier_runs(tmp_path):
    out = tmp_path / "generalization.json"
    args = ["--tiny", "--families", "layer_norm", "--shapes", "2", "--iterations", "3",
            "--method", "wallclock", "--out", str(out)]
    assert generalize.main([*args, "--seed", "5", "--workers", "2"]) == 0
    first = json.loads(out.read_text())
    single = tmp_path / "single.json"
    assert generalize.main([*args[:-1], str(single), "--seed", "5"]) == 0
    assert _shapes(first) == _shapes(json.loads(single.read_text()))
    other = ["--tiny", "--families", "ragged_dot", "--shapes", "1", "--iterations", "3",
             "--method", "wallclock", "--out", str(out)]
    assert generalize.main([*other, "--seed", "6", "--append"]) == 0
    both = json.loads(out.read_text())
    assert both["provenance"]["seed"] == [5, 6] and len(both["provenance"]["runs"]) == 2
    assert len(both["provenance"]["commits"]) == 2
    assert both["summary"]["layer_norm fwd"]["shapes"] == 2
    assert both["summary"]["ragged_dot fwd"]["shapes"] == 1
    # Measuring a family again replaces its rows.
    assert generalize.main([*args, "--seed", "7", "--append"]) == 0
    again = json.loads(out.read_text())
    assert again["summary"]["layer_norm fwd"]["shapes"] == 2
    assert _shapes(again) != _shapes(both) and again["provenance"]["seed"] == [5, 6, 7]


def _shapes(data):
    return sorted(json.dumps(r["params"]) for r in data["rows"])
