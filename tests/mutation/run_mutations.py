"""The mutation check: every breakage in `tests/mutation/patches/` must fail a test.

    python tests/mutation/run_mutations.py [--jobs N] [--only TEXT ...] [--list]

For each mutation (`mutation_patch.py` describes the patch files): copy `src/`, `kernels/`,
`tests/`, `benchmarks/` and `pyproject.toml` to a temporary directory, apply the patch there
with `git apply` (a patch that does not apply is stale and fails the check), and run the
mutation's tests on the copy with pytest. The mutation is caught when one of them fails
(pytest's exit status 1 with a `FAILED` test); passing tests (a surviving mutation),
errors (in collection, set-up or usage), or a timeout fail the check. The repository
itself is never modified. Exits 0 when every mutation is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

_TESTS = str(pathlib.Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:  # run as a script; pytest puts tests/ on the path itself
    sys.path.insert(0, _TESTS)

from mutation.mutation_patch import (  # noqa: E402
    Mutation,
    StaleMutation,
    all_mutations,
    apply,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
COPIED = ("src", "kernels", "tests", "benchmarks", "pyproject.toml")
# Compiled modules come along (`copy2` keeps each source's time stamp, so Python reuses the
# bytecode of every file the patch leaves alone and recompiles the ones it changes).
_IGNORED = shutil.ignore_patterns(".pytest_cache")
PYTEST_FAILED = 1  # pytest's exit status when tests ran and some failed


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What running one mutation's tests on a mutated copy gave."""

    mutation: Mutation
    status: str  # "caught", "survived", "stale", "error" or "timeout"
    seconds: float
    detail: str = ""

    @property
    def caught(self) -> bool:
        return self.status == "caught"


def copy_repository(root: pathlib.Path, dest: pathlib.Path) -> None:
    """The parts of the repository the CPU tests need, copied under `dest`."""
    for name in COPIED:
        source = root / name
        if not source.exists():
            continue
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=_IGNORED)
        else:
            shutil.copy2(source, dest / name)


def environment_for(tree: pathlib.Path) -> dict[str, str]:
    """The environment of a test run on `tree`: its own sources first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("src", "kernels", "."))
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_one(mutation: Mutation, root: pathlib.Path, timeout: float) -> Outcome:
    """Applies `mutation` to a fresh copy of `root` and runs its tests there."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tokamax_mutation_") as tmp:
        tree = pathlib.Path(tmp)
        copy_repository(root, tree)
        try:
            apply(mutation, tree)
        except StaleMutation as e:
            return Outcome(mutation, "stale", time.perf_counter() - start, str(e))
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   "-p", "no:xdist", *mutation.tests]
        try:
            done = subprocess.run(command, cwd=tree, env=environment_for(tree),
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return Outcome(mutation, "timeout", time.perf_counter() - start,
                           f"no result in {timeout:.0f} s")
    seconds = time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines()
    tail = "\n".join(lines[-15:])
    failed = [line for line in lines if line.startswith("FAILED ")]
    if done.returncode == PYTEST_FAILED and failed:
        return Outcome(mutation, "caught", seconds, failed[0][:200])
    if done.returncode == 0:
        return Outcome(mutation, "survived", seconds, tail)
    return Outcome(mutation, "error", seconds, f"pytest exit status {done.returncode}:\n{tail}")


def check_sources_come_from(tree: pathlib.Path) -> None:
    """Fails loudly when the copy's packages would not be the ones imported (an installed
    copy shadowing them would make every mutation survive)."""
    probe = ("import tokamax_pass, tokamax_kernels; "
             "print(tokamax_pass.__file__); print(tokamax_kernels.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=environment_for(tree),
                          capture_output=True, text=True, check=True)
    for line in done.stdout.split():
        if not pathlib.Path(line).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the tests would import {line}, not the mutated copy in {tree}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once")
    parser.add_argument("--only", nargs="+", default=(), metavar="TEXT",
                        help="run the mutations whose name or patch file name contains one "
                        "of these")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed for one mutation's tests")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    mutations = [m for m in all_mutations()
                 if not args.only or any(t in m.name or t in m.patch.stem for t in args.only)]
    if not mutations:
        parser.error(f"--only {' '.join(args.only)} matches no mutation (see --list)")
    if args.list:
        for m in mutations:
            print(f"{m.name}\n    {m.patch.name}: {' '.join(m.paths)}\n"
                  f"    tests: {' '.join(m.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="tokamax_mutation_probe_") as tmp:
        copy_repository(ROOT, pathlib.Path(tmp))
        check_sources_come_from(pathlib.Path(tmp))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, m, ROOT, args.timeout) for m in mutations]
        outcomes = []
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            outcomes.append(outcome)
            print(f"{outcome.status:>8}  {outcome.seconds:5.1f} s  {outcome.mutation.name}",
                  flush=True)
            if outcome.detail:  # the failed test that caught it, or what went wrong
                print("          " + outcome.detail.replace("\n", "\n          "), flush=True)
    missed = [o for o in outcomes if not o.caught]
    print(f"\nmutation check: {len(outcomes) - len(missed)} of {len(outcomes)} mutations caught "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
