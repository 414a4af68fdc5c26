"""vLLM's CPU build packs an MoE layer's experts only at the first load; the vLLM plugin
makes each reload pack them again (`keep_cpu_experts_packed`), once per layer however many
engines are set up on the model. Stand-ins for vLLM's layer and kernel: the hook is keyed
on the kernel's class name and the methods it calls."""

from __future__ import annotations

import torch

from tensorhub_plugins.vllm.experts import keep_cpu_experts_packed


class CPUUnquantizedExperts:
    def __init__(self) -> None:
        self.packed = 0

    def process_weights_after_loading(self, layer) -> None:
        self.packed += 1


class Method:
    def __init__(self) -> None:
        self.moe_kernel = type("Kernel", (), {})()
        self.moe_kernel.fused_experts = CPUUnquantizedExperts()
        self.processed = 0

    def process_weights_after_loading(self, layer) -> None:
        self.processed += 1


def moe_model() -> tuple[torch.nn.Module, Method]:
    model, layer = torch.nn.Module(), torch.nn.Module()
    layer.quant_method = Method()
    model.add_module("experts", layer)
    return model, layer.quant_method


def test_each_reload_packs_the_experts_once_however_often_the_plugin_hooks_them():
    model, method = moe_model()
    assert keep_cpu_experts_packed(model) == 1
    assert keep_cpu_experts_packed(model) == 0  # (a second engine on the same model)
    method.process_weights_after_loading(None)
    assert (method.processed, method.moe_kernel.fused_experts.packed) == (1, 1)


def test_a_layer_of_another_kernel_is_left_alone():
    model, method = moe_model()
    method.moe_kernel.fused_experts = object()
    assert keep_cpu_experts_packed(model) == 0
