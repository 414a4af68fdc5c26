"""Entry points vLLM loads. Kept tiny: the real work lives in `engine` and `frontend`, imported
only when vLLM actually uses them."""

from __future__ import annotations

import logging

log = logging.getLogger("tensorhub.vllm")

BACKEND = "tensorhub"


def register() -> None:
    """`vllm.general_plugins` hook: runs in every vLLM process, possibly more than once."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from tensorhub.engines import show_tensorhub_logs

    show_tensorhub_logs("vllm")
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "tensorhub_plugins.vllm.engine", "TensorHubEngine")


class TensorHubEndpoints:
    """`vllm.endpoint_plugins` object: TensorHub's front end inside vLLM's API server."""

    name = "tensorhub"
    required_tasks = None

    def __init__(self) -> None:
        self.frontend = None

    def attach_router(self, app) -> None:
        from tensorhub_plugins.vllm.frontend import router

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        from tensorhub_plugins.vllm.frontend import start_frontend

        self.frontend = await start_frontend(engine_client, args)
        state.tensorhub = self.frontend
