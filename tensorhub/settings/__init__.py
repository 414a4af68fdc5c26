"""Every setting TensorHub reads from the environment, declared once: name, type, default,
and why it exists; then the tuning constants an operator may want to change.

A variable is read where it is used (`Setting.get`), never at import, so a test, a launch
script or a parent process can set it for whatever runs next. An empty variable counts as
unset; a value that does not parse fails with a `SettingError` naming the variable.

`python -m tensorhub.settings` prints the table README.md's Settings section carries;
`python -m tensorhub.settings --write README.md` puts it there (`tests/test_settings.py`
fails while the two differ). This module imports nothing else of TensorHub, so every layer
may read it.
"""

from __future__ import annotations

import functools
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import Field, TypeAdapter, ValidationError

T = TypeVar("T")
Seconds = Annotated[float, Field(gt=0)]


class SettingError(ValueError):
    """An environment variable holds a value its setting cannot take."""


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind)


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: `kind` is the type its text is validated as."""

    name: str
    kind: Any
    default: T
    why: str
    shown: str = ""  # the default as the table shows it, where it is not a plain value
    unit: str = ""  # after a number's default in the table, e.g. "s"

    def get(self) -> T:
        """The variable's value now, parsed; the default when it is unset or empty."""
        text = os.environ.get(self.name, "")
        if not text:
            return self.default
        if self.kind is bool:  # a switch: only `0` turns off one that is on, only `1` on
            return text != "0" if self.default else text == "1"
        try:
            return _adapter(self.kind).validate_python(text)
        except ValidationError as exc:
            reason = "; ".join(e["msg"] for e in exc.errors())
            raise SettingError(f"{self.name}={text!r} is not a valid value: {reason}") from None

    def is_set(self) -> bool:
        """Whether the variable holds a value (an empty one counts as unset)."""
        return bool(os.environ.get(self.name, ""))

    def row(self) -> str:
        return f"| `{self.name}` | {_type_text(self.kind)} | {self._default_text()} | {self.why} |"

    def _default_text(self) -> str:
        if self.shown:
            return self.shown
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        if isinstance(self.default, float):
            return f"{self.default:g} {self.unit}".strip()
        return f"`{self.default}`" if self.default != "" else "none"


