#!/usr/bin/env bash
# Downloads the upstream Tokamax wheel and the wheels it and tokamax_pass need beyond the
# device image (jax, jaxlib, triton, flax, absl-py, jaxtyping and tqdm are there; the
# image lacks platformdirs, which tokamax_pass imports) into .whl/ at the
# repository root, for Python 3.12 on x86_64 Linux. The device has no network: copy the
# repository with .whl/ to it and install as benchmarks/peers/README.md says.
#
#   benchmarks/peers/download_upstream_wheels.sh [PYTHON]   (PYTHON: a python with pip)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${1:-python3}"
dest="${root}/.whl"
mkdir -p "${dest}"
# One version of each: an older pin left beside the new one would make pip pick either.
rm -f "${dest}"/*.whl

# Pure-Python wheels (one wheel for every platform).
pure=(
  tokamax==0.0.17
  einshape==1.0
  qwix==0.1.8
  immutabledict==4.3.1
  pydantic==2.14.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  # tokamax 0.0.17 calls `triton_call(out_type=...)`, which 0.4.1 is the release to take;
  # it asks for triton 3.7 (the image has 3.6): install_on_device.sh keeps its NVIDIA
  # backend on.
  jax-triton==0.4.1
  # tokamax_pass's own dependency, at the version requirements-pinned.txt pins.
  "$(grep "^platformdirs==" "${root}/requirements-pinned.txt")"
)
# Wheels with compiled code: the device's interpreter and platform.
binary=(
  pydantic-core==2.50.5
)

common=(download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --dest "${dest}")
"${python}" -m pip "${common[@]}" "${pure[@]}"
"${python}" -m pip "${common[@]}" --platform manylinux_2_17_x86_64 "${binary[@]}"
ls -1 "${dest}"
