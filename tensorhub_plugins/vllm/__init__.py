"""vLLM plugin for TensorHub.

Two entry points under one name, `tensorhub` (so `VLLM_PLUGINS=tensorhub` enables both):
- `vllm.general_plugins` → `plugin.register`: registers the `tensorhub` weight-transfer
  backend (`engine.TensorHubEngine`, which lives in each worker process);
- `vllm.endpoint_plugins` → `plugin.TensorHubEndpoints`: the front end in the API server —
  `/tensorhub/status`, `/tensorhub/update`, follow mode and elastic start-up.
"""
