"""What a scheduler tells the driver: one typed status per TP rank, through the instance's
report channel (`reports`: a private status directory on one node, the engine's store across
nodes).

The loader runs inside SGLang's `/update_weights_from_tensor`, whose answer it cannot
shape, so each scheduler writes what it now serves here (whole or not at all) and the
driver, in the main process, reads it back to confirm a swap. Both sides use this model:
a field is named once, and a file that does not validate reads as "no status yet"."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorhub.engines import LoadOutcome
from tensorhub_plugins.sglang.reports import DirectoryReports, Reports

NO_STATUS = "no status yet"


class Memory(BaseModel):
    """Bytes TensorHub spends beside SGLang's own parameters."""

    model_config = ConfigDict(extra="forbid")
    compact_bytes: int = 0
    checkpoint_copy_bytes: int = 0


class SchedulerStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    applied: int | None = None  # the version the live parameters hold (None: from disk)
    error: str | None = None  # why the last update was refused or failed
    outcome: LoadOutcome | None = None  # what became of it, where the install said (typed)
    torn: bool = False  # the live parameters hold parts of two versions
    at: float = 0.0  # when it was written (time.time())
    name: str = ""  # the checkpoint copy's worker name
    native_name: str | None = None  # the native holder's worker name
    native_layout: str | None = None  # the layout id of the live parameters
    params_moved: bool | None = None  # SGLang replaced a parameter's storage
    memory: Memory = Field(default_factory=Memory)
    path: str | None = None  # how the last version was applied: native or checkpoint
    sources: list[str] = Field(default_factory=list)  # the workers it was read from
    apply_ms: float | None = None
    apply_steps_ms: dict[str, float] = Field(default_factory=dict)  # the last apply's steps
    prepared: int | None = None  # the version its copy holds, checked (and planned) for a swap
    install: str | None = None  # how the last checkpoint-path version was written: whole, sparse
    changed: int | None = None  # elements a sparse install wrote

    def write(self, rank: int, reports: Reports | None = None) -> None:
        """Publish it for the driver (nothing when no server main process reads it)."""
        (reports or DirectoryReports()).write(
            rank, self.model_copy(update={"at": time.time()}).model_dump_json())

    @classmethod
    def read(cls, rank: int, reports: Reports | None = None) -> SchedulerStatus:
        text = (reports or DirectoryReports()).read(rank)
        try:
            if text is None:
                raise ValueError("no report")
            return cls.model_validate_json(text)
        except (ValueError, ValidationError):
            return cls(error=NO_STATUS)
