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
    _shorten_worker_spin()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "tensorhub_plugins.vllm.engine", "TensorHubEngine")


def _shorten_worker_spin() -> None:
    """`TENSORHUB_WORKER_SPIN`, where it is set (`spin`)."""
    from tensorhub import settings

    try:
        seconds = settings.WORKER_SPIN.get()
    except settings.SettingError as exc:
        log.error("TensorHub: %s; vLLM's workers spin as vLLM sets", exc)
        return
    if seconds is None:
        return
    from tensorhub_plugins.vllm.spin import shorten_worker_spin

    if not shorten_worker_spin(seconds):
        log.warning("TensorHub: TENSORHUB_WORKER_SPIN is set but this vLLM has no "
                    "ring-buffer spin to shorten; ignored")


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
