"""Every message of the coordinator's protocol and what it describes (a holder's memory,
its endpoint; layouts' manifests are `manifest.py`'s), as pydantic models in one place: the
protocol reads in one sitting, and the coordinator, the workers and the engine plugins
agree on one schema.

The wire carries them as msgpack (`wire.py`); nothing is ever unpickled. What every field is
checked against (the strict base model, the limits, the shared field types) is `schema.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import xxhash
from pydantic import Field, model_validator

from tensorhub.core.manifest import Manifest, TensorSpec  # noqa: F401 - (part of the protocol)
from tensorhub.core.schema import (
    MAX_METADATA,
    MAX_PARTS,
    MAX_TENSORS,
    PROTOCOL,
    Name,
    Strict,
    Version,
)


# --------------------------------------------------------------------------- a holder's memory
class MemoryDesc(Strict):
    """Where a holder keeps one item: registered memory a peer may read."""

    addr: Annotated[int, Field(ge=0, lt=2**64)]
    nbytes: Annotated[int, Field(ge=0, lt=2**44)]
    device: Annotated[int, Field(ge=0, lt=1024)] = 0
    mem: Literal["DRAM", "VRAM"] = "DRAM"


class SharedRegion(Strict):
    """A holder's buffer that lives in shared memory (a sealed memfd), so a reader on the
    same host maps it and copies with memcpy (`auto`): the holder's virtual addresses
    [addr, addr + nbytes) are bytes [0, nbytes) of the file open as `fd` in the holder's
    process, whose inode is `inode` (a reused fd number is never mistaken for it)."""

    fd: int = Field(ge=0, lt=2**31)
    inode: int = Field(ge=0)
    addr: int = Field(ge=0, lt=2**64)
    nbytes: int = Field(ge=1, lt=2**48)


class Endpoint(Strict):
    """How peers reach a worker's memory: a NIXL agent, the zmq fallback server, or (on the
    same host) its process, read with cross-memory attach (`cma`; `auto` adds pid and host
    to a NIXL endpoint so same-host peers take that path, and lists the holder's buffers in
    shared memory, which same-host peers map and copy directly)."""

    transport: Literal["nixl", "zmq", "cma"]
    agent_name: Name | None = None
    agent_metadata: bytes | None = Field(default=None, max_length=MAX_METADATA)
    address: str | None = Field(default=None, max_length=256)  # zmq fallback: tcp://host:port
    pid: int | None = Field(default=None, ge=1, lt=2**31)  # same-host reads: holder process
    pid_started: int | None = Field(default=None, ge=0)  # its start (ticks): no reused pid
    host: str | None = Field(default=None, max_length=128)  # boot id / pid namespace
    shared: list[SharedRegion] = Field(default_factory=list, max_length=64)


# --------------------------------------------------------------------------- requests
class Register(Strict):
    type: Literal["register"] = "register"
    name: Name
    role: Literal["trainer", "replica"]
    endpoint: Endpoint
    labels: dict[Name, Name] = Field(default_factory=dict, max_length=32)
    # Its progress bytes (`core/stripes.py`): what its striped readers poll one-sided.
    progress: MemoryDesc | None = None
    # The key its transport checks readers' grants with (`core/transport/grants.py`).
    grant_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # A trainer's newest published version of each model: after a coordinator restart,
    # versions past it that holders brought back are another run's, and are dropped.
    published: dict[Name, Version] = Field(default_factory=dict, max_length=1024)
    # The credential each of those models' first publish returned (`Published.owner`): only
    # a claim that shows it speaks for a model (`coordinator/owners.py`).
    owners: dict[Name, Annotated[str, Field(max_length=256)]] = Field(default_factory=dict,
                                                                     max_length=1024)


class PullProgress(Strict):
    """A pull in flight, as its reader's heartbeat reports it: the live view
    (`tensorhub status --watch`) shows it with no per-chunk message to the coordinator."""

    model: Name
    version: Version
    done: Annotated[int, Field(ge=0, lt=2**62)]  # bytes landed so far
    total: Annotated[int, Field(ge=0, lt=2**62)]  # bytes of the whole pull
    seconds: Annotated[float, Field(ge=0, lt=1e9)]  # since it began


class Heartbeat(Strict):
    type: Literal["heartbeat"] = "heartbeat"
    worker_id: Name
    pull: PullProgress | None = None


class Unregister(Strict):
    type: Literal["unregister"] = "unregister"
    worker_id: Name


class Part(Strict):
    """Which part of a sharded version a trainer rank publishes or holds: K ranks publish
    parts 0..K-1 of one version, each an ordinary layout of its own tensors (or row
    slices). The version exists only once all K are in."""

    part: Annotated[int, Field(ge=0, lt=MAX_PARTS)] = 0
    parts: Annotated[int, Field(ge=1, le=MAX_PARTS)] = 1

    @model_validator(mode="after")
    def _part_in_range(self) -> Part:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts are 0..{self.parts - 1}")
        return self

    @staticmethod
    def worker_name(base: str, part: int) -> str:
        """The name a reader's worker for `part` registers under: part 0 keeps the reader's
        name (an unsharded version is its part 0), part r is `<name>.part<r>`."""
        return base if part == 0 else f"{base}.part{part}"


class Publish(Part):
    """A trainer creates a new version (or its part `part` of `parts`) and is its first
    holder."""

    type: Literal["publish"] = "publish"
    worker_id: Name
    model: Name
    version: Version
    manifest: Manifest
    checksums: list[str] = Field(max_length=MAX_TENSORS)  # one per item
    memory: list[MemoryDesc] = Field(max_length=MAX_TENSORS)  # one per item
    endpoint: Endpoint | None = None  # fresh metadata if memory was registered since register
    # The model's credential (`Published.owner` of its first publish): once a trainer bound
    # a model, only a publish that shows it is taken (`coordinator/owners.py`).
    owner: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _tiles_are_parts(self) -> Publish:
        if (count := self.manifest.tile_parts) is not None and self.parts != count:
            raise ValueError(f"a version in {self.manifest.tiles} tiles"
                             f"{' with its K/V by head' if self.manifest.kv_heads else ''} "
                             f"is published in {count} parts, not {self.parts}")
        if self.manifest.blocks is not None:
            if self.manifest.tiles is not None:
                raise ValueError("a version is in tiles or in layer blocks, not both")
            if self.parts != len(self.manifest.blocks) + 1:
                raise ValueError(f"a version in {len(self.manifest.blocks) - 1} layer blocks "
                                 f"is published in {len(self.manifest.blocks) + 1} parts, "
                                 f"not {self.parts}")
        return self


def checksums_digest(checksums: list[str]) -> str:
    """One short digest of a layout's checksums (`Hold.by_reference`)."""
    return xxhash.xxh3_64_hexdigest("\n".join(checksums).encode())


