"""What became of a version an engine was asked to install, typed across processes.

An engine's workers run in other processes than its front end. Where a plugin has a
typed channel of its own, the `LoadOutcome` model is a field of it (SGLang's scheduler
status). vLLM carries a worker's exception back only as text (`collective_rpc` re-raises
it in its own words), so there the outcome travels as a tag inside that text: the model
as JSON in base64url (which survives `repr`, quoting and line breaks), read back and
validated by `LoadOutcome.found_in`.
"""

from __future__ import annotations

import base64
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorhub.core.errors import TensorHubError

_TAG = "tensorhub-outcome:"
_FOUND = re.compile(re.escape(_TAG) + r"([A-Za-z0-9_-]+={0,2})")

Kind = Literal["refused", "unloadable", "restored", "restored_checkpoint", "torn"]


class LoadOutcome(BaseModel):
    """`kind`: refused (nothing was touched: a rank could not apply it now),
    unloadable (the model cannot load it: never tried again), restored (a load that failed
    half-way was undone by loading the version served before), restored_checkpoint
    (... by loading the checkpoint the engine started from), torn (not undone: generation
    stays paused until a whole version is loaded)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    version: int = Field(ge=0)
    reason: str = Field(default="", max_length=4000)

    def tag(self) -> str:
        data = base64.urlsafe_b64encode(self.model_dump_json().encode()).decode()
        return f"[{_TAG}{data}]"

    @classmethod
    def found_in(cls, message: str) -> LoadOutcome | None:
        """The last outcome tagged in `message` (an engine's words around a worker's
        error), or None."""
        found = _FOUND.findall(message)
        if not found:
            return None
        try:
            return cls.model_validate_json(base64.urlsafe_b64decode(found[-1]))
        except (ValueError, ValidationError):
            return None


class InstallFailed(TensorHubError):
    """An install that did not happen, or did not finish: its `outcome` says what the
    weights hold now. Its message is the reason, then the outcome's tag."""

    def __init__(self, outcome: LoadOutcome):
        super().__init__(f"{outcome.reason} {outcome.tag()}", code=outcome.kind)
        self.outcome = outcome

    @classmethod
    def of(cls, kind: Kind, version: int, reason: str) -> InstallFailed:
        return cls(LoadOutcome(kind=kind, version=version, reason=reason[:4000]))


def outcome_in(message: str) -> Literal["restored", "restored_checkpoint", "torn"] | None:
    """Whether an error's words say a failed load was undone (by the version served
    before, or by the checkpoint the engine started from) or left the weights torn."""
    outcome = LoadOutcome.found_in(message)
    if outcome is None or outcome.kind in ("refused", "unloadable"):
        return None
    return outcome.kind  # type: ignore[return-value]
