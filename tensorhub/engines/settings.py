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


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    coordinator: str = Field(description="coordinator address, e.g. tcp://127.0.0.1:5555")
    model: str = Field(default="policy", description="model name the trainer publishes")
    mode: Literal["follow", "manual"] = Field(
        default="follow",
        description="follow: pull and apply every announced version; manual: only on "
                    "POST /tensorhub/update (or the trainer driving the engine's endpoints)")
    pause: Literal["keep", "wait", "abort"] = Field(
        default="keep",
        description="what a swap does to requests in flight: keep (they freeze for the "
                    "install and go on with the new weights), wait (they finish on the old "
                    "version first), abort")
    name: str = Field(default="", description="worker name in `tensorhub status`")
    transport: Literal["auto", "nixl", "cma", "zmq"] | None = None
    join_timeout: float = Field(default=300.0, gt=0,
                                description="start-up: longest wait for the newest version")
    update_timeout: float = Field(default=120.0, gt=0, description="longest pull")
    swap_timeout: float = Field(
        default=300.0, gt=0,
        description="longest wait for each step of a swap (pause, load, resume); past it "
                    "the swap fails with the step named and the ranks' votes name a rank "
                    "that hangs")
    poll_interval: float = Field(default=0.2, gt=0,
                                 description="how often the front end checks for versions (and at "
                                             "once when one is announced)")
    checkpoint_copy: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="SGLang: keep a checkpoint-layout copy (a full model of memory) beside "
                    "the live parameters? auto: only while the engine takes the checkpoint "
                    "path (it bridges other engine kinds and layouts); always; never "
                    "(a transient copy per checkpoint-path update)")

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
