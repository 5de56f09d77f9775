"""The benchmark suite's machinery on tiny CPU workloads."""

import json
import re
import shutil

import pytest

import tokamax_pass as tokamax
from benchmarks import optimize_overhead, run


@pytest.mark.slow
def test_smoke_suite_writes_results(tmp_path):
    out = tmp_path / "bench.json"
    assert run.main(["--smoke", "--iterations", "2", "--modes", "fwd", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    ours = [r for r in data["rows"] if r["kind"] == "ours" and "ms" in r]
    assert {r["workload"] for r in ours} == {"smoke attention", "smoke self-attention",
                                             "smoke layer norm", "smoke rms norm + residual",
                                             "smoke ragged dot", "smoke glu", "smoke moe glu",
                                             "smoke gqa soft cap window attention",
                                             "smoke lce"}
    assert all(r["relative_error"] < 2e-2 and r["ms"] > 0 for r in ours)
    assert all("vs_best_peer" in r for r in ours)


def test_library_cache_tuning_writes_files_the_cache_reads(tmp_path):
    from benchmarks import tune_library_cache
    from tokamax_pass.autotuning import cache

    assert tune_library_cache.main(["--smoke", "--only", "layer norm", "--output",
                                    str(tmp_path)]) == 0
    files = list(tmp_path.glob("*/*.json"))
    assert files
    folder = files[0].parent
    result = None
    for f in files:
        loaded = tokamax.AutotuningResult.load(f)
        result = loaded if result is None else result | loaded
    assert {type(entry.bound.op).__name__ for entry in result.entries} >= {"LayerNorm"}
    assert cache.device_kind_key(result.device_kind) == folder.name


def test_library_cache_tuning_skips_answered_calls_unless_forced(tmp_path, capsys,
                                                                 monkeypatch):
    """With the shipped cache answering a workload's calls, a rerun tunes none of them
    and says how to; `--force` retunes them."""
    from benchmarks import tune_library_cache
    from tokamax_pass.autotuning import cache

    args = ["--smoke", "--only", "layer norm", "--output", str(tmp_path)]
    assert tune_library_cache.main(args) == 0
    folder = next(tmp_path.glob("*/*.json")).parent
    monkeypatch.setattr(cache, "library_cache_dir", lambda device_kind: folder)
    cache.library_result.cache_clear()
    try:
        capsys.readouterr()
        assert tune_library_cache.main(args) == 0
        rerun = capsys.readouterr().out
        assert "0 op calls tuned" in rerun and "--force retunes them" in rerun
        assert tune_library_cache.main([*args, "--force"]) == 0
        forced = capsys.readouterr().out
        assert "0 op calls" not in forced and "op calls tuned" in forced
    finally:
        cache.library_result.cache_clear()


def test_library_cache_tuning_of_a_two_output_workload(tmp_path):
    """The norm with a residual returns `(y, s)`: its gradient program sums both, and the
    forward and VJP calls are tuned with the residual in their arguments."""
    from benchmarks import tune_library_cache
    from tokamax_pass.autotuning import cache

    assert tune_library_cache.main(["--smoke", "--only", "residual", "--output",
                                    str(tmp_path)]) == 0
    files = sorted(tmp_path.glob("*/*.json"))
    assert {f.name for f in files} == {"layer_norm.json", "autodiff_vjp.json"}
    for f in files:
        result = tokamax.AutotuningResult.load(f)
        (entry,) = result.entries
        assert entry.bound.arguments["residual"].shape == (64, 128)
        assert cache.device_kind_key(result.device_kind) == f.parent.name


def test_stale_retuning_retunes_exactly_the_stale_entries(tmp_path, capsys):
    from benchmarks import tune_library_cache

    assert tune_library_cache.main(["--smoke", "--only", "layer norm", "--output",
                                    str(tmp_path)]) == 0
    assert tune_library_cache.main(["--stale", "--output", str(tmp_path)]) == 0
    assert "every entry is fresh" in capsys.readouterr().out
    path = next(tmp_path.glob("*/layer_norm.json"))
    data = json.loads(path.read_text())
    data["entries"][0]["provenance"]["source_hash"] = "0" * 16  # as if its kernel changed
    path.write_text(json.dumps(data))
    folder = path.parent
    assert len(tune_library_cache.stale_calls(folder)) == 1
    assert tune_library_cache.main(["--stale", "--output", str(tmp_path)]) == 0
    assert "1 of 1 stale op calls retuned" in capsys.readouterr().out
    assert tune_library_cache.stale_calls(folder) == []


def test_restamp_marks_stale_entries_current_and_keeps_their_measurements(tmp_path, capsys):
    from benchmarks import tune_library_cache

    assert tune_library_cache.main(["--smoke", "--only", "layer norm", "--output",
                                    str(tmp_path)]) == 0
    path = next(tmp_path.glob("*/layer_norm.json"))
    data = json.loads(path.read_text())
    data["entries"][0]["provenance"]["source_hash"] = "0" * 16
    path.write_text(json.dumps(data))
    kind = tokamax.AutotuningResult.load(path).device_kind
    assert tune_library_cache.main(["--restamp", "--output", str(tmp_path),
                                    "--device-kind", kind]) == 0
    assert "restamped" in capsys.readouterr().out
    assert tune_library_cache.stale_calls(path.parent) == []
    after = json.loads(path.read_text())
    assert after["entries"][0]["configs"] == data["entries"][0]["configs"]


def test_source_hash_ignores_docstrings_and_comments_but_not_statements():
    from tokamax_pass.autotuning import keys

    base = keys.code_text('def f(x):\n    """Doc."""\n    return x + 1\n')
    assert keys.code_text('def f(x):\n    # why\n    return x + 1  # note\n') == base
    assert keys.code_text('def f(x):\n    """Other doc."""\n\n    return x + 1\n') == base
    assert keys.code_text('def f(x):\n    return x + 2\n') != base


def test_a_stale_entry_no_config_could_be_timed_for_is_kept_and_reported(tmp_path, capsys,
                                                                         monkeypatch):
    """Every config failing on the device (say out of memory) must not ship an empty
    entry as fresh: the stale one stays, the call is named, and the run fails."""
    from benchmarks import tune_library_cache
    from tokamax_pass.autotuning import keys
    from tokamax_pass.autotuning.autotuner import Autotuner
    from tokamax_pass.autotuning.entry import Entry, Measurement

    assert tune_library_cache.main(["--smoke", "--only", "layer norm", "--output",
                                    str(tmp_path)]) == 0
    path = next(tmp_path.glob("*/layer_norm.json"))
    data = json.loads(path.read_text())
    data["entries"][0]["provenance"]["source_hash"] = "0" * 16
    path.write_text(json.dumps(data))
    before = path.read_text()

    def out_of_memory(self, plans):
        return [Entry(ba, {c: Measurement(error="run error: RESOURCE_EXHAUSTED: 32 GiB")
                           for c in configs}, keys.provenance(ba.op))
                for ba, configs in plans]

    monkeypatch.setattr(Autotuner, "tune_many", out_of_memory)
    assert tune_library_cache.main(["--stale", "--output", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "0 of 1 stale op calls retuned" in out
    assert "NOT RETUNED" in out and "RESOURCE_EXHAUSTED" in out
    assert json.loads(path.read_text()) == json.loads(before)
    assert len(tune_library_cache.stale_calls(path.parent)) == 1


def test_optimize_overhead_reports_both_wrappers(capsys):
    assert optimize_overhead.main(["--calls", "20", "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    assert "jax.jit" in text and "tokamax.optimize" in text and "optimize / jit:" in text


def test_ceilings_and_prepared_peers(tmp_path):
    """The norm's copy ceiling runs (interpreted on CPU) and gives our rows their share of
    it; a `Prepared` peer gets its converted inputs."""
    import jax.numpy as jnp

    from benchmarks import workloads as wl

    seen = []
    workload = wl.norm("tiny norm", (64, 128), subtract_mean=True)
    workload.peers["float16 peer"] = wl.Prepared(
        lambda x, s, o: seen.append(x.dtype) or x.astype(jnp.float32),
        lambda x, s, o: (x.astype(jnp.float16), s, o))
    rows = run.measure(workload, ["fwd"], iterations=2)
    ceiling = [r for r in rows if r["kind"] == "ceiling"]
    assert [r["implementation"] for r in ceiling] == ["copy (pallas triton)"]
    assert "ms" in ceiling[0] and "relative_error" not in ceiling[0]
    assert jnp.float16 in seen
    ours = [r for r in rows if r["kind"] == "ours" and "ms" in r]
    assert ours and all(r["of_ceiling"] > 0 for r in ours)


def _copy_pages(tmp_path):
    """A copy of README.md and docs/ under `tmp_path`: (readme, docs)."""
    from benchmarks import report

    readme = tmp_path / "README.md"
    readme.write_text(report.README.read_text())
    shutil.copytree(report.DOCS, tmp_path / "docs")
    return readme, tmp_path / "docs"


def test_report_check_fails_when_the_readme_differs_from_the_results(tmp_path, capsys):
    from benchmarks import report

    readme, docs = _copy_pages(tmp_path)
    assert report.main(["--check"], readme=readme, docs=docs) == 0
    text = readme.read_text()
    table = text[text.index(report.BEGIN):text.index(report.END)]
    plain_ms = table.split("| llama | ")[1].split(" ms")[0]
    readme.write_text(text.replace(f"| llama | {plain_ms} ms", "| llama | 1.00 ms"))
    assert report.main(["--check"], readme=readme, docs=docs) == 1
    assert report.main([], readme=readme, docs=docs) == 0  # rewriting restores the numbers
    assert report.main(["--check"], readme=readme, docs=docs) == 0


def test_report_checks_the_tables_on_the_docs_pages(tmp_path, capsys):
    from benchmarks import report

    readme, docs = _copy_pages(tmp_path)
    page = docs / "benchmarks.md"
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ragged dot m16384"))
    rate = row.split(" | ")[2]
    page.write_text(text.replace(row, row.replace(rate, "1 TFLOP/s", 1)))
    assert report.main(["--check"], readme=readme, docs=docs) == 1
    assert report.main([], readme=readme, docs=docs) == 0
    assert page.read_text() == text


def test_report_wants_each_table_on_exactly_one_page(tmp_path):
    from benchmarks import report

    readme, docs = _copy_pages(tmp_path)
    (docs / "copy.md").write_text("<!-- report:seed -->\n<!-- /report:seed -->\n")
    with pytest.raises(SystemExit, match="report:seed"):
        report.main(["--check"], readme=readme, docs=docs)
    (docs / "copy.md").unlink()
    page = docs / "benchmarks.md"
    page.write_text(page.read_text().replace("<!-- report:tpu -->", ""))
    with pytest.raises(SystemExit, match="report:tpu"):
        report.main(["--check"], readme=readme, docs=docs)


def test_report_rewrites_and_checks_the_figures_quoted_in_prose(tmp_path):
    from benchmarks import report

    readme, docs = _copy_pages(tmp_path)
    page = docs / "ops" / "linear_softmax_cross_entropy_loss.md"
    text = page.read_text()
    found = re.search(r"<!--fig (\S+) (\S+impl=mosaic\]\.grad_temp_mib) (\S+?)-->", text)
    assert found, "the LM-head loss page quotes the Mosaic kernel's memory as a figure"
    marker = found.group(0)
    value = report.figure(*found.groups())
    page.write_text(text.replace(f"{marker}{value}<!--/fig-->", f"{marker}1.234<!--/fig-->"))
    assert report.main(["--check"], readme=readme, docs=docs) == 1
    assert report.main([], readme=readme, docs=docs) == 0
    assert f"{marker}{value}<!--/fig-->" in page.read_text()
    ablation = report.figure("ablation_llama", "[variant=ours;model=llama].vs_plain", ".3f")
    assert float(ablation) > 0


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _fail_first_timed_glu_call(path):
    """The sweep's first timed `gated_linear_unit` forward call turned into a failed one."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    row = next(r for r in rows if r["family"] == "gated_linear_unit" and "ms" in r
               and r["direction"] == "forward")
    del row["ms"]
    row["error"] = "RuntimeError: failed"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# (table, page, file edited in the copy, the edit, text the rewritten table holds)
RESULT_EDITS = (
    ("generalization", "selection.md", "generalization.json",
     lambda p: _edit_json(p, lambda d: d["summary"]["layer_norm fwd+bwd"].update(
         worst_ratio=2.5, worst_fastest="xla")),
     "| 0 (0%) | 2.500x | xla |"),
    ("generalization", "selection.md", "generalization.json",
     lambda p: _edit_json(p, lambda d: d["provenance"].update(seed=[12345, 678])),
     "seeds 12345, 678"),
    ("calibration", "selection.md", "nvidia_h200.json",
     lambda p: _edit_json(p, lambda d: d["ceilings"].update(bf16_tflops=123.4)),
     "bf16 123 TFLOP/s"),
    ("calibration", "selection.md", "sweep.jsonl", _fail_first_timed_glu_call,
     "| `gated_linear_unit` | 31 ("),
    ("models", "README.md", "models_moe.json",
     lambda p: _edit_json(p, lambda d: d["models"]["deepseek_moe"]["ours"].update(ms=100.0)),
     "| deepseek_moe | 502.61 ms (59.59 GB) | 100.00 ms (5.026x; 1.72 GB) |"),
)


@pytest.mark.parametrize("table,page,file,edit,expected", RESULT_EDITS,
                         ids=[f"{t}-{f}" for t, _, f, _, _ in RESULT_EDITS])
def test_report_check_fails_when_a_results_file_changes(tmp_path, monkeypatch, capsys, table,
                                                        page, file, edit, expected):
    """A number changed in a copy of a results file (or of the calibration) makes `--check`
    fail, and rewriting puts the new number in that table and changes no other page."""
    from benchmarks import report

    readme, docs = _copy_pages(tmp_path)
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    calibration = tmp_path / report.CALIBRATION.name
    shutil.copy(report.CALIBRATION, calibration)
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "CALIBRATION", calibration)
    assert report.main(["--check"], readme=readme, docs=docs) == 0
    before = {path: path.read_text() for path in report.pages(readme, docs)}
    edit(calibration if file == calibration.name else results / file)
    assert report.main(["--check"], readme=readme, docs=docs) == 1
    assert report.main([], readme=readme, docs=docs) == 0
    changed = [path.name for path, text in before.items() if path.read_text() != text]
    assert changed == [page]
    text = (readme if page == "README.md" else docs / page).read_text()
    block = text.split(f"<!-- report:{table} -->")[1].split(f"<!-- /report:{table} -->")[0]
    assert expected in block and expected not in before[readme if page == "README.md"
                                                          else docs / page]


def test_report_model_table_marks_failed_variants_forward_only_models_and_memory(
        tmp_path, monkeypatch):
    from benchmarks import report

    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    monkeypatch.setattr(report, "RESULTS", results)

    def edit(data: dict) -> None:
        row = data["models"]["deepseek_moe"]
        row["upstream"] = {"error": "TypeError: the peer failed"}
        row["plain"].update(ms=30.0, temp_memory_mb=12600.0)
        row["ours"].update(ms=24.0, temp_memory_mb=420.0)

    def forget_memory(data: dict) -> None:
        for variant in data["models"]["llama"].values():
            if isinstance(variant, dict):
                variant.pop("temp_memory_mb", None)

    _edit_json(results / "models_moe.json", edit)
    _edit_json(results / "models_llama.json", forget_memory)
    rows = {line.split(" | ")[0]: line for line in report.model_table().splitlines()
            if line.startswith("| ")}
    header = rows["| model"].split(" | ")
    upstream = next(i for i, name in enumerate(header) if name.startswith("upstream"))
    cells = rows["| deepseek_moe"].split(" | ")
    assert cells[upstream] == "failed (error in the results file)"
    assert cells[1] == "30.00 ms (12.60 GB)"
    assert cells[header.index("ours `None`")] == "24.00 ms (1.250x; 0.42 GB)"
    # A run that recorded no memory shows none.
    assert rows["| llama"].split(" | ")[1].endswith(" ms")
    assert "| moe_decode (forward only)" in rows
    assert "| llama" in rows and "forward only" not in rows["| llama"]


def test_the_default_search_holds_a_near_best_config_for_every_shipped_entry(capsys):
    """`autotune`'s default `max_configs` keeps, for every H200 library entry that was
    searched wider, a config within 2% of the best one measured."""
    from benchmarks import search_reach
    from tokamax_pass.autotuning import api

    rows = search_reach.reaches("NVIDIA H200", api.DEFAULT_MAX_CONFIGS)
    assert len(rows) >= 40
    assert min(r.reach for r in rows) >= 0.98, sorted(rows, key=lambda r: r.reach)[:3]
    assert search_reach.main([]) == 0
    assert "below 0.97" in capsys.readouterr().out

