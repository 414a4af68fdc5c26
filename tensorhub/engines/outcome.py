"""What became of a version an engine was asked to install, typed across processes.

An engine's workers run in other processes than its front end, so the `LoadOutcome` model
is a field of each plugin's typed channel from its workers: SGLang's scheduler status,
vLLM's answer to the `Installed` question its front end asks every rank after a failed
update (vLLM re-raises a worker's exception only as text, which is never read back). Where
ranks say different things, the front end acts on the worst (`worst_outcome`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tensorhub.core.errors import TensorHubError

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


class InstallFailed(TensorHubError):
    """An install that did not happen, or did not finish: its `outcome` says what the
    weights hold now. Its message is the reason."""

    def __init__(self, outcome: LoadOutcome):
        super().__init__(outcome.reason or outcome.kind, code=outcome.kind)
        self.outcome = outcome

    @classmethod
    def of(cls, kind: Kind, version: int, reason: str) -> InstallFailed:
        return cls(LoadOutcome(kind=kind, version=version, reason=reason[:4000]))


# From the worst, for the weights, to the mildest: what a front end acts on.
SEVERITY: tuple[Kind, ...] = ("torn", "restored_checkpoint", "restored", "unloadable", "refused")


def worst_outcome(outcomes: Iterable[LoadOutcome | None]) -> LoadOutcome | None:
    """The most severe of the ranks' outcomes (None: none said one)."""
    said = [o for o in outcomes if o is not None]
    return min(said, key=lambda o: SEVERITY.index(o.kind), default=None)
