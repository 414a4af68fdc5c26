"""Reference fp8 quantizers: the bytes each engine makes of bf16 weights, made without the
engine, so that a quantized layout can be checked (or made once) outside the engine.

Each function copies its engine's formula operation for operation: a reciprocal-multiply
instead of a division, or a Python-float divisor instead of a 0-d tensor one, rounds some
values differently, so "almost the same formula" gives different bytes. Each is pinned
byte for byte to the engine's own function by `integration/test_quant_references.py` where
that function runs on CPU, and by `tests/test_gpu_quant.py` where it needs CUDA.
"""

from tensorhub.quant.fp8 import Fp8Weight
from tensorhub.quant.layouts import (
    quantizable,
    quantize_named,
    quantized_model,
    quantized_specs,
    recipe_of,
    split_quantized,
)
from tensorhub.quant.sglang_fp8 import sglang_block_ue8m0, sglang_per_tensor
from tensorhub.quant.vllm_fp8 import vllm_block, vllm_per_channel, vllm_per_tensor

__all__ = ["Fp8Weight", "quantizable", "quantize_named", "quantized_model", "quantized_specs",
           "recipe_of", "sglang_block_ue8m0", "sglang_per_tensor", "split_quantized",
           "vllm_block", "vllm_per_channel", "vllm_per_tensor"]
