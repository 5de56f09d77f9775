"""The mutation check (`tests/mutation/`): its list still applies to the code, names tests
that exist, and its runner tells caught, surviving and broken mutations apart.

The check itself (every mutation caught by the real tests) runs in `./dev.sh test`
after pytest: `python tests/mutation/run_mutations.py`.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from mutation import run_mutations
from mutation.mutations import MUTATIONS, Mutation

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_to_the_current_code_and_names_existing_tests(mutation, tmp_path):
    (tmp_path / mutation.path).parent.mkdir(parents=True)
    original = (ROOT / mutation.path).read_text()
    (tmp_path / mutation.path).write_text(original)
    run_mutations.apply(mutation, tmp_path)
    mutated = (tmp_path / mutation.path).read_text()
    assert mutated != original
    compile(mutated, mutation.path, "exec")  # caught by a test, not by a syntax error
    for node in mutation.tests:
        path, _, name = node.partition("::")
        text = (ROOT / path).read_text()
        assert not name or re.search(rf"^def {re.escape(name)}\(", text, re.M), node


def test_a_stale_snippet_is_reported_not_skipped(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n")
    stale = Mutation("gone", "m.py", "y = 1", "y = 2", ("tests/test_m.py",))
    with pytest.raises(run_mutations.StaleMutation, match="occurs 0 times"):
        run_mutations.apply(stale, tmp_path)


def test_mutation_rejects_a_replacement_equal_to_the_original():
    with pytest.raises(ValueError, match="replacement equals original"):
        Mutation("noop", "m.py", "x", "x", ("tests/test_m.py",))


def _toy_repository(root: pathlib.Path) -> None:
    """A repository of one function and its test, in the layout the runner copies."""
    for name in ("src", "kernels", "tests"):
        (root / name).mkdir()
    (root / "src" / "toy.py").write_text("def double(x):\n    return 2 * x\n")
    (root / "tests" / "test_toy.py").write_text(
        "import toy\n\n\ndef test_double():\n    assert toy.double(3) == 6\n\n\n"
        "def test_positive():\n    assert toy.double(3) > 0\n")
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")


@pytest.mark.parametrize("replacement, tests, status", [
    ("return 3 * x", ("tests/test_toy.py",), "caught"),
    ("return 3 * x", ("tests/test_toy.py::test_positive",), "survived"),
    ("return 3 * x", ("tests/test_toy.py::test_missing",), "error"),
    ("return 2 * x  # same", ("tests/test_toy.py",), "survived"),
])
def test_runner_verdicts(tmp_path, replacement, tests, status):
    _toy_repository(tmp_path)
    mutation = Mutation("toy", "src/toy.py", "return 2 * x", replacement, tests)
    outcome = run_mutations.run_one(mutation, tmp_path, timeout=120)
    assert outcome.status == status, outcome.detail
    assert (tmp_path / "src" / "toy.py").read_text().endswith("return 2 * x\n")  # untouched
