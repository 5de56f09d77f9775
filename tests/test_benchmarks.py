"""The benchmark suite's machinery on tiny CPU workloads."""

import json

from benchmarks import run


def test_smoke_suite_writes_results(tmp_path):
    out = tmp_path / "bench.json"
    assert run.main(["--smoke", "--iterations", "2", "--modes", "fwd", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    ours = [r for r in data["rows"] if r["kind"] == "ours" and "ms" in r]
    assert {r["workload"] for r in ours} == {"smoke attention", "smoke layer norm",
                                             "smoke ragged dot"}
    assert all(r["relative_error"] < 2e-2 and r["ms"] > 0 for r in ours)
    assert all("vs_best_peer" in r for r in ours)