def _type_text(kind: Any) -> str:
    """How the table names a type: `bool` is written 0 / 1, optional ones as their value's."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    origin = typing.get_origin(kind)
    if origin is Annotated or (args and origin not in (Literal, None)):  # Annotated, X | None
        return _type_text(args[0])
    if origin is Literal:
        return " / ".join(f"`{a}`" for a in args)
    return {bool: "0 / 1", int: "number", float: "number", Path: "path"}.get(kind, "text")


SETTINGS: list[Setting] = []


def declared(name: str) -> Setting:
    """The setting of environment variable `name`."""
    for setting in SETTINGS:
        if setting.name == name:
            return setting
    raise KeyError(f"{name} is not a declared setting")


def _setting(name: str, kind: Any, default: T, why: str, shown: str = "",
             unit: str = "") -> Setting[T]:
    setting = Setting(name, kind, default, why, shown, unit)
    SETTINGS.append(setting)
    return setting


# --- engines (the engine plugins read these through `engines/settings.py`) -----------------

COORDINATOR = _setting(
    "TENSORHUB_COORDINATOR", str | None, None,
    "coordinator address for engines and verl; without it an engine plugin stays inert")
MODEL = _setting("TENSORHUB_MODEL", str, "policy", "model name an engine follows")
MODE = _setting(
    "TENSORHUB_MODE", Literal["follow", "manual"], "follow",
    "engines: `follow` takes every version, `manual` only `POST /tensorhub/update`")
PAUSE = _setting(
    "TENSORHUB_PAUSE", Literal["keep", "keep_kv", "wait", "abort"], "keep",
    "engines: what a swap does to requests in flight: `keep` freezes them and they go on "
    "with the new weights, their KV recomputed; `keep_kv` the same keeping their KV (the "
    "pause is the install; their later tokens attend to KV of the old weights); `wait` lets "
    "them finish first; `abort` ends them")
NAME = _setting("TENSORHUB_NAME", str, "",
                "an engine's worker name (a random suffix is added)",
                shown="`vllm-HOST:PORT` / `sglang-HOST:PORT`")
JOIN_TIMEOUT = _setting("TENSORHUB_JOIN_TIMEOUT", Seconds, 300.0,
                        "engines: longest wait for the newest version at start-up", unit="s")
UPDATE_TIMEOUT = _setting("TENSORHUB_UPDATE_TIMEOUT", Seconds, 120.0,
                          "engines: longest pull", unit="s")
SWAP_TIMEOUT = _setting("TENSORHUB_SWAP_TIMEOUT", Seconds, 300.0,
                        "engines: longest step of a swap (pause, load, resume); past it "
                        "the swap fails naming the step, and the ranks' votes name a rank "
                        "that hangs", unit="s")
POLL_INTERVAL = _setting("TENSORHUB_POLL_INTERVAL", Seconds, 0.2,
                         "engines: how often the front end looks for versions (at once "
                         "when one is announced)", unit="s")
CHECKPOINT_COPY = _setting(
    "TENSORHUB_CHECKPOINT_COPY", Literal["auto", "always", "never"], "auto",
    "SGLang: keep the checkpoint copy always, never, or only while the checkpoint path is used")
QUANTIZED_LAYOUT = _setting(
    "TENSORHUB_QUANTIZED_LAYOUT", Literal["auto", "never"], "auto",
    "vLLM fp8 engines: `auto` follows the trainer's quantized layout of the model "
    "(`<model>@fp8_per_channel`, `Publisher(quantize=...)`) where the trainer publishes one "
    "and the engine can take it; `never` always pulls bf16 and lets the engine quantize")
LOG_LEVEL = _setting("TENSORHUB_LOG_LEVEL", str, "INFO",
                     "level of TensorHub's log inside an engine")
COPY_PER_RANK = _setting("TENSORHUB_COPY_PER_RANK", bool, False,
                         "`1`: a checkpoint copy per TP rank instead of one shared per engine")
WORKER_SPIN = _setting(
    "TENSORHUB_WORKER_SPIN", Annotated[float, Field(ge=0)] | None, None,
    "vLLM (environment only): how long its processes busy-wait for the next call after "
    "reading one. On a CPU host whose engines share cores, set it small (`0.01`): each call "
    "of a swap otherwise keeps every worker spinning a core for vLLM's second, and the "
    "other engines' swaps wait for a core", shown="vLLM's own (1 s)")
BACKGROUND_NICE = _setting(
    "TENSORHUB_BACKGROUND_NICE", Annotated[int, Field(ge=0, le=19)], 0,
    "engines: the nice value of TensorHub's threads that pull, verify and check a version "
    "while the engine generates; e.g. `10` gives a busy core to the engine's own threads "
    "first, and the next version is served later")

# --- every worker -----------------------------------------------------------------------------

TRANSPORT = _setting(
    "TENSORHUB_TRANSPORT", Literal["auto", "nixl", "cma", "zmq"], "auto",
    "how a worker reads peers: `auto` is NIXL across hosts and shared memory or cma on this "
    "host; `zmq` where there is no NIXL")
HOST_ADDRESS = _setting("TENSORHUB_HOST_ADDRESS", str | None, None,
                        "the address a worker advertises to peers",
                        shown="local address of the route to the coordinator")
LABELS = _setting("TENSORHUB_LABELS", str, "",
                  "topology labels added or overridden, e.g. `dc=us-east,rack=r12`",
                  shown="`node=<hostname>`")
UCX_DEFAULTS = _setting("TENSORHUB_UCX_DEFAULTS", bool, True,
                        "`0`: do not set UCX defaults for unset `UCX_*` variables")
SHARED_MEMORY = _setting(
    "TENSORHUB_SHARED_MEMORY", bool, True,
    "`0`: TensorHub's own buffers are ordinary memory, not a shared memfd")
COPY_THREADS = _setting("TENSORHUB_COPY_THREADS", int, 2,
                        "threads for same-host copies (shared memory, cma); at least 1")
CMA_THREADS = _setting("TENSORHUB_CMA_THREADS", int | None, None,
                       "the older name of `TENSORHUB_COPY_THREADS`, read when that is unset")


def copy_threads() -> int:
    """Threads for same-host copies: `TENSORHUB_COPY_THREADS`, else its older name."""
    chosen = COPY_THREADS.get() if COPY_THREADS.is_set() else CMA_THREADS.get()
    return max(1, chosen or COPY_THREADS.default)
STALL_TIMEOUT = _setting(
    "TENSORHUB_STALL_TIMEOUT", Seconds, 30.0,
    "a read batch with no progress this long gives its source up (a stopped holder)",
    unit="s")
MAX_VERSION_GB = _setting(
    "TENSORHUB_MAX_VERSION_GB", Annotated[float, Field(gt=0)] | None, None,
    "the most a version's buffers may take; larger versions are refused",
    shown="free memory now")
PATCHES = _setting(
    "TENSORHUB_PATCHES", bool, True,
    "`0`: a trainer publishes no patches and readers pull every version whole")
CUDA_IPC = _setting("TENSORHUB_CUDA_IPC", bool, False,
                    "`1`: CUDA IPC for same-host GPU reads (never run)")

# --- security -------------------------------------------------------------------------------

TOKEN = _setting(
    "TENSORHUB_TOKEN", str | None, None,
    "token shared by coordinator and workers: CURVE on the coordinator's sockets; engine "
    "routes require it")
TOKEN_FILE = _setting("TENSORHUB_TOKEN_FILE", Path | None, None,
                      "file holding the token, when `TENSORHUB_TOKEN` is unset")
HTTP_TOKEN = _setting("TENSORHUB_HTTP_TOKEN", str | None, None,
                      "token for engine routes only, when neither of the above is set")
CURVE_SECRET_FILE = _setting("TENSORHUB_CURVE_SECRET_FILE", Path | None, None,
                             "coordinator: CURVE secret key from `tensorhub keygen`")
CURVE_SERVER_KEY = _setting("TENSORHUB_CURVE_SERVER_KEY", str | None, None,
                            "clients: the coordinator's public key to pin")
CURVE_SERVER_KEY_FILE = _setting("TENSORHUB_CURVE_SERVER_KEY_FILE", Path | None, None,
                                 "clients: a file holding the coordinator's public key")

# --- set by TensorHub itself ------------------------------------------------------------------

SGLANG_INSTANCE = _setting(
    "TENSORHUB_SGLANG_INSTANCE", str | None, None,
    "internal: SGLang's main process passes its name to its schedulers", shown="set by the plugin")
SGLANG_STATUS_DIR = _setting(
    "TENSORHUB_SGLANG_STATUS_DIR", str | None, None,
    "internal: SGLang's main process passes its status directory to its schedulers",
    shown="set by the plugin")


# --- tuning constants (not read from the environment) ---------------------------------------

# How long a coordinator request waits for its reply unless its caller says otherwise.
REQUEST_TIMEOUT: float = 10.0
# A pull (or join) running longer than this logs its progress this often.
PROGRESS_LOG_SECONDS: float = 10.0
# Same-host copies (`core/transport/parallel_copy.py`) are cut into calls of at most
# COPY_CALL_BYTES: larger calls cost less per byte, and deadlines are checked between calls.
# A read is cut into at least one call per copy thread, but none under COPY_MIN_CALL_BYTES.
COPY_CALL_BYTES: int = 64 << 20
COPY_MIN_CALL_BYTES: int = 1 << 20
# How often shared-memory readers look for mappings of holders that have exited (seconds).
SHM_PRUNE_SECONDS: float = 1.0
# Requests the zmq fallback transport keeps in flight per read.
ZMQ_WINDOW: int = 4
# A connection to a listening socket (the coordinator's, a worker's zmq data port) that has
# not completed its handshake this long after it opened is closed (ZeroMQ's default: 30 s):
# idle half-handshakes of a stranger hold a file descriptor each only this long.
HANDSHAKE_MS: int = 5000
# NIXL (`core/transport/nixl.py`). The progress thread advances the agent's UCX worker this
# often: it serves the reads others make of us over `tcp` (UCX emulates READ with active
# messages there) and completes ours.
NIXL_PROGRESS_PERIOD_S: float = 1e-3
# A read's completion is checked NIXL_WAIT_SPINS times back to back, then after pauses that
# double from NIXL_WAIT_FIRST_S up to NIXL_WAIT_MAX_S, or up to NIXL_WAIT_SHARE of the time
# it has taken so far where that is longer, never over NIXL_WAIT_LONGEST_S: a long read
# costs little CPU while it waits, a short one is seen done at once.
NIXL_WAIT_SPINS: int = 200
NIXL_WAIT_FIRST_S: float = 50e-6
NIXL_WAIT_MAX_S: float = 1e-3
NIXL_WAIT_SHARE: float = 0.05
NIXL_WAIT_LONGEST_S: float = 0.02
# A peer whose read was given up (no progress within the stall timeout) is not read from
# again for this long: every other read of it waiting or in flight fails at once, so a
# stopped source costs one stall timeout, not one per stripe (it has been re-planned away by
# then; a peer that comes back is read again afterwards).
NIXL_GIVE_UP_S: float = 30.0
# How often a read waiting for its turn at a peer looks whether the peer was given up.
NIXL_LOCK_CHECK_S: float = 0.05


# reader (`reader/session.py`, `striped.py`, `replica.py`)
# A parent with no new chunk for this long, while we wait on it, counts as behind.
BEHIND_AFTER: float = 5.0
# The longest gap between polls of a parent that has nothing new: a poll is one small one-
# sided read, and each hop of a stripe's tree may lag its parent by this much.
POLL_MAX: float = 0.01
# A poll reads a few hundred bytes: a parent that does not answer one in this long is gone (or
# hung), and the stripe goes elsewhere.
POLL_TIMEOUT: float = 2.0
# How long a plan request is asked again while no holder is left: a few heartbeats, in case
# holders are registering again with a restarted coordinator.
NO_HOLDER_GRACE: float = 3.0
# How long a pull that has a plan asks again for a version the coordinator does not know
# (holders register again within a few heartbeats of a coordinator restart) before it fails:
# one whose holders all left is gone.
UNKNOWN_GRACE: float = 15.0
# How often it asks again meanwhile.
UNKNOWN_RETRY: float = 0.2
# Seconds before standing by again after the coordinator could not place us.
STANDBY_RETRY: float = 5.0
# Items that failed their checksums are read again from another holder up to this many times
# (each from a holder not tried yet, the publisher last) before the pull fails.
REREAD_TRIES: int = 3
# Patches (`core/patch.py`): each worker keeps and serves the newest PATCH_KEEP; a trainer
# publishes one only if it is at most PATCH_MAX_RATIO of the version's bytes, and a reader
# follows a chain of them only if they add up to at most that share (else it pulls whole).
PATCH_KEEP: int = 3
PATCH_MAX_RATIO: float = 0.25
# Whether a patch pays (`core/patch_budget.py`) is weighed on measured rates; until a
# worker has measured one it takes these (2-core CPU host, `bench/results/patches.md`):
# seconds a trainer takes per word to make a patch (compare, copy, offer it) and per changed
# word encoded, patch bytes per changed word, a reader's seconds per patch pulled (beyond its
# bytes), per patch byte applied and per byte checked.
PATCH_PRIOR_MAKE_S_PER_WORD: float = 1e-8
PATCH_PRIOR_ENCODE_S_PER_CHANGE: float = 2e-7
PATCH_PRIOR_BYTES_PER_CHANGE: float = 1.4
PATCH_PRIOR_APPLY_S_PER_BYTE: float = 2e-7
PATCH_PRIOR_CHECK_S_PER_BYTE: float = 1.5e-10
PATCH_PRIOR_PULL_S_PER_PATCH: float = 0.01
# A whole pull shorter than this tells nothing of a link's rate (its fixed costs dominate).
PATCH_RATE_MIN_BYTES: int = 1 << 20
# How long withdrawing a patch older than the kept ones waits for reads of it to end before
# it is left to the next patch (a trainer's publish waits this long at most).
PATCH_WITHDRAW_S: float = 0.5

# engines (`engines/`, the plugins)
# A version no copy was left of is tried again after this long if nothing newer came (its
# holders may have been re-registering with a restarted coordinator).
LOST_RETRY: float = 15.0
# Seconds between an engine front end's looks at its copy's holdings while the copy pulls a
# newer version (otherwise `TENSORHUB_POLL_INTERVAL`): the swap follows the pull by at most
# this, at the cost of a holdings request this often per engine only while versions move.
POLL_PENDING: float = 0.03
POLL_PENDING_FOR: float = 10.0
# Seconds between a vLLM front end's questions to its workers while they check a version
# before its pause (each is a round trip between two of the engine's steps).
CHECK_POLL: float = 0.005

# Seconds before a front end tries again a version whose swap failed: each try pauses
# generation, so a version the engine refuses must not be tried at every poll.
RETRY_REFUSED: float = 5.0
# Beyond the pull timeout, how long a rank waits for the others at a vote before it goes on
# without them (they are named in its log).
VOTE_MARGIN_S: float = 60.0

# coordinator (`coordinator/`)
# Seconds between walks of the table for workers that stopped heartbeating and expired leases
# (TTLs are seconds: a tenth of a second late is within their slack).
EXPIRY_PERIOD: float = 0.1
# Seconds between measurements of the fleet's shape (metrics served).
FLEET_PERIOD: float = 1.0
# A gap this long between two reads of the queue (each waits at most 0.1 s) means the
# coordinator itself was not listening: see `Coordinator.forgive_pause`.
PAUSE_FORGIVEN: float = 1.0
# The shortest wait a busy reader is told (s): a fleet on fast links must not poll in a loop.
BUSY_RETRY_MIN: float = 0.005
# The coordinator raises its soft open-file limit to its hard limit (at most this) at start:
# many hosts still default to 1024, which a thousand idle connections exhaust.
OPEN_FILES: int = 1 << 20
# Registrations from one address (what the coordinator sees a connection come from), and the
# transport metadata (`Endpoint.agent_metadata`) they carry, at most; and metadata in all.
MAX_WORKERS_PER_PEER: int = 1024
# Open connections one address may hold to the coordinator (two per worker), at most a
# quarter of its open-file limit: past it, a connection is shut down as soon as it is
# accepted (`coordinator/connections.py`).
CONNECTIONS_PER_PEER: int = 4096
MAX_METADATA_PER_PEER: int = 256 << 20
MAX_METADATA_TOTAL: int = 2 << 30
# A request larger than this (bytes) is decoded, and its manifest's work done, on a thread
# beside the coordinator's loop (`coordinator/prepare.py`), which looks for it every
# PREPARED_POLL_MS while one is under way.
PREPARE_BYTES: int = 1 << 20
PREPARED_POLL_MS: int = 5
# Aborted sharded versions remembered, for ranks that ask late.
ABORTED_KEPT: int = 256
# Models a trainer may say it published with no credential to show and no version to judge
# the word by (after a restart, with no persistent key: `coordinator/owners.py`) remembered.
MAX_CLAIMS: int = 4096

# --- the README's table -------------------------------------------------------------------

BEGIN = "<!-- settings table: generated by `python -m tensorhub.settings`; do not edit -->"
END = "<!-- end of settings table -->"


def markdown_table() -> str:
    """Every setting, one row each, in declaration order."""
    return "\n".join(["| variable | type | default | what it does |", "|---|---|---|---|",
                      *(s.row() for s in SETTINGS)])


def table_in(text: str) -> str | None:
    """The generated table between the markers in `text` (a README); None without them."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n?" + re.escape(END), text, re.S)
    return match.group(1).strip() if match else None


def with_table(text: str) -> str:
    """`text` with the current table between its markers."""
    if table_in(text) is None:
        raise SettingError(f"no settings table markers ({BEGIN} ... {END})")
    return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END),
                  lambda _: f"{BEGIN}\n{markdown_table()}\n{END}", text, flags=re.S)
