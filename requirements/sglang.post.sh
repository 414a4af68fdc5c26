#!/usr/bin/env bash
# Post-install fix-ups for the SGLang venv (run by scripts/setup.sh with VENV=<venv path>).
set -euo pipefail
: "${VENV:?VENV must point at the venv}"
echo "sglang.post.sh: nothing to do yet" >&2
