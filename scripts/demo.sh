#!/usr/bin/env bash
# Set up (first time only) and run the demo: coordinator + trainer + replicas on this machine.
# Arguments go to `tensorhub demo` (see `--help`).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$here/scripts/setup.sh" core)
cd "$here"
exec "$venv/bin/tensorhub" --log-level WARNING demo "$@"