class Hold(Part):
    """A worker holds a complete, verified copy of an existing version (of one part of it,
    for a sharded version) and serves reads of it."""

    type: Literal["hold"] = "hold"
    worker_id: Name
    model: Name
    version: Version
    layout_id: Name
    memory: list[MemoryDesc] = Field(max_length=MAX_TENSORS)
    endpoint: Endpoint | None = None
    # Sent along so a restarted coordinator (soft state) can rebuild the version's record
    # from its holders, and so a worker can hold a layout of its own (an engine's native one).
    manifest: Manifest | None = None
    checksums: list[str] | None = Field(default=None, max_length=MAX_TENSORS)
    # By reference: the digest of the checksums verified against (`checksums_digest`), so
    # a layout id the coordinator has with other checksums is not taken for ours.
    checksums_digest: Name | None = None

    def by_reference(self) -> Hold:
        """This Hold naming its layout by id and its checksums by digest alone, for a layout
        the coordinator planned the read from: the manifest and checksums it already has
        are most of the bytes it decodes (a fleet's part readers send one each per
        version)."""
        return self.model_copy(update={
            "manifest": None, "checksums": None,
            "checksums_digest": checksums_digest(self.checksums or [])})


class Withdraw(Strict):
    """A holder stops serving a version (before overwriting it). Idempotent: call again to
    learn how many reads of it are still in flight. The coordinator refuses (`last_holder`)
    to let the last holder of a model's newest version go, so a version is never lost by
    accident; `force` is for a trainer about to publish a newer one, or an operator who
    means it."""

    type: Literal["withdraw"] = "withdraw"
    worker_id: Name
    model: Name
    version: Version
    force: bool = False
    # The holder found its own copy damaged (its checksums fail): it withdraws, and says so.
    damaged: bool = False


