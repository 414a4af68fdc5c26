#!/usr/bin/env bash
# Post-install step for the SGLang venv; scripts/setup.sh runs it with VENV=<venv path>.
#
# sglang 0.5.23 pulls the CUDA build of sgl_kernel (dist "sglang-kernel"), which cannot be
# imported without libcuda.so.1. On CPU-only machines SGLang runs with
# SGLANG_USE_CPU_ENGINE=1 and the test-only stand-in integration/cpu_shims/sgl_kernel first
# on PYTHONPATH (integration/sglang_server.py sets both). Nothing is removed from the venv;
# this only checks, once at build time, that the server's modules import with the shim, so
# a broken venv fails here instead of at the first server start.
set -euo pipefail
: "${VENV:?VENV must point at the venv}"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd /tmp
PYTHONPATH="$repo/integration/cpu_shims" SGLANG_USE_CPU_ENGINE=1 \
  "$VENV/bin/python" -W ignore -c '
import sgl_kernel
assert getattr(sgl_kernel, "IS_TENSORHUB_CPU_SHIM", False), sgl_kernel.__file__
import sglang, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.model_executor.model_runner, sglang.srt.plugins.hook_registry
print("sglang.post.sh: sglang", sglang.__version__, "imports with the CPU sgl_kernel shim")
'
