"""`dev.sh`: its `test` job's steps and exit status (with fake tools), the Debian packages
Bazel needs, and Bazel's interpreter shim."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(argv, env=None):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


def _path_with(folder: pathlib.Path | None) -> dict[str, str]:
    """An environment whose PATH holds the system folders (and `folder`)."""
    system = [p for p in ("/usr/bin", "/bin") if not shutil.which("bazel", path=p)]
    return {**os.environ, "PATH": os.pathsep.join(([str(folder)] if folder else []) + system)}


def test_missing_debian_packages_checks_each_package(tmp_path):
    """Each package is checked by what it provides: a `bazel` binary alone is not enough."""
    # bash by its path: the PATH below leaves out every folder that holds a real `bazel`,
    # which on a machine with Debian's bazel-bootstrap includes /usr/bin.
    script = [shutil.which("bash"), ROOT / "bazel" / "missing_debian_packages.sh"]
    rules_java = ["bazel-rules-java"] if not os.path.isdir("/usr/share/bazel/rules/java") else []
    without_bazel = _run(script, env=_path_with(None))
    assert without_bazel.returncode == 0, without_bazel.stderr
    assert without_bazel.stdout.split() == ["bazel-bootstrap", *rules_java]
    fake = tmp_path / "bazel"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    with_bazel = _run(script, env=_path_with(tmp_path))
    assert with_bazel.returncode == 0 and with_bazel.stdout.split() == rules_java


def test_bazel_python_without_venv_says_to_run_dev_sh(tmp_path):
    (tmp_path / "bazel").mkdir()
    shim = tmp_path / "bazel" / "python3.sh"
    shutil.copy2(ROOT / "bazel" / "python3.sh", shim)
    missing = _run(["bash", shim, "-c", "print(1)"])
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "run ./dev.sh test" in missing.stderr
    python = tmp_path / ".venv" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "venv python $*"\n')
    python.chmod(0o755)
    found = _run(["bash", shim, "-c", "print(1)"])
    assert found.returncode == 0 and found.stdout == "venv python -c print(1)\n"


def _fake_checkout(tmp_path: pathlib.Path, failing: str | None) -> pathlib.Path:
    """A copy of `dev.sh` whose venv Python and `bazel` only log their arguments; the
    Python exits 1 when its arguments contain `failing`."""
    checkout = tmp_path / "checkout"
    (checkout / "bazel").mkdir(parents=True)
    for name in ("dev.sh", "pyproject.toml", "requirements-pinned.txt"):
        shutil.copy2(ROOT / name, checkout / name)
    (checkout / "bazel" / "missing_debian_packages.sh").write_text("#!/bin/sh\n")
    (checkout / "bazel" / "missing_debian_packages.sh").chmod(0o755)
    log = checkout / "calls.log"
    python = checkout / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    fail = f'case "$*" in *"{failing}"*) exit 1;; esac\n' if failing else ""
    python.write_text(f'#!/bin/sh\necho "python $*" >> {log}\n{fail}exit 0\n')
    python.chmod(0o755)
    stamp = subprocess.run("cat pyproject.toml requirements-pinned.txt | sha256sum",
                           shell=True, cwd=checkout, capture_output=True, text=True,
                           check=True).stdout.split()[0]
    (checkout / ".venv" / ".tokamax_pass_installed").write_text(stamp + "\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "bazel").write_text(f'#!/bin/sh\necho "bazel $*" >> {log}\n')
    (tools / "bazel").chmod(0o755)
    return checkout


def _dev_sh_test(checkout: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.pathsep.join([str(checkout.parent / "tools"),
                                                  "/usr/bin", "/bin"])}
    return _run([shutil.which("bash"), checkout / "dev.sh", "test"], env=env)


def test_dev_sh_test_passes_when_every_step_passes(tmp_path):
    """Every step runs, and the exit status is 0: its cleanup on exit must not fail
    (under `set -e`, a failing command there turns a green run red)."""
    checkout = _fake_checkout(tmp_path, failing=None)
    result = _dev_sh_test(checkout)
    assert result.returncode == 0, result.stderr
    calls = (checkout / "calls.log").read_text()
    for step in ("-m ruff check", "-m mypy", "-m pytest", "run_mutations.py",
                 "-m benchmarks.models --smoke", "-m benchmarks.report --check",
                 "bazel test", "bazel shutdown"):
        assert step in calls, step


def test_dev_sh_test_fails_when_a_step_fails(tmp_path):
    """A failing step fails the job: at once (pytest, mypy: bazel never runs), or once
    bazel is done (the smoke check, which runs beside it)."""
    for step, bazel_runs in (("-m pytest", False), ("-m mypy", False),
                             ("-m benchmarks.models --smoke", True)):
        checkout = _fake_checkout(tmp_path / step.split()[-1], failing=step)
        result = _dev_sh_test(checkout)
        calls = (checkout / "calls.log").read_text()
        assert result.returncode != 0 and step in calls, step
        assert ("bazel test" in calls) == bazel_runs, step