class RetentionRequest(Strict):
    """How safely kept is a version: who holds it, who is reading it, who could."""

    type: Literal["retention"] = "retention"
    model: Name
    version: Version
    # Count only holders of this layout (the publisher's own): a holder of another layout
    # (an engine's native one) cannot serve the readers of this one.
    layout_id: Name | None = None


class ByteRange(Strict):
    """Bytes [offset, offset+nbytes) of item `item` of a layout."""

    item: Annotated[int, Field(ge=0)]
    offset: Annotated[int, Field(ge=0)]
    nbytes: Annotated[int, Field(ge=0)]


class ReadDone(Strict):
    """A reader ends its lease: the holder's bytes may be overwritten once all leases end."""

    type: Literal["read_done"] = "read_done"
    worker_id: Name
    lease_id: Name
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = Field(default=None, max_length=4096)
    failed_holders: list[Name] = Field(default_factory=list, max_length=64)
    # Striped pulls: bytes read from each source (worker id), for the transfer records.
    by_source: dict[Name, Annotated[int, Field(ge=0)]] = Field(default_factory=dict,
                                                               max_length=64)
    # Sources that served bytes failing the version's checksums (found when the reader read
    # those bytes again from another holder and they passed): reported like failed ones.
    bad_bytes: list[Name] = Field(default_factory=list, max_length=64)


class GetManifest(Strict):
    type: Literal["manifest"] = "manifest"
    model: Name
    version: Version | Literal["latest"] = "latest"
    part: Annotated[int, Field(ge=0, lt=MAX_PARTS)] = 0  # of a sharded version


class PublishStatus(Strict):
    """How far a sharded version's publish is: which parts are in, or why it was given up."""

    type: Literal["publish_status"] = "publish_status"
    model: Name
    version: Version


class StatusRequest(Strict):
    type: Literal["status"] = "status"


class LatestRequest(Strict):
    """The model's newest version, as its announcement said (`Announcement`); with
    `newer_than`, only if it is newer than that (else `Ack`: a waiting reader's question
    costs a few bytes, not an announcement's)."""

    type: Literal["latest"] = "latest"
    model: Name
    newer_than: int | None = Field(default=None, ge=0, lt=2**62)


class HoldingsRequest(Strict):
    """Which versions of `model` do the workers named `names` hold? (Cheap enough to poll:
    an engine's front end watches its own workers this way.)"""

    type: Literal["holdings"] = "holdings"
    model: Name
    names: list[Name] = Field(max_length=1024)
    # Also: who holds which versions in this layout (`HoldingsReply.in_layout`).
    layout_id: Name | None = None


class _PlanAsk(Strict):
    """What every plan request says: who asks, for which version, in which layout."""

    worker_id: Name
    model: Name
    version: Version | Literal["latest"] = "latest"
    layout_id: Name | None = None  # None: the version's origin layout (checkpoint layout)
    # The reader has this version's manifest and checksums (from its first plan of this
    # pull): the reply leaves them out (for a model of thousands of tensors they are most of
    # a plan's bytes). Only with a numbered version.
    known_manifest: bool = False


class PlanRequest(_PlanAsk):
    """A whole-item plan: every item (or the `missing` ranges) from one holder."""

    type: Literal["plan"] = "plan"
    # Re-planning after a failure: only these ranges are still missing (None: everything).
    missing: list[ByteRange] | None = Field(default=None, max_length=MAX_TENSORS)
    # The end of the reader's previous lease, carried here to save a round trip: applied
    # before planning, and idempotent, so a retried request may carry it again.
    done: ReadDone | None = None
    # Holders not to plan this request onto (the reader's own choice for its own plan: the
    # sources of bytes that failed their checksums, read again elsewhere); the publisher
    # is still planned when nobody else holds the version.
    avoid: list[Name] = Field(default_factory=list, max_length=64)


class _StripedAsk(_PlanAsk):
    """A striped pull's request (`coordinator/forest.py`: one parent per stripe for the
    whole version). A reader that serves what it pulls (`relay`) sends its destination
    `memory` (and a fresh `endpoint`) with its first request, and again with a later one
    if the coordinator restarted since."""

    relay: bool = True  # the reader serves the chunks it has (False: a staging copy)
    memory: list[MemoryDesc] | None = Field(default=None, max_length=MAX_TENSORS)
    endpoint: Endpoint | None = None


class StripedPlanRequest(_StripedAsk):
    """A striped pull's first request: a parent for every stripe."""

    type: Literal["striped_plan"] = "striped_plan"


