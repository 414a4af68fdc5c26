#!/usr/bin/env bash
# The GPU check in one command: the tests of the CUDA paths (tests/test_gpu.py: VRAM
# buffers, NIXL registration and one-sided reads of VRAM, GPU <-> host pulls, a GPU reader
# serving on) and of the fp8 quantizers (tests/test_gpu_quant.py: the references on CUDA,
# and the engines' CUDA quantizers against them, given TENSORHUB_GPU_VLLM_PYTHON /
# TENSORHUB_GPU_SGLANG_PYTHON, pythons with CUDA builds of the engines). Where no CUDA device is visible it says plainly that nothing ran, and exits 0.
# TENSORHUB_GPU_PYTHON: a python with a CUDA build of torch and the core requirements (a GPU
# image); by default the core venv of scripts/setup.sh. Extra arguments go to pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${TENSORHUB_GPU_PYTHON:-$(bash "$here/scripts/setup.sh" core)/bin/python}
if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device visible to $python (torch $("$python" -c 'import torch; print(torch.__version__)')): the GPU paths were NOT run" >&2
  exit 0
fi
"$python" -c "import torch; print('gpu-check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
cd "$here"
exec "$python" -m pytest tests/test_gpu.py tests/test_gpu_quant.py -v -rs -p no:cacheprovider "$@"
