#!/usr/bin/env bash
# Installs the upstream Tokamax wheels from .whl/ (see download_upstream_wheels.sh) into
# .device/peers on the device, which has no network, checks that jax-triton's NVIDIA
# backend loads, and prints the PYTHONPATH line to use. Fails loudly on any of it:
#
#   line="$(benchmarks/peers/install_on_device.sh)" && eval "$line"
#
# PYTHON (default: python3) names the interpreter.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${root}/.device/peers"
python="${PYTHON:-python3}"
rm -rf "${target}"  # a fresh install: pip --target keeps what an earlier one left
"${python}" -m pip install -q --no-index --no-deps --target "${target}" "${root}"/.whl/*.whl >&2
# `import tokamax` imports xprof's kernel-stats tool, used only by its xprof timers: an
# empty module stands in (the suites time with CUPTI).
mkdir -p "${target}/xprof/cli/tools"
touch "${target}/xprof/__init__.py" "${target}/xprof/cli/__init__.py" \
      "${target}/xprof/cli/tools/__init__.py" "${target}/xprof/cli/tools/get_kernel_stats_tool.py"
# jax-triton 0.4.1 (the release whose `triton_call` takes `out_type=`, as tokamax 0.0.17
# calls it) imports a constant that triton 3.7 added and, when that import fails, turns
# its NVIDIA backend off. Under the image's triton 3.6 the import is replaced by the value
# jax-triton itself uses when the constant is missing (0), and the backend stays on.
lib="${target}/jax_triton/triton_lib.py"
sed -i 's/^\( *\)from triton.backends.nvidia.driver import TMA_TF32 as _TMA_TF32.*$/\1_TMA_TF32 = 0/' "${lib}"
PYTHONPATH="${target}" "${python}" - <<'PY' >&2
import types
import jax_triton.triton_lib as lib
if isinstance(lib.cb, types.SimpleNamespace):
    raise SystemExit("jax-triton's NVIDIA backend did not load: upstream Tokamax cannot run")
PY
printf 'export PYTHONPATH=%q:%q:%q:%q${PYTHONPATH:+:$PYTHONPATH}\n' \
  "${target}" "${root}/src" "${root}/kernels" "${root}"
