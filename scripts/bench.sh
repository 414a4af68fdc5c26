#!/usr/bin/env bash
# Set up the core venv (first time only) and run every benchmark; arguments go to
# `python -m bench` (--quick, --engines, --only NAME ...).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$here/scripts/setup.sh" core)
cd "$here"
exec "$venv/bin/python" -m bench "$@"
