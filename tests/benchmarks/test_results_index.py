"""The results folder is data: one current file per benchmark, each listed in the index
with what it measures and the command that remakes it, each JSON file with its provenance."""

import json
import pathlib
import re

import pytest

from benchmarks import report

RESULTS = pathlib.Path(report.__file__).parent / "results"
FOLDERS = sorted(path for path in RESULTS.iterdir() if path.is_dir())


def _index(folder: pathlib.Path) -> dict:
    return json.loads((folder / "index.json").read_text())["benchmarks"]


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_every_results_file_is_indexed_and_every_indexed_file_exists(folder):
    index = _index(folder)
    listed = {entry["file"] for entry in index.values()}
    listed |= {entry["chart"] for entry in index.values() if "chart" in entry}
    present = {path.name for path in folder.iterdir()} - {"index.json", "README.md"}
    assert present == listed
    for name, entry in index.items():
        assert entry["file"].rsplit(".", 1)[0] == name, "a file is named after its benchmark"
        assert entry["measures"].strip() and entry["command"].strip(), name


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_no_results_file_is_named_after_a_run(folder):
    run_named = [path.name for path in folder.iterdir()
                 if re.search(r"_(s|session|run)\d+\b|_v\d+\b", path.stem)]
    assert run_named == []


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_every_json_results_file_carries_its_provenance(folder):
    for name, entry in _index(folder).items():
        if entry["file"].endswith(".json"):
            data = json.loads((folder / entry["file"]).read_text())
            assert re.fullmatch(r"[0-9a-f]{40}", data["provenance"]["commit"]), name


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_the_results_readme_lists_every_benchmark(folder):
    readme = (folder / "README.md").read_text()
    missing = [entry["file"] for entry in _index(folder).values()
               if f"`{entry['file']}`" not in readme]
    assert missing == []


def test_the_report_reads_files_through_the_index(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "index.json").write_text(json.dumps({"benchmarks": {
        "ops_norms": {"file": "ops_norms.json", "measures": "m", "command": "c"}}}))
    monkeypatch.setattr(report, "RESULTS", folder)
    assert report.results_file("ops_norms") == folder / "ops_norms.json"
    with pytest.raises(SystemExit, match="'models_llama' is not a benchmark"):
        report.results_file("models_llama")


def test_the_benchmark_scripts_name_their_results_after_the_benchmark():
    from benchmarks import run
    from benchmarks.models import run as models_run

    assert run.benchmark_name([]) == "ops"
    assert run.benchmark_name(["rms norm", "lce"]) == "ops_rms_norm_lce"
    assert models_run.benchmark_name(["llama"], []) == "models_llama"
    assert (models_run.benchmark_name(["llama"], ["width=4096", "mlp=14336"])
            == "models_llama_width4096_mlp14336")
