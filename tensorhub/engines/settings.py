"""Settings of an engine plugin, read once from the engine's config and the environment.

vLLM (`--additional-config '{"tensorhub": {...}}'`) and SGLang hand us a dict; environment
variables (`TENSORHUB_COORDINATOR`, `TENSORHUB_MODEL`, ...) fill what it leaves out, so a
launch script can configure every process of an engine at once.
"""

from __future__ import annotations

import socket
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorhub import settings

ENV_PREFIX = "TENSORHUB_"


def _field(setting: settings.Setting, **bounds) -> Field:
    """A field whose default and description are the environment variable's: declared once,
    in `tensorhub.settings`."""
    return Field(default=setting.default, description=setting.why, **bounds)


class EngineSettings(BaseModel):
    """An engine's settings: one field per `TENSORHUB_<FIELD>` variable of the engines."""

    model_config = ConfigDict(extra="forbid")

    coordinator: str = Field(description="coordinator address, e.g. tcp://127.0.0.1:5555")
    model: str = _field(settings.MODEL)
    mode: Literal["follow", "manual"] = _field(settings.MODE)
    pause: Literal["keep", "keep_kv", "wait", "abort"] = _field(settings.PAUSE)
    name: str = _field(settings.NAME)
    transport: Literal["auto", "nixl", "cma", "zmq"] = _field(settings.TRANSPORT)
    join_timeout: float = _field(settings.JOIN_TIMEOUT, gt=0)
    update_timeout: float = _field(settings.UPDATE_TIMEOUT, gt=0)
    swap_timeout: float = _field(settings.SWAP_TIMEOUT, gt=0)
    poll_interval: float = _field(settings.POLL_INTERVAL, gt=0)
    checkpoint_copy: Literal["auto", "always", "never"] = _field(settings.CHECKPOINT_COPY)
    quantized_layout: Literal["auto", "never"] = _field(settings.QUANTIZED_LAYOUT)

    def instance_name(self, engine: str, port: int | None) -> str:
        """A readable, unique name: `vllm-host:port-1a2b` unless one was given."""
        base = self.name or f"{engine}-{socket.gethostname()}:{port or 0}"
        return f"{base}-{uuid.uuid4().hex[:4]}"


def load_settings(config: dict | None) -> EngineSettings | None:
    """Settings from `config` (engine-provided dict) plus TENSORHUB_* variables; None when
    no coordinator is configured at all (the plugin then stays inert)."""
    merged: dict = {}
    for field in EngineSettings.model_fields:
        variable = settings.declared(ENV_PREFIX + field.upper())
        if variable.is_set() and field not in (config or {}):  # the engine's config wins
            merged[field] = variable.get()
    merged.update(config or {})
    if "coordinator" not in merged:
        return None
    try:
        return EngineSettings.model_validate(merged)
    except ValidationError as exc:
        raise ValueError(f"invalid TensorHub settings: {exc}") from None
