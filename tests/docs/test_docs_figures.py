"""Every measured-looking number on README.md and docs/ comes from a marker that
`python -m benchmarks.report --check` recomputes: none is written by hand."""

import shutil

import pytest

from benchmarks import report

FLAGGED = (
    "the step ran 1.24x plain JAX's speed",
    "a ratio of 3x",
    "43% of the ceiling",
    "the loss took 9.5 ms",
    "compiled in 74-85 s",
    "it asked 48 GiB",
    "stays under 256 MiB",
    "copies at 3.4 TB/s",
    "runs at 700 TFLOP/s",
    "| attention | 612 TFLOPS |",
    "2 times faster",
    "tuning took 12 minutes",
    "a 1,024 MB buffer",
)

ALLOWED = (
    "a shape of 16384x2048x5632",
    "jax 0.11.2 and upstream Tokamax 0.0.17",
    "attention b4 s8192 h16 d128 causal",
    "2 x G x M x K x N FLOPs",
    "Triton 64 x 128 tiles",
    "inline code `ratio 1.24x` is code",
    "```python\nprint('1.24x, 43%, 9.5 ms')\n```",
    "<!--fig models_llama models.llama.ours.ms .2f-->49.21<!--/fig--> ms",
    "<!--const benchmarks.generalize:WITHIN .0%-->10%<!--/const--> of the fastest",
    "<!-- report:models -->\n| llama | 50.31 ms (1.022x) |\n<!-- /report:models -->",
    "see [the table](#speedups-of-1-5x) for more",
    "<!-- a comment: 3x -->",
)


@pytest.mark.parametrize("text", FLAGGED)
def test_a_measured_number_in_prose_is_flagged(text):
    assert report.hand_written_figures(text), text


@pytest.mark.parametrize("text", ALLOWED)
def test_shapes_versions_code_and_markers_are_not_figures(text):
    assert report.hand_written_figures(text) == []


def test_a_flagged_number_is_reported_with_its_line():
    page = "# Title\n\nplain text\n\nour kernel ran 1.07x cuDNN's speed\n"
    assert report.hand_written_figures(page) == ["line 5: 1.07x"]


def test_the_pages_hold_no_figure_written_by_hand():
    found = {str(path): report.hand_written_figures(path.read_text())
             for path in report.pages()}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_report_check_fails_on_a_figure_written_by_hand(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(report.README.read_text())
    docs = tmp_path / "docs"
    shutil.copytree(report.DOCS, docs)
    assert report.main(["--check"], readme=readme, docs=docs) == 0
    page = docs / "benchmarks.md"
    page.write_text(page.read_text() + "\nThe llama step ran 1.02x plain JAX.\n")
    capsys.readouterr()
    assert report.main(["--check"], readme=readme, docs=docs) == 1
    assert "benchmarks.md: line" in capsys.readouterr().err


def test_a_constant_marker_follows_the_code(tmp_path, monkeypatch):
    from benchmarks import generalize

    readme = tmp_path / "README.md"
    readme.write_text(report.README.read_text())
    docs = tmp_path / "docs"
    shutil.copytree(report.DOCS, docs)
    monkeypatch.setattr(generalize, "WITHIN", 0.25)
    assert report.main(["--check"], readme=readme, docs=docs) == 1
    assert report.main([], readme=readme, docs=docs) == 0
    assert "WITHIN .0%-->25%<!--/const-->" in (docs / "selection.md").read_text()
