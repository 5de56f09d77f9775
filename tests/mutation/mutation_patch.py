"""Deliberate breakages of the library, one unified diff each under `tests/mutation/patches/`.

A patch file starts with a header that `git apply` skips, then the diff (paths relative to
the repository root, `a/` and `b/` prefixes, as `git diff` writes them):

    Mutation: triton ragged dot ends each group one row late
    Caught by:
      tests/ops/ragged_dot/test_triton_ragged_dot.py::test_variants_match_reference

    --- a/kernels/tokamax_kernels/ragged_dot/pallas_triton.py
    +++ b/kernels/tokamax_kernels/ragged_dot/pallas_triton.py
    @@ ...

One of the tests under `Caught by:` (pytest node ids, relative to the root) must fail on a
copy of the repository with the patch applied. A patch that no longer applies is stale:
`git apply --check` says so, and the check fails rather than skipping it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess

PATCHES = pathlib.Path(__file__).resolve().parent / "patches"
_NAME = "Mutation:"
_TESTS = "Caught by:"


class StaleMutation(ValueError):
    """The patch no longer applies to the code it breaks."""


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A breakage: `name` says what it breaks, `patch` is its file, one of `tests` must fail."""

    name: str
    patch: pathlib.Path
    tests: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.tests:
            raise ValueError(f"{self.patch.name}: '{_TESTS}' must name at least one test")

    @property
    def paths(self) -> tuple[str, ...]:
        """The files the patch changes, relative to the repository root."""
        found = re.findall(r"^\+\+\+ b/(\S+)", self.patch.read_text(), re.M)
        return tuple(dict.fromkeys(found))


def load(patch: pathlib.Path) -> Mutation:
    """The mutation in `patch`; a `ValueError` when its header or its diff is missing."""
    lines = patch.read_text().splitlines()
    if not lines or not lines[0].startswith(_NAME):
        raise ValueError(f"{patch.name}: the first line must be '{_NAME} <what it breaks>'")
    name = lines[0].removeprefix(_NAME).strip()
    if len(lines) < 2 or lines[1].strip() != _TESTS:
        raise ValueError(f"{patch.name}: the second line must be '{_TESTS}'")
    tests = []
    for line in lines[2:]:
        if not line.startswith("  ") or not line.strip():
            break
        tests.append(line.strip())
    mutation = Mutation(name, patch, tuple(tests))
    if not mutation.paths:
        raise ValueError(f"{patch.name}: no unified diff ('+++ b/<path>') after the header")
    return mutation


def all_mutations(folder: pathlib.Path = PATCHES) -> tuple[Mutation, ...]:
    """Every mutation under `folder`, in file name order."""
    return tuple(load(p) for p in sorted(folder.glob("*.patch")))


def covering(mutations: tuple[Mutation, ...] | list[Mutation]) -> list[Mutation]:
    """A subset in which every file some mutation patches is patched by one: in order,
    each mutation that patches a file none kept before it does. CI runs it (every patched
    module keeps a breakage that its tests must catch); `./dev.sh test --full` runs all."""
    kept, covered = [], set[str]()
    for mutation in mutations:
        if not covered.issuperset(mutation.paths):
            kept.append(mutation)
            covered.update(mutation.paths)
    return kept


def _git_apply(mutation: Mutation, tree: pathlib.Path, *flags: str) -> None:
    done = subprocess.run(["git", "apply", *flags, str(mutation.patch.resolve())], cwd=tree,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise StaleMutation(
            f"{mutation.patch.name} does not apply to {tree}; regenerate it with "
            f"`git diff` against the current code:\n{done.stderr.strip()}")


def check(mutation: Mutation, tree: pathlib.Path) -> None:
    """Raises `StaleMutation` unless the patch applies cleanly to `tree` (left unchanged)."""
    _git_apply(mutation, tree, "--check")


def apply(mutation: Mutation, tree: pathlib.Path) -> None:
    """Applies the patch to the files under `tree`; `StaleMutation` when it does not apply."""
    _git_apply(mutation, tree)
