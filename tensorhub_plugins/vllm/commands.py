"""What vLLM's front end asks of its workers' `TensorHubEngine`s, as typed commands.

vLLM carries them as the `init_info` of `init_weight_transfer_engine` (a dict, the one
channel from the API server to every worker besides the update itself), and a `Check` as
the argument of the engine's answering call (`collective_rpc` on the worker's
`weight_transfer_engine`, which returns every rank's answer); the engine validates it into
one of these (`parse`), so a malformed or unknown command is refused before any worker
acts on it."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from tensorhub.engines import LoadOutcome, worst_outcome

log = logging.getLogger("tensorhub.vllm")

Version = Annotated[int, Field(ge=1)]


class Command(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def info(self) -> dict[str, Any]:
        """The `init_info` that carries it."""
        return self.model_dump()


class Init(Command):
    """Create the worker's checkpoint copy and, with `follow`, its follow loop."""

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
    """How far the check of `version` before its pause is (`engines.BackgroundCheck`):
    the model can load it and the copy's bytes verify. Asked through the engine's answering
    call (`TensorHubEngine.__call__`), again until every rank is done; a new `attempt` (one
    per swap) of the same `asker` (a front end's nonce) checks again."""

    op: Literal["check"] = "check"
    version: Version
    asker: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=0)


class CanInstall(Command):
    """Whether the rank can install versions of the trainer's quantized layout by `recipe`
    (`fp8_install`): asked, through the answering call as a `Check` is, by a front end
    before it picks the model to follow, while the live weights are still the engine's own
    load of its checkpoint (the rank compares them with the reference quantization)."""

    op: Literal["can_install"] = "can_install"
    recipe: str = Field(min_length=1, max_length=64)


class CanInstallAnswer(BaseModel):
    """A rank's answer to `CanInstall`: why it cannot (None: it can)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cannot: str | None = None


class Installed(Command):
    """How the rank installed the version its live weights hold, or what became of the
    update that failed: asked, through the answering call, with the close of the update
    session, so `last_update` says what the ranks did, not what they planned before the
    pause, and a failed install's outcome reaches the front end typed."""

    op: Literal["installed"] = "installed"


class InstalledAnswer(BaseModel):
    """A rank's answer to `Installed`: the version it applied last and how (`sparse`: only
    the words that changed written; `whole`: every weight loaded), and, where its last
    update failed, what became of it (None where it failed in no way the rank could say)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int | None = None
    install: Literal["sparse", "whole"] | None = None
    failed: LoadOutcome | None = None


def _answers(answers: list | BaseException, version: int,
             level: int) -> list[InstalledAnswer] | None:
    """The ranks' answers to `Installed` about `version`, validated; None (logged at
    `level`) where the question failed or an answer is malformed."""
    if isinstance(answers, BaseException):
        log.log(level, "asking the ranks `Installed` about v%d: %r", version, answers)
        return None
    try:
        return [InstalledAnswer.model_validate(a) for a in answers]
    except ValueError as exc:
        log.log(level, "the ranks' answers to `Installed` about v%d: %s", version, exc)
        return None


def installed_as(answers: list | BaseException, version: int) -> str | None:
    """How the ranks installed `version`, from their answers to `Installed`: `sparse` where
    every rank wrote only what changed, `whole` where one loaded every weight; None where
    the question failed or a rank holds another version (never a guess)."""
    said = _answers(answers, version, logging.DEBUG)
    if not said or any(a.version != version for a in said):
        return None
    return "sparse" if all(a.install == "sparse" for a in said) else "whole"


def failed_as(answers: list | BaseException, version: int) -> LoadOutcome | None:
    """What became of a failed install of `version`, from the ranks' answers to
    `Installed`: the worst a rank said (None where none said, or the question failed)."""
    said = _answers(answers, version, logging.WARNING) or []
    return worst_outcome(a.failed for a in said
                         if a.failed is not None and a.failed.version == version)


AnyCommand = Annotated[Init | Prefetch | Release | Check | CanInstall | Installed,
                       Field(discriminator="op")]
_COMMANDS: TypeAdapter[AnyCommand] = TypeAdapter(AnyCommand)


def parse(info: dict[str, Any]) -> Init | Prefetch | Release | Check | CanInstall | Installed:
    """The command an `init_info` carries (raises `ValueError`, as vLLM expects, if none)."""
    return _COMMANDS.validate_python(info)