class ReplanStripes(_StripedAsk):
    """Parents again for the `stripes` named: none yet, or one that `failed` or fell
    `behind` (worker ids)."""

    type: Literal["replan_stripes"] = "replan_stripes"
    stripes: list[Annotated[int, Field(ge=0, lt=64)]] = Field(min_length=1, max_length=64)
    failed: list[Name] = Field(default_factory=list, max_length=64)
    behind: list[Name] = Field(default_factory=list, max_length=64)


class ConfirmParents(_StripedAsk):
    """A reader already reads the announced version by its last parents (no plan waited
    for) and says so: its lease is opened under the name it already uses
    (`core.stripes.warm_lease_id`), and the reply is the plan it would have had."""

    type: Literal["confirm_parents"] = "confirm_parents"


StripedRequest = StripedPlanRequest | ReplanStripes | ConfirmParents


class StandBy(Strict):
    """A reader whose buffers are ready, waiting for a model's first version, asks to be
    placed now in the forest of that version in its layout (`coordinator/standby.py`):
    when the version comes it pulls at once from the parents it was told (`Placement`),
    as a steady fleet pulls from the last version's, instead of every reader's first plan
    request waiting in the coordinator's queue. Asked again, it is told its parents again
    (a stripe still pending may have one by then)."""

    type: Literal["stand_by"] = "stand_by"
    worker_id: Name
    model: Name
    layout_id: Name
    memory: list[MemoryDesc] = Field(min_length=1, max_length=MAX_TENSORS)
    endpoint: Endpoint | None = None  # fresh metadata if memory was registered since


class Declare(Strict):
    """A trainer says, before its model's first version, the manifest that version will
    have: engines' checkpoint copies (`PartedReplica`, which have no buffers before a
    version) allocate from it and stand by (`StandBy`) instead of asking for a plan when
    the version comes. Forgotten once a version is out (and by a restart). A declaration
    the version does not match costs nothing but those readers' early allocation: they
    ask for a plan as usual."""

    type: Literal["declare"] = "declare"
    worker_id: Name
    model: Name
    manifest: Manifest


class GetDeclared(Strict):
    """The manifest declared for `model`'s first version (`Declare`), if there is one."""

    type: Literal["get_declared"] = "get_declared"
    model: Name


class Forget(Strict):
    """Drop a model nobody uses any more, and its patches, from the coordinator's records
    (`coordinator/forgetting.py` says when it may)."""

    type: Literal["forget"] = "forget"
    model: Name


Request = Annotated[
    Register | Heartbeat | Unregister | Publish | Hold | Withdraw | PlanRequest
    | StripedPlanRequest | ReplanStripes | ConfirmParents | ReadDone | GetManifest
    | StatusRequest | HoldingsRequest | RetentionRequest | LatestRequest
    | PublishStatus | StandBy | Declare | GetDeclared | Forget,
    Field(discriminator="type"),
]


class Envelope(Strict):
    """What a client sends: a request and, when the coordinator requires one, the token;
    for a request made as a worker (it names a `worker_id`), the secret that worker was
    given when it registered (`Registered.secret`): a worker acts only for itself."""

    protocol: int = PROTOCOL
    token: str | None = Field(default=None, max_length=1024)
    secret: str | None = Field(default=None, max_length=128)
    request: Request


# --------------------------------------------------------------------------- replies
class ErrorReply(Strict):
    type: Literal["error"] = "error"
    code: Literal[
        "bad_request", "unauthorized", "unknown_worker", "unknown_model", "unknown_version",
        "stale_version", "layout_mismatch", "no_holder", "busy", "last_holder", "internal",
        "unreachable", "aborted", "probation", "in_use", "layout_unserved",
    ]  # fmt: skip
    message: str
    retry_after: float | None = None


class Registered(Strict):
    type: Literal["registered"] = "registered"
    protocol: int = PROTOCOL
    worker_id: Name
    secret: str = Field(max_length=128)  # shown with every request made as this worker
    heartbeat_interval: float
    worker_ttl: float
    announce_address: str
    lease_ttl: float = 120.0  # the longest a read may hold a version its holder withdraws


class Ack(Strict):
    type: Literal["ack"] = "ack"


