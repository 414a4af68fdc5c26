"""vLLM plugin for TensorHub (issue 3): a `tensorhub` weight-transfer backend, control routes and elastic start-up."""
