"""`benchmarks/probes/quantized_ragged_dot.py` runs on CPU (`--smoke`) and writes what the
lead reads on the H200: every candidate checked and timed, and a summary per workload."""

from __future__ import annotations

import json

import pytest

from benchmarks.probes import quantized_ragged_dot as probe


@pytest.mark.slow  # a probe; the quantized ops have their own tests
def test_smoke_run_writes_checked_timings_and_summaries(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert probe.main(["--smoke", "--iterations", "1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "quantized_ragged_dot.jsonl").open()]
    timed = [r for r in rows if "ms" in r and "summary" not in r]
    assert {(r["workload"], r["implementation"], r["kind"]) for r in timed} == {
        (w.name, impl, kind) for w in probe.SMOKE_WORKLOADS
        for impl, kind in (("triton", "quantized"), ("xla", "quantized"), ("triton", "bf16"),
                           ("xla", "bf16"))}
    assert all(r["within_upstream_tolerance"] and r["rel_err"] < 1e-2 for r in timed)
    summaries = [r for r in rows if "summary" in r]
    assert {(r["summary"], r["implementation"]) for r in summaries if r["mode"] == "forward"} == {
        (w.name, impl) for w in probe.SMOKE_WORKLOADS for impl in ("triton", "xla")}
    for r in summaries:
        assert r["speedup"] == r["bf16_ms"] / r["ms"] and r["bf16_baseline"] == "triton"
        assert r["meets_goal"] == (r["speedup"] >= probe.GOAL_SPEEDUP)