class Dropped(Strict):
    """A version the coordinator no longer plans reads from this worker on: credible readers
    on several nodes failed to read it. The worker may offer it again (`Hold`) after
    `retry_after` seconds; the coordinator refuses it before then (`probation`)."""

    model: Name
    version: Version
    retry_after: float = Field(ge=0)
    # Readers found bytes of it that failed the checksums: the worker checks its copy.
    bad_bytes: bool = False


class HeartbeatReply(Strict):
    type: Literal["heartbeat_reply"] = "heartbeat_reply"
    dropped: list[Dropped] = Field(default_factory=list, max_length=4096)


class Published(Strict):
    type: Literal["published"] = "published"
    model: Name
    version: Version
    layout_id: Name
    complete: bool = True  # False: a sharded version still waiting for other parts
    # The model's credential (its part's, for a sharded one), when this publish bound it:
    # kept by the trainer and shown with every later publish and registration.
    owner: str | None = Field(default=None, max_length=256)
    # Bytes/s of the slowest of the model's readers' last whole pulls, if any: what the
    # trainer weighs its next patch's cost against (`core/patch_budget.py`).
    pull_rate: float | None = Field(default=None, gt=0, lt=1e15)


class PublishStatusReply(Strict):
    type: Literal["publish_status_reply"] = "publish_status_reply"
    state: Literal["complete", "pending", "aborted", "unknown"]
    parts: int = 1
    parts_in: list[int] = Field(default_factory=list, max_length=MAX_PARTS)
    reason: str | None = None  # why it was aborted


class Withdrawn(Strict):
    type: Literal["withdrawn"] = "withdrawn"
    active_reads: int


class Retention(Strict):
    type: Literal["retention_reply"] = "retention_reply"
    replica_holders: int  # replicas (not trainers) holding the version completely
    active_reads: int  # reads of the version in flight
    replicas: int  # replicas registered at all (could still come to hold it)


class ReadRange(Strict):
    """Bytes [offset, offset+nbytes) of item `item`, read from `source` (a holder)."""

    item: int
    offset: int
    nbytes: int
    source: Name

    def key(self) -> tuple[int, int, int]:
        return (self.item, self.offset, self.nbytes)


class Source(Strict):
    """A holder as the reader needs it: how to reach it and where its items lie."""

    worker_id: Name
    name: Name
    role: Literal["trainer", "replica"]
    endpoint: Endpoint
    memory: list[MemoryDesc]
    # Striped plans: where its progress bytes are.
    progress: MemoryDesc | None = None
    grant: str | None = None  # leave to read it, for a holder that checks (`grants.py`)


class ReadPlan(Strict):
    type: Literal["read_plan"] = "read_plan"
    model: Name
    version: Version
    layout_id: Name
    # None when the request said `known_manifest` (a later plan of the same pull).
    manifest: Manifest | None
    checksums: list[str] | None
    lease_id: Name
    lease_ttl: float
    sources: list[Source]
    ranges: list[ReadRange]
    # Striped plans: False while a stripe has no parent yet (`stripes`).
    complete: bool = True
    # Striped plans: the coordinator's chunk size (a coordinator run with another size than
    # the default would otherwise be read in chunks that are not the ones it planned).
    chunk_bytes: Annotated[int, Field(gt=0, lt=2**44)] | None = None
    # Striped plans: the parent (worker id) of each stripe; None: none yet, ask again after
    # `retry_after` seconds for those stripes.
    stripes: list[Name | None] | None = None
    retry_after: float | None = None
    # Striped plans: the sources that hold every chunk (read at once, never polled).
    holding: list[Name] | None = None


class Placement(Strict):
    """Where a reader on standby (`StandBy`) stands in the forest of the coming version: a
    parent per stripe, `PUBLISHER` where it is whoever publishes that version (its
    endpoint and regions come with the announcement), None where it has none yet (ask
    again after `retry_after`); and the endpoint and regions of the parents that are
    readers."""

    type: Literal["placement"] = "placement"
    model: Name
    layout_id: Name
    chunk_bytes: Annotated[int, Field(gt=0, lt=2**44)]
    stripes: list[Name | None] = Field(min_length=1, max_length=64)
    sources: list[Source] = Field(max_length=64)
    retry_after: float | None = None


class Declared(Strict):
    """The answer to `GetDeclared`: the manifest the model's first version will have."""

    type: Literal["declared"] = "declared"
    model: Name
    layout_id: Name
    manifest: Manifest


# A placement's parent that is the coming version's publisher, whoever that is (no worker
# id is one: every id ends in a suffix the coordinator makes).
PUBLISHER = "@publisher"


