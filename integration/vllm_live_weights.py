"""A vLLM worker extension for tests and benchmarks: what the engine's model holds now, read
inside each worker (`--worker-extension-cls integration.vllm_live_weights.LiveWeights`,
called through vLLM's dev-mode `/collective_rpc`; `VLLMServer(live_weights=True)` sets both
up). It lets a test compare the engine's quantized weights and scales byte for byte, and
their addresses across updates. Imports only vLLM's dependencies: it runs in vLLM's venv.
"""

from __future__ import annotations

import torch


class LiveWeights:
    def _named_parameters(self):
        return list(self.model_runner.model.named_parameters())

    def _rank(self) -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def tensorhub_dump_live_weights(self, path_prefix: str) -> dict:
        """Write every parameter of this rank's model, as the model sees it (shape and
        dtype; copied contiguous), to `<path_prefix>.rank<R>.safetensors`; return
        {"rank": R, "path": ..., "addresses": {name: data_ptr}}."""
        from safetensors.torch import save_file

        named = self._named_parameters()
        path = f"{path_prefix}.rank{self._rank()}.safetensors"
        save_file({n: p.detach().clone(memory_format=torch.contiguous_format)
                   for n, p in named}, path)
        return {"rank": self._rank(), "path": path,
                "addresses": {n: p.data_ptr() for n, p in named}}

    def tensorhub_live_bytes(self) -> dict:
        """Bytes of this rank's model parameters, by dtype: what the engine serves from."""
        sizes: dict[str, int] = {}
        for _, p in self._named_parameters():
            key = str(p.dtype).removeprefix("torch.")
            sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        return sizes
