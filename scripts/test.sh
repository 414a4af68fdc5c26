#!/usr/bin/env bash
# Set up (first time only) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$here/scripts/setup.sh" core)
cd "$here"
exec "$venv/bin/python" -m pytest tests integration -q -p no:cacheprovider "$@"
