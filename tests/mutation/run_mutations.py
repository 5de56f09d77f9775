"""The mutation check: every breakage in `tests/mutation/patches/` must fail a test.

    python tests/mutation/run_mutations.py [--jobs N] [--only TEXT ...] [--covering] [--list]

`--covering` runs a subset in which every patched file is patched once (what CI runs;
`./dev.sh test --full` runs every mutation).

For each mutation (`mutation_patch.py` describes the patch files): copy `src/`, `kernels/`,
`tests/`, `benchmarks/` and `pyproject.toml` to a temporary directory, apply the patch there
with `git apply` (a patch that does not apply is stale and fails the check), and run the
mutation's tests on the copy with pytest. The mutation is caught when one of them fails
(pytest's exit status 1 with a `FAILED` test); passing tests (a surviving mutation),
errors (in collection, set-up or usage), or a timeout fail the check. The repository
itself is never modified. Exits 0 when every mutation is caught, 1 otherwise.

Each mutation's pytest runs in a child forked from this process, which has imported JAX,
Pallas, NumPy, pytest and Hypothesis once (`PRELOADED`: libraries no patch touches) and
none of the repository's own modules, so every child imports those from its copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

_TESTS = str(pathlib.Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:  # run as a script; pytest puts tests/ on the path itself
    sys.path.insert(0, _TESTS)

from mutation.mutation_patch import (  # noqa: E402
    Mutation,
    StaleMutation,
    all_mutations,
    apply,
    covering,
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


# Imported once here and inherited by every child: what the tests import that no mutation
# changes (the repository's own packages are never among them).
PRELOADED = ("jax", "jax.numpy", "jax.experimental.pallas", "jax.experimental.pallas.triton",
             "jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas.tpu", "numpy",
             "pytest", "hypothesis")
_OWN_PACKAGES = ("tokamax_pass", "tokamax_kernels", "benchmarks", "conftest")


@dataclasses.dataclass
class _Running:
    """A mutation whose tests run in the child `pid` on the copy in `folder`."""

    mutation: Mutation
    folder: tempfile.TemporaryDirectory
    pid: int
    started: float

    @property
    def log(self) -> pathlib.Path:
        return pathlib.Path(self.folder.name) / "pytest.log"


def preload() -> None:
    """Imports `PRELOADED` (with JAX on the CPU, as in the children); fails if one of the
    repository's packages is already imported, which a child would then not re-import."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    for name in PRELOADED:
        importlib.import_module(name)
    own = sorted(n for n in sys.modules if n.split(".")[0] in _OWN_PACKAGES)
    if own:
        raise RuntimeError(f"the mutation check imported {own[0]}: every mutated copy must "
                           "import the repository's modules itself")


def _run_tests_in_child(tree: pathlib.Path, tests: tuple[str, ...], log: pathlib.Path,
                        root: pathlib.Path) -> None:
    """In a forked child: pytest on `tests` in `tree`, output to `log`; never returns."""
    code = 3
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # New streams on those descriptors: the inherited ones may be a caller's capture
        # (pytest's, when a test runs the check).
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        os.chdir(tree)
        env = environment_for(tree)
        os.environ.clear()
        os.environ.update(env)
        sys.dont_write_bytecode = True
        # The copy's sources first; the repository's own folders (where this script and
        # its `tests/` import path live) dropped, so nothing resolves to unmutated code.
        own = {root / p for p in ("", "src", "kernels", "tests", "tests/mutation")}
        kept = [p for p in sys.path if p and pathlib.Path(p).resolve() not in own]
        sys.path[:] = [*env["PYTHONPATH"].split(os.pathsep), *kept]
        import pytest

        code = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                                *tests]))
    except BaseException:  # noqa: BLE001 - reported through the exit status and the log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(mutation: Mutation, root: pathlib.Path) -> _Running | Outcome:
    """A fresh copy of `root` with `mutation` applied, its tests started in a child; the
    outcome at once where the patch is stale."""
    started = time.perf_counter()
    folder = tempfile.TemporaryDirectory(prefix="tokamax_mutation_")
    tree = pathlib.Path(folder.name) / "repository"
    tree.mkdir()
    copy_repository(root, tree)
    try:
        apply(mutation, tree)
    except StaleMutation as e:
        folder.cleanup()
        return Outcome(mutation, "stale", time.perf_counter() - started, str(e))
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_tests_in_child(tree, mutation.tests, pathlib.Path(folder.name) / "pytest.log",
                            root.resolve())
    return _Running(mutation, folder, pid, started)


def _finish(running: _Running, wait_status: int) -> Outcome:
    """The outcome of `running`'s child, which ended with `wait_status`."""
    returncode = os.waitstatus_to_exitcode(wait_status)
    seconds = time.perf_counter() - running.started
    lines = running.log.read_text(errors="replace").strip().splitlines()
    running.folder.cleanup()
    tail = "\n".join(lines[-15:])
    failed = [line for line in lines if line.startswith("FAILED ")]
    if returncode == PYTEST_FAILED and failed:
        return Outcome(running.mutation, "caught", seconds, failed[0][:200])
    if returncode == 0:
        return Outcome(running.mutation, "survived", seconds, tail)
    return Outcome(running.mutation, "error", seconds, f"pytest exit status {returncode}:\n{tail}")


def run_all(mutations: list[Mutation], root: pathlib.Path, *, jobs: int, timeout: float,
            report: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Every mutation's outcome, `jobs` at a time; `report` hears each as it comes."""
    waiting = list(mutations)
    running: dict[int, _Running] = {}
    outcomes: list[Outcome] = []

    def done(outcome: Outcome) -> None:
        outcomes.append(outcome)
        report(outcome)

    while waiting or running:
        while waiting and len(running) < jobs:
            started = _start(waiting.pop(0), root)
            if isinstance(started, Outcome):
                done(started)
            else:
                running[started.pid] = started
        if not running:
            continue
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in running:
            done(_finish(running.pop(pid), status))
            continue
        now = time.perf_counter()
        for late in [r for r in running.values() if now - r.started > timeout]:
            os.kill(late.pid, signal.SIGKILL)
            os.waitpid(late.pid, 0)
            del running[late.pid]
            late.folder.cleanup()
            done(Outcome(late.mutation, "timeout", now - late.started,
                         f"no result in {timeout:.0f} s"))
        time.sleep(0.02)
    return outcomes


def run_one(mutation: Mutation, root: pathlib.Path, timeout: float) -> Outcome:
    """Applies `mutation` to a fresh copy of `root` and runs its tests there."""
    (outcome,) = run_all([mutation], root, jobs=1, timeout=timeout)
    return outcome


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
    parser.add_argument("--covering", action="store_true",
                        help="only a subset in which every patched file is patched once "
                        "(what CI runs)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    mutations = [m for m in all_mutations()
                 if not args.only or any(t in m.name or t in m.patch.stem for t in args.only)]
    if args.covering:
        mutations = covering(mutations)
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
    preload()
    start = time.perf_counter()

    def report(outcome: Outcome) -> None:
        print(f"{outcome.status:>8}  {outcome.seconds:5.1f} s  {outcome.mutation.name}",
              flush=True)
        if outcome.detail:  # the failed test that caught it, or what went wrong
            print("          " + outcome.detail.replace("\n", "\n          "), flush=True)

    outcomes = run_all(mutations, ROOT, jobs=args.jobs, timeout=args.timeout, report=report)
    missed = [o for o in outcomes if not o.caught]
    print(f"\nmutation check: {len(outcomes) - len(missed)} of {len(outcomes)} mutations caught "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
