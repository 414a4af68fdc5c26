"""What vLLM's front end asks of its workers' `TensorHubEngine`s, as typed commands.

vLLM carries them as the `init_info` of `init_weight_transfer_engine` (a dict, the one
channel from the API server to every worker besides the update itself); the engine
validates it into one of these (`parse`), so a malformed or unknown command is refused
before any worker acts on it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Version = Annotated[int, Field(ge=1)]


class Command(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def info(self) -> dict[str, Any]:
        """The `init_info` that carries it."""
        return self.model_dump()


class Init(Command):
    """Create the worker's checkpoint copy (its holder) and, with `follow`, its follow loop."""

    op: Literal["init"] = "init"
    coordinator: str
    model: str = "policy"
    name: str = "vllm"
    transport: str | None = None
    follow: bool = True
    pull_timeout: float = Field(default=120.0, gt=0)


class Prefetch(Command):
    """Pull `version` (None: the latest) in the background."""

    op: Literal["prefetch"] = "prefetch"
    version: Version | None = None


class Release(Command):
    """Let `version` go on a rank that holds it unapplied: another rank holds a newer one, so
    the engine will never apply it."""

    op: Literal["release"] = "release"
    version: Version


class Check(Command):
    """Raise if the copy holds `version` and the model cannot load it (asked before
    generation is paused for it)."""

    op: Literal["check"] = "check"
    version: Version


AnyCommand = Annotated[Init | Prefetch | Release | Check, Field(discriminator="op")]
_COMMANDS: TypeAdapter[AnyCommand] = TypeAdapter(AnyCommand)


def parse(info: dict[str, Any]) -> Init | Prefetch | Release | Check:
    """The command an `init_info` carries (raises `ValueError`, as vLLM expects, if none)."""
    return _COMMANDS.validate_python(info)
