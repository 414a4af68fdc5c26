"""The fp8 quantizers on a CUDA device: TensorHub's references (`tensorhub.quant`) make the
same bytes on CUDA as on CPU, and the engines' own CUDA quantizers make the references'
bytes (vLLM's per-tensor kernel `static_scaled_fp8_quant` has no CPU implementation, so
this is its only check). The engine side runs in a python with a CUDA build of the engine,
named by TENSORHUB_GPU_VLLM_PYTHON / TENSORHUB_GPU_SGLANG_PYTHON (the engine venvs of
scripts/setup.sh are CPU builds). Where no CUDA device exists every test skips and says
so; `bash scripts/gpu-check.sh` runs them."""

from __future__ import annotations

import os
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from tensorhub.quant import (
    sglang_block_ue8m0,
    sglang_per_tensor,
    vllm_block,
    vllm_per_channel,
    vllm_per_tensor,
)
from tensorhub.quant.fp8 import FP8_MAX, block_cast
from tensorhub_testing.fp8_weights import bf16_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the fp8 CUDA checks did not run")
ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"vllm": {"per_channel": vllm_per_channel, "per_tensor": vllm_per_tensor,
                    "block": vllm_block},
           "sglang": {"per_tensor": sglang_per_tensor, "block_ue8m0": sglang_block_ue8m0}}


def differing_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


@pytest.mark.parametrize(("engine", "recipe"),
                         [(e, r) for e, recipes in RECIPES.items() for r in recipes])
def test_a_reference_makes_the_same_bytes_on_cuda_as_on_cpu(engine, recipe):
    """Except where the engine's own recipe does not: vLLM's block scale is `amax / 448.0`,
    which PyTorch computes on CUDA as `amax * (1 / 448)` with the reciprocal rounded to
    float32 (a division by a scalar), on CPU as a true division. Half the blocks' scales of a
    1024 x 1024 weight then differ in their last bit, and about 0.1 % of the values by one
    fp8 step; the bytes are the device's, as the engine's are."""
    quantize = RECIPES[engine][recipe]
    on_cpu = quantize
    if (engine, recipe) == ("vllm", "block"):
        reciprocal = float(torch.tensor(1.0) / torch.tensor(FP8_MAX))  # exact in float32
        on_cpu = partial(block_cast, scale_of=lambda amax: amax * reciprocal)
    for name, w in bf16_weights().items():
        cpu, cuda = on_cpu(w), quantize(w.cuda())
        assert differing_bytes(cpu.weight, cuda.weight.cpu()) == 0, f"{name}: values"
        assert differing_bytes(cpu.scale, cuda.scale.cpu()) == 0, f"{name}: scales"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_engines_cuda_quantizers_make_the_references_bytes(engine, tmp_path):
    from safetensors.torch import load_file, save_file

    python = os.environ.get(f"TENSORHUB_GPU_{engine.upper()}_PYTHON")
    if not python:
        pytest.skip(f"TENSORHUB_GPU_{engine.upper()}_PYTHON unset: no CUDA build of {engine} "
                    f"to run its quantizers")
    weights = bf16_weights()
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(weights, str(src))
    done = subprocess.run([python, str(ROOT / "integration" / "engine_quantizers.py"), engine,
                           str(src), str(dst), "cuda"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = load_file(str(dst))
    for recipe, quantize in RECIPES[engine].items():
        for name, w in weights.items():
            assert f"{name}.{recipe}.weight" in out, f"{engine} {recipe} did not run on CUDA"
            ref = quantize(w.cuda())  # on the engine's device: the bytes are the device's
            got_w, got_s = out[f"{name}.{recipe}.weight"], out[f"{name}.{recipe}.scale"]
            assert differing_bytes(ref.weight.cpu(), got_w) == 0, \
                f"{engine} {recipe} {name}: values"
            assert differing_bytes(ref.scale.cpu().float().reshape(got_s.shape), got_s) == 0, \
                f"{engine} {recipe} {name}: scales"