class ManifestReply(Strict):
    type: Literal["manifest_reply"] = "manifest_reply"
    model: Name
    version: Version
    layout_id: Name
    manifest: Manifest
    parts: int = 1  # a sharded version: ask for each part (`GetManifest.part`)


class HolderStatus(Strict):
    worker_id: str
    name: str
    role: str
    active_reads: int
    withdrawn: bool


class VersionStatus(Strict):
    version: int
    layout_id: str
    part: int | None = None  # of a sharded version
    nbytes: int
    holders: list[HolderStatus]


class ModelStatus(Strict):
    model: str
    latest: int
    versions: list[VersionStatus]


class TransferRecord(Strict):
    reader: str
    source: str
    model: str
    version: int
    nbytes: int
    seconds: float
    ok: bool
    error: str | None = None
    # Wall-clock time (Unix seconds) the coordinator recorded it: `tensorhub status` shows
    # it, so an operator can tell a pull of a minute ago from one of an hour ago.
    ended_at: float | None = None


class PullInFlight(PullProgress):
    reader: str


class StatusReply(Strict):
    type: Literal["status_reply"] = "status_reply"
    workers: list[dict[str, str | float]]
    models: list[ModelStatus]
    reads_in_flight: int
    transfers: list[TransferRecord]
    pulls: list[PullInFlight] = Field(default_factory=list)  # as of each reader's last beat
    # readers that failed on every holder they tried: their reports no longer drop anyone
    suspect_readers: list[str] = Field(default_factory=list)


# The label a worker registers with to say which layout it serves before it holds a version
# in it (`HoldingsReply.in_layout`).
LAYOUT_LABEL = "layout"


class HoldingsReply(Strict):
    type: Literal["holdings_reply"] = "holdings_reply"
    latest: int  # 0: the model has no version yet
    holdings: dict[str, list[int]]  # name -> versions held completely (not withdrawn)
    # name -> its last successful pull: an engine's front end puts its workers' pulls on
    # the engine's own /metrics (the pulls happen in worker processes it cannot read)
    pulls: dict[str, TransferRecord] = Field(default_factory=dict)
    # With `layout_id`: name -> versions it holds completely in that layout, for every
    # worker that does, and [] for a worker registered with that layout as its label
    # `LAYOUT_LABEL` that holds none at the moment (an engine's live parameters, being written).
    in_layout: dict[str, list[int]] = Field(default_factory=dict)
    # where the coordinator announces versions: a front end that follows the model wakes on
    # an announcement instead of waiting out its poll interval ("": not said)
    announce_address: str = ""


class Announcement(Strict):
    """A model has a new version: PUB message (topic = model name), and the reply to
    `LatestRequest`, the one fallback when announcements go quiet.

    It carries what a reader that pulled the previous version by stripes needs to pull
    this one with no plan request: the checksums, the chunk size and the publisher (with a
    digest of its memory regions: a reader whose parent is the publisher re-uses the
    regions it knows only if they did not change). And the manifest, so that a reader
    with no buffers yet allocates them and sends its first plan request at once (no
    `GetManifest` before it: with a fleet's first version, every reader's first message
    waits in the coordinator's queue)."""

    type: Literal["announcement"] = "announcement"
    model: Name
    version: Version
    layout_id: Name
    checksums: list[str] | None = Field(default=None, max_length=MAX_TENSORS)
    chunk_bytes: Annotated[int, Field(gt=0, lt=2**44)] | None = None
    publisher: Name | None = None
    memory_digest: str | None = Field(default=None, max_length=64)
    parts: int = 1  # a sharded version: the rest describes its part 0
    manifest: Manifest | None = None
    # The publisher's endpoint and regions (a whole version): a reader placed under the
    # publisher before the version existed (`Placement`) reads from it with no plan.
    source: Source | None = None


class Forgotten(Strict):
    """The versions forgotten, by model (the model, and its patch model if it had one)."""

    type: Literal["forgotten"] = "forgotten"
    model: Name
    versions: dict[Name, list[Version]]


Reply = Annotated[
    ErrorReply | Registered | Ack | HeartbeatReply | Published | Withdrawn | ReadPlan
    | ManifestReply | StatusReply | HoldingsReply | Retention | Announcement | PublishStatusReply
    | Placement | Declared | Forgotten,
    Field(discriminator="type"),
]
