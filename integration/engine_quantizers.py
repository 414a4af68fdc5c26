"""The engines' own fp8 quantizers, run in each engine's venv on weights from a file: the
side of `test_quant_references.py` that imports engine code. Kept free of pytest and of
TensorHub (the engine venvs import it as a script).

Run: `python engine_quantizers.py vllm|sglang IN.safetensors OUT.safetensors [DEVICE]`
(DEVICE: `cpu` by default, `cuda` for the engines' CUDA kernels). For each weight `w` in
IN, OUT holds `w.<recipe>.weight` and `w.<recipe>.scale` from the engine's
function; a recipe whose function cannot run here is listed with the error it raised in
OUT's metadata (key `unavailable.<recipe>`), so that the test can say why it skipped.
"""

from __future__ import annotations

import sys


def vllm_recipes() -> dict:
    """vLLM 0.32: the calls its online linear methods make in `process_weights_after_loading`
    (`online/fp8.py`), at TP=1 (no amax reduction)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.online.fp8 import (
        _fp8_channel_scale,
        _fp8_quant_per_channel,
        _fp8_scale,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    def per_channel(w):  # Fp8PtpcOnlineLinearMethod
        scale = _fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
        return _fp8_quant_per_channel(w, scale), scale

    def per_tensor(w):  # Fp8PerTensorOnlineLinearMethod
        scale = _fp8_scale(weight_amax(w).reshape(1))
        q, _ = ops.scaled_fp8_quant(w, scale=scale)
        return q, scale

    def block(w):  # Fp8PerBlockOnlineLinearMethod
        return per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)

    return {"per_channel": per_channel, "per_tensor": per_tensor, "block": block}


def sglang_recipes() -> dict:
    """SGLang 0.5.23: `input_to_float8` (per tensor) and `quant_weight_ue8m0` (block,
    UE8M0 scales), from `fp8_utils.py`."""
    from sglang.srt.layers.quantization.fp8_utils import input_to_float8, quant_weight_ue8m0

    def per_tensor(w):
        return input_to_float8(w)

    def block_ue8m0(w):
        return quant_weight_ue8m0(w, weight_block_size=[128, 128])

    return {"per_tensor": per_tensor, "block_ue8m0": block_ue8m0}


def main(engine: str, src: str, dst: str, device: str = "cpu") -> None:
    from safetensors.torch import load_file, save_file

    recipes = {"vllm": vllm_recipes, "sglang": sglang_recipes}[engine]()
    out, unavailable = {}, {}
    for name, w in load_file(src).items():
        for recipe, quantize in recipes.items():
            if recipe in unavailable:
                continue
            try:
                q, scale = quantize(w.to(device))
            except Exception as exc:  # an engine function with no CPU implementation
                unavailable[recipe] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            out[f"{name}.{recipe}.weight"] = q.contiguous().cpu()
            out[f"{name}.{recipe}.scale"] = scale.float().contiguous().cpu()
    save_file(out, dst, metadata={f"unavailable.{r}": e for r, e in unavailable.items()})


if __name__ == "__main__":
    main(*sys.argv[1:5])
