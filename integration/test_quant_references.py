"""TensorHub's reference fp8 quantizers (`tensorhub.quant`) against the engines' own
functions, byte for byte, on CPU: the engine functions run in their venvs
(`engine_quantizers.py`) on the same bf16 weights. A recipe whose engine function has no
CPU implementation skips, naming the error, and is checked by `tests/test_gpu_quant.py`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from integration.sglang_server import CPU_SHIM_DIR
from tensorhub.quant import (
    sglang_block_ue8m0,
    sglang_per_tensor,
    vllm_block,
    vllm_per_channel,
    vllm_per_tensor,
)
from tensorhub_testing.fp8_weights import bf16_weights

SCRIPT = Path(__file__).resolve().parent / "engine_quantizers.py"
REFERENCES = {
    "vllm": {"per_channel": vllm_per_channel, "per_tensor": vllm_per_tensor,
             "block": vllm_block},
    "sglang": {"per_tensor": sglang_per_tensor, "block_ue8m0": sglang_block_ue8m0},
}


def run_engine(python: str, engine: str, weights: dict, tmp_path: Path) -> tuple[dict, dict]:
    src, dst = tmp_path / f"{engine}-in.safetensors", tmp_path / f"{engine}-out.safetensors"
    save_file(weights, str(src))
    env = None
    if engine == "sglang":  # SGLang imports sgl_kernel, which the CPU shim stands in for
        import os
        env = {**os.environ, "PYTHONPATH": str(CPU_SHIM_DIR)}
    done = subprocess.run([python, str(SCRIPT), engine, str(src), str(dst)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(str(dst), "pt") as f:
        meta = f.metadata() or {}
    return load_file(str(dst)), {k.split(".", 1)[1]: v for k, v in meta.items()
                                 if k.startswith("unavailable.")}


@pytest.fixture(scope="module")
def vllm_results(vllm_python, tmp_path_factory):
    return run_engine(vllm_python, "vllm", bf16_weights(), tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def sglang_results(sglang_python, tmp_path_factory):
    return run_engine(sglang_python, "sglang", bf16_weights(),
                      tmp_path_factory.mktemp("quant"))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many bytes differ (the shapes and dtypes must be equal)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return int((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def check(results: tuple[dict, dict], engine: str, recipe: str) -> None:
    out, unavailable = results
    if recipe in unavailable:
        pytest.skip(f"{engine}'s own {recipe} quantizer does not run on this CPU "
                    f"({unavailable[recipe]}); tests/test_gpu_quant.py checks it on CUDA")
    for name, w in bf16_weights().items():
        ref = REFERENCES[engine][recipe](w)
        q, scale = out[f"{name}.{recipe}.weight"], out[f"{name}.{recipe}.scale"]
        assert same_bytes(ref.weight, q) == 0, f"{name}: fp8 values differ"
        assert same_bytes(ref.scale.float().reshape(scale.shape), scale) == 0, \
            f"{name}: scales differ"


@pytest.mark.parametrize("recipe", ["per_channel", "per_tensor", "block"])
def test_vllms_quantizers_equal_the_references_byte_for_byte(vllm_results, recipe):
    check(vllm_results, "vllm", recipe)


@pytest.mark.parametrize("recipe", ["per_tensor", "block_ue8m0"])
def test_sglangs_quantizers_equal_the_references_byte_for_byte(sglang_results, recipe):
    check(sglang_results, "sglang", recipe)


def test_a_reciprocal_instead_of_a_division_is_caught():
    """The comparison can fail: vLLM's per-channel values divided by the scale, against the
    same values multiplied by the scale's reciprocal."""
    w = bf16_weights()["square"]
    ref = vllm_per_channel(w)
    bent = (w * (1.0 / ref.scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert same_bytes(ref.weight, bent) > 0
