#!/bin/bash
# The workspace's .venv interpreter (made by ./dev.sh), found through the runfiles link.
here="$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"
exec "${here}/../.venv/bin/python3" "$@"
