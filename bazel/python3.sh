#!/bin/bash
# The workspace's .venv interpreter (made by ./dev.sh), found through the runfiles link.
here="$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"
python="${here}/../.venv/bin/python3"
if [ ! -x "$python" ]; then
  echo "tokamax_pass: no .venv/bin/python3 in the workspace; run ./dev.sh test (it makes .venv with the pinned packages and runs bazel test)" >&2
  exit 1
fi
exec "$python" "$@"
