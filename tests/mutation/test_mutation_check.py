"""The mutation check (`tests/mutation/`): every patch still applies to the code and names
tests that exist, and the runner tells caught, surviving and broken mutations apart.

The check itself (every mutation caught by the real tests) runs after pytest:
`python tests/mutation/run_mutations.py --covering` in `./dev.sh test` (one mutation of
each patched file), every mutation in `./dev.sh test --full`.
"""

from __future__ import annotations

import pathlib
import re
import shutil

import pytest

from mutation import run_mutations
from mutation.mutation_patch import (
    Mutation,
    StaleMutation,
    all_mutations,
    apply,
    check,
    covering,
    load,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTATIONS = all_mutations()


def test_every_patch_file_is_a_mutation():
    assert len(MUTATIONS) == len(list((ROOT / "tests" / "mutation" / "patches").iterdir()))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.patch.stem)
def test_patch_applies_to_the_current_code_and_names_existing_tests(mutation, tmp_path):
    check(mutation, ROOT)  # stale patches fail here, loudly
    for path in mutation.paths:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, tmp_path / path)
    apply(mutation, tmp_path)
    for path in mutation.paths:
        mutated = (tmp_path / path).read_text()
        assert mutated != (ROOT / path).read_text(), path
        if path.endswith(".py"):
            compile(mutated, path, "exec")  # caught by a test, not by a syntax error
    for node in mutation.tests:
        path, _, name = node.partition("::")
        text = (ROOT / path).read_text()
        name = name.partition("[")[0]
        assert not name or re.search(rf"^def {re.escape(name)}\(", text, re.M), node


def _patch(folder: pathlib.Path, header: str, diff: str = "") -> pathlib.Path:
    path = folder / "toy.patch"
    path.write_text(header + "\n" + diff)
    return path


_TOY_DIFF = """--- a/src/toy.py
+++ b/src/toy.py
@@ -1,2 +1,2 @@
 def double(x):
-    return 2 * x
+    return {replacement}
"""


def test_a_stale_patch_is_reported_not_skipped(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "toy.py").write_text("def double(x):\n    return 4 * x\n")
    patch = _patch(tmp_path, "Mutation: toy\nCaught by:\n  tests/test_toy.py\n",
                   _TOY_DIFF.format(replacement="3 * x"))
    with pytest.raises(StaleMutation, match="does not apply"):
        check(load(patch), tmp_path)


@pytest.mark.parametrize("header, message", [
    ("Caught by:\n  tests/test_toy.py\n", "first line must be 'Mutation:"),
    ("Mutation: toy\n  tests/test_toy.py\n", "second line must be 'Caught by:'"),
    ("Mutation: toy\nCaught by:\n", "at least one test"),
])
def test_a_patch_without_its_header_is_rejected(tmp_path, header, message):
    patch = _patch(tmp_path, header, _TOY_DIFF.format(replacement="3 * x"))
    with pytest.raises(ValueError, match=message):
        load(patch)


def test_a_patch_without_a_diff_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no unified diff"):
        load(_patch(tmp_path, "Mutation: toy\nCaught by:\n  tests/test_toy.py\n"))


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
    ("3 * x", ("tests/test_toy.py",), "caught"),
    ("3 * x", ("tests/test_toy.py::test_positive",), "survived"),
    ("3 * x", ("tests/test_toy.py::test_missing",), "error"),
    ("2 * x  # same", ("tests/test_toy.py",), "survived"),
])
def test_runner_verdicts(tmp_path, replacement, tests, status):
    repository = tmp_path / "repository"
    repository.mkdir()
    _toy_repository(repository)
    caught_by = "".join(f"  {t}\n" for t in tests)
    patch = _patch(tmp_path, f"Mutation: toy\nCaught by:\n{caught_by}",
                   _TOY_DIFF.format(replacement=replacement))
    outcome = run_mutations.run_one(load(patch), repository, timeout=120)
    assert outcome.status == status, outcome.detail
    assert (repository / "src" / "toy.py").read_text().endswith("return 2 * x\n")  # untouched


def test_runner_reports_a_stale_patch(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    _toy_repository(repository)
    (repository / "src" / "toy.py").write_text("def double(x):\n    return x + x\n")
    patch = _patch(tmp_path, "Mutation: toy\nCaught by:\n  tests/test_toy.py\n",
                   _TOY_DIFF.format(replacement="3 * x"))
    assert run_mutations.run_one(load(patch), repository, timeout=120).status == "stale"


def test_mutation_names_its_patch_in_errors():
    with pytest.raises(ValueError, match="toy.patch"):
        Mutation("toy", pathlib.Path("toy.patch"), ())


def test_the_covering_subset_patches_every_file_some_mutation_patches():
    everything = all_mutations()
    kept = covering(everything)
    assert {p for m in kept for p in m.paths} == {p for m in everything for p in m.paths}
    assert len(kept) < len(everything)
    # Each kept mutation patches a file no mutation kept before it does.
    for i, mutation in enumerate(kept):
        assert not {p for m in kept[:i] for p in m.paths}.issuperset(mutation.paths)
