#!/usr/bin/env bash
# Set up (first time only) and run the demo: coordinator + trainer + two `vllm serve`
# engines + one SGLang server on this machine. `--sglang 0` / `--vllm 0` skip an engine
# kind; `--engines none` runs replica processes only. `--help` lists the options.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$here/scripts/setup.sh" core)
cd "$here"
exec "$venv/bin/python" -m integration.demo "$@"
