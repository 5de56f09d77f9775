#!/usr/bin/env bash
# Sets up everything on a fresh machine, then runs one job:
#   ./dev.sh demo    the seed example end to end, with a table of op calls
#   ./dev.sh test    ruff and mypy, the CPU test suite, the mutation check (one breakage of
#                    each patched file), then `bazel test //...`
#   ./dev.sh test --full   the same with every CPU test: also those marked slow, among them
#                    the cases of exhaustive grids beyond their covering subset, and every
#                    breakage of the mutation check
# Both create (or reuse) .venv with Python 3.12 and the pinned dependencies.
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 pyenv which python3.12 >/dev/null 2>&1; then
    PYENV_VERSION=3.12.1 pyenv which python3.12
  elif command -v python3.12 >/dev/null 2>&1; then
    command -v python3.12
  else
    echo "dev.sh: Python 3.12 is needed (jax 0.11.2 does not support older Pythons)" >&2
    exit 1
  fi
}

setup_venv() {
  if [ ! -x .venv/bin/python ]; then
    "$(find_python)" -m venv .venv
  fi
  local stamp=.venv/.tokamax_pass_installed
  local want
  want=$(cat pyproject.toml requirements-pinned.txt | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-pinned.txt -e ".[test,bench]"
    echo "$want" > "$stamp"
  fi
}

setup_bazel() {
  local missing
  missing=$(bazel/missing_debian_packages.sh | tr '\n' ' ')
  if [ -n "$missing" ]; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "dev.sh: installing the Debian packages bazel test needs: $missing" >&2
    $sudo apt-get update -qq
    # shellcheck disable=SC2086  # one word per package
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
  fi
}

case "${1:-}" in
  demo)
    setup_venv
    shift
    exec .venv/bin/tokamax-pass demo "$@"
    ;;
  test)
    # `-m 'not gpu'` replaces pyproject's `-m 'not gpu and not slow'`.
    selection=()
    [ "${2:-}" = "--full" ] && selection=(-m "not gpu")
    setup_venv
    # The CPU tests compile thousands of small programs and run them once: LLVM's
    # expensive optimizations cost more than they save there.
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    # One XLA compilation cache for the run: tests build the same programs in both pytest
    # workers and again in the mutation check (a mutation changes the programs it breaks,
    # and with them their cache keys).
    JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
    trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
    export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
    # The checks of .pre-commit-config.yaml, run as the same commands: CI calls the tools
    # directly rather than through pre-commit, which sets up (and, for hooks from other
    # repositories, fetches) environments that an offline CI machine cannot.
    .venv/bin/python -m ruff check .
    # mypy (src/ and kernels/, as [tool.mypy] in pyproject.toml says) runs on one core
    # beside the test suite, whose two workers leave a core idle while they import and
    # whenever one waits on the other at the end.
    .venv/bin/python -m mypy > "$JAX_COMPILATION_CACHE_DIR/mypy.log" 2>&1 &
    typecheck=$!
    # A background job still running at exit (pytest failed) is stopped; `|| true`: the
    # trap runs under `set -e`, where a `kill` of an ended job would fail the run.
    background=$typecheck
    trap 'kill $background 2>/dev/null || true; rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
    # worksteal: a worker that runs out of tests takes some of the other's, rather than
    # idling while the other ends a queue of long cases.
    .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=20 "${selection[@]}" tests
    wait "$typecheck" || { cat "$JAX_COMPILATION_CACHE_DIR/mypy.log"; exit 1; }
    background=""  # reaped: its process ID may be another process's now
    cat "$JAX_COMPILATION_CACHE_DIR/mypy.log"
    # Deliberate breakages (tests/mutation/patches/), each of which a test must catch: in
    # CI a covering subset, one breakage of each patched file; with --full, all of them.
    mutations=(--covering)
    [ "${2:-}" = "--full" ] && mutations=()
    .venv/bin/python tests/mutation/run_mutations.py --jobs 2 "${mutations[@]}"
    # bf16 here; the test suite runs the smoke in float16 and float32 (test_models.py;
    # test_plan_audit.py's under `pytest -m slow`). It runs beside bazel, which mostly
    # waits on one core.
    .venv/bin/python -m benchmarks.models --smoke --dtypes bfloat16 &
    smoke=$!
    background=$smoke
    .venv/bin/python -m benchmarks.report --check
    setup_bazel
    bazel test --config=ci //...
    bazel shutdown
    wait "$smoke"
    background=""
    ;;
  *)
    echo "usage: ./dev.sh demo | ./dev.sh test [--full]" >&2
    exit 2
    ;;
esac
