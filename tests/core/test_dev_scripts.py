"""`dev.sh`'s helpers: the Debian packages Bazel needs, and Bazel's interpreter shim."""

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
