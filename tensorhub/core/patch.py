"""Patches: a version carried as the exact changes from the version before it.

At RL learning rates most of an optimizer step falls below bf16's rounding step, so most
16-bit words of a new version keep their exact bits. A patch names the words that changed
and how (their XOR with the old word), so applying it to the base gives the new version bit
for bit; the new version's checksums then prove it.

Encoding, per item (chosen by measurement: `bench/patches.py`): the gaps between changed
words as uint16 (a longer gap is bridged by entries that change nothing) and each change as
old XOR new, both split into byte planes and compressed with zstd (level 1). A small step's
XOR is mostly zero in its high byte and its gaps mostly short, which the planes expose to
the compressor. Words are 16 bits where an item's size is even, else bytes.

A patch is version data like any other: a one-tensor version of the companion model
`patch_model(model)`, pulled, verified, held and served by the fleet; the tensor's name says
its base version (`patch_tensor_name`), so a reader sees from the manifest alone whether a
chain of patches leads from what it holds to what it wants.
"""

from __future__ import annotations

import re
import struct
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorhub.core.data_types import Manifest
from tensorhub.core.errors import TensorHubError

MAGIC = b"THP1"
GAP_MAX = 0xFFFF  # the longest gap one uint16 entry says; longer ones take filler entries
PATCH_SUFFIX = ".patch"
_NAME = re.compile(r"^from_v([1-9][0-9]{0,17})$")
_ZSTD_LEVEL = 1
# Fewer bytes than any measured patch took per changed word (0.9 to 1.7 on real and
# synthetic bf16 steps, `bench/results/patches.md`): a writer whose changes would take more
# than its budget even at this rate stops diffing after one count of them.
MIN_BYTES_PER_CHANGE = 0.75


class PatchError(TensorHubError):
    """A patch that cannot be applied: malformed, or made for other bytes than ours."""

    def __init__(self, message: str):
        super().__init__(message, code="bad_patch")


def patch_model(model: str) -> str:
    """The companion model whose version v is the patch that makes `model`'s v."""
    return model + PATCH_SUFFIX


def is_patch_model(model: str) -> bool:
    return model.endswith(PATCH_SUFFIX)


def patch_tensor_name(base: int) -> str:
    return f"from_v{base}"


def base_of(manifest: Manifest) -> int | None:
    """The base version a patch version's manifest names (None: not a patch's manifest)."""
    if len(manifest.tensors) != 1 or manifest.tensors[0].dtype != "uint8":
        return None
    m = _NAME.match(manifest.tensors[0].name)
    return int(m.group(1)) if m else None


class _ItemHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    item: int = Field(ge=0)
    word: int = Field(ge=1, le=2)
    entries: int = Field(ge=1, lt=2**40)
    nbytes: int = Field(ge=1, lt=2**40)  # compressed


class PatchHeader(BaseModel):
    """What a patch says of itself: which version of which layout it turns into which, and
    where each changed item's compressed changes lie."""

    model_config = ConfigDict(extra="forbid", strict=True)
    base: int = Field(ge=1)
    version: int = Field(ge=2)
    layout_id: str = Field(min_length=1, max_length=64)
    items: list[_ItemHeader] = Field(max_length=1 << 20)


@dataclass
class _Encoded:
    item: int
    word: int
    entries: int
    payload: bytes


def _word(nbytes: int) -> int:
    return 2 if nbytes % 2 == 0 else 1


def word_count(nbytes: int) -> int:
    """How many words a patch compares in an item of `nbytes` (16-bit where they fit)."""
    return nbytes // _word(nbytes)


def _words(buf: torch.Tensor, word: int) -> torch.Tensor:
    if word == 1:
        return buf
    try:
        return buf.view(torch.int16)
    except RuntimeError as exc:  # (a byte view that starts at an odd address)
        raise PatchError(f"an item's bytes cannot be read as 16-bit words: {exc}") from None


def _planes(a: np.ndarray) -> bytes:
    """The array's bytes grouped by byte position: all low bytes, then all high bytes."""
    return a.view(np.uint8).reshape(-1, a.itemsize).T.tobytes()


def _unplanes(raw: bytes, itemsize: int, dtype: type) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)
    return np.array(planes.T, order="C").view(dtype).reshape(-1)


def encode_changes(positions: np.ndarray, xor: np.ndarray) -> tuple[int, bytes]:
    """(entries, compressed bytes) for changed words at strictly increasing `positions`,
    each changed by `xor`."""
    gaps = np.diff(positions, prepend=-1)
    fill = (gaps - 1) // GAP_MAX
    entries = len(positions) + int(fill.sum())
    stored = np.full(entries, GAP_MAX, dtype=np.uint16)
    real = np.cumsum(fill + 1) - 1
    stored[real] = gaps - fill * GAP_MAX
    values = np.zeros(entries, dtype=xor.dtype)
    values[real] = xor
    raw = _planes(stored) + _planes(values)
    return entries, zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)


def decode_changes(payload: bytes, entries: int, word: int,
                   nwords: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, xor) of one item's changes; `PatchError` for bytes that do not decode to
    strictly increasing positions inside the item."""
    if entries > nwords + nwords // GAP_MAX + 1:
        raise PatchError(f"a patch item has {entries} entries for {nwords} words")
    size = entries * (2 + word)
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    except (zstandard.ZstdError, MemoryError) as exc:
        raise PatchError(f"a patch item does not decompress: {exc!r}") from None
    if len(raw) != size:
        raise PatchError(f"a patch item holds {len(raw)} bytes, its header says {size}")
    stored = _unplanes(raw[:2 * entries], 2, np.uint16)
    if stored.min() < 1:
        raise PatchError("a patch item repeats a position")
    positions = np.cumsum(stored, dtype=np.int64) - 1
    if positions[-1] >= nwords:
        raise PatchError(f"a patch item changes word {positions[-1]} of {nwords}")
    xor = _unplanes(raw[2 * entries:], word, np.uint16 if word == 2 else np.uint8)
    return positions, xor


def changes(old: torch.Tensor, new: torch.Tensor,
            budget: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(positions, xor) of the words where `new` differs from `old` (bytes of one item);
    None if there are more than `budget` of them."""
    word = _word(old.numel())
    a, b = _words(old, word), _words(new, word)
    differ = a != b
    if budget is not None and int(torch.count_nonzero(differ)) > budget:
        return None
    positions = differ.nonzero().flatten()
    xor = (a[positions] ^ b[positions]).cpu().numpy()
    return positions.cpu().numpy(), xor.view(np.uint16) if word == 2 else xor


def sample_changes(old: list[torch.Tensor], new: list[torch.Tensor], seed: int,
                   windows: int = 64, window_words: int = 1024) -> tuple[int, int]:
    """(words looked at, words changed among them) in `windows` windows of `window_words`
    words placed at random over the items (bytes of a version before and after, as pairs):
    the density of a step for a small fraction of a full comparison's work."""
    sizes = np.array([word_count(a.numel()) for a in old], dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return 0, 0
    if total <= windows * window_words:
        starts = np.arange(0, total, window_words, dtype=np.int64)
    else:
        rng = np.random.default_rng(seed)
        starts = np.sort(rng.integers(0, total - window_words, windows))
    ends = np.cumsum(sizes)
    looked = changed = 0
    for start in starts.tolist():
        k = int(np.searchsorted(ends, start, side="right"))
        at = start - (int(ends[k - 1]) if k else 0)
        n = min(window_words, int(sizes[k]) - at)
        word = _word(old[k].numel())
        try:
            a = _words(old[k], word)[at:at + n]
            b = _words(new[k], word)[at:at + n].to(a.device)
        except (PatchError, RuntimeError):
            continue
        looked += n
        changed += int(torch.count_nonzero(a != b))
    return looked, changed


class PatchWriter:
    """Builds the patch from a base version to a new one, item by item, as a publisher
    overwrites its buffers: `item(k, old, new)` before item k's buffer takes the new bytes."""

    def __init__(self, base: int, version: int, layout_id: str,
                 budget: int | None = None, total_bytes: int | None = None):
        """`budget`: the most bytes the patch may take; once its changes alone would
        exceed it (at the least one might encode them in), the writer gives up and
        `abandoned` is True (the version then moves whole). With `total_bytes` (the
        version's), it gives up as soon as the items seen so far changed more than their
        share of that budget: a dense step is given up after counting its first item,
        before any is encoded."""
        self.base, self.version, self.layout_id = base, version, layout_id
        self.budget = budget
        self.total_bytes = total_bytes
        self._bytes_seen = 0
        self._items: list[_Encoded] = []
        self.changed_words = 0
        self.words = 0
        self.abandoned = False
        self.encode_s = 0.0  # time spent encoding changes (a trainer's rate to learn)

    def item(self, k: int, old: torch.Tensor, new: torch.Tensor) -> None:
        """Item k's bytes before (`old`) and after (`new`); the writer gives up (`abandoned`)
        rather than fail on bytes it cannot compare (another device, an odd address)."""
        if old.numel() != new.numel():
            raise PatchError(f"item {k} has {old.numel()} bytes, its new value {new.numel()}")
        if self.abandoned:
            return
        word = _word(old.numel())
        self.words += old.numel() // word
        self._bytes_seen += old.numel()
        left = None
        if self.budget is not None:
            allowed = self.budget / MIN_BYTES_PER_CHANGE
            if self.total_bytes:
                allowed *= min(1.0, self._bytes_seen / self.total_bytes)
            left = int(allowed) - self.changed_words
        try:
            found = changes(old, new, left)
        except (PatchError, RuntimeError):
            found = None
        if found is None:
            self.abandoned, self._items = True, []
            return
        positions, xor = found
        if len(positions):
            self.changed_words += len(positions)
            started = time.perf_counter()
            entries, payload = encode_changes(positions, xor)
            self._items.append(_Encoded(k, word, entries, payload))
            self.encode_s += time.perf_counter() - started

    @property
    def density(self) -> float:
        """The share of words that changed."""
        return self.changed_words / self.words if self.words else 0.0

    def nbytes(self) -> int:
        """The patch's size so far, near enough (the header is a few bytes an item)."""
        return sum(len(e.payload) + 24 for e in self._items) + 64

    def finish(self) -> bytes:
        items = sorted(self._items, key=lambda e: e.item)
        header = msgpack.packb(PatchHeader(
            base=self.base, version=self.version, layout_id=self.layout_id,
            items=[_ItemHeader(item=e.item, word=e.word, entries=e.entries,
                               nbytes=len(e.payload)) for e in items]).model_dump())
        return b"".join([MAGIC, struct.pack("<I", len(header)), header,
                         *(e.payload for e in items)])


def read_header(patch: bytes | memoryview) -> tuple[PatchHeader, int]:
    """The header and where the first item's bytes start; `PatchError` if malformed."""
    if bytes(patch[:4]) != MAGIC or len(patch) < 8:
        raise PatchError("not a TensorHub patch")
    (n,) = struct.unpack("<I", bytes(patch[4:8]))
    try:
        header = PatchHeader.model_validate(msgpack.unpackb(bytes(patch[8:8 + n])))
    except (ValidationError, ValueError, msgpack.UnpackException) as exc:
        raise PatchError(f"a patch's header is malformed: {exc}") from None
    return header, 8 + n


def apply_patch(patch: bytes | memoryview, items: list[torch.Tensor], *, base: int,
                layout_id: str, version: int | None = None) -> list[int]:
    """Apply `patch` to `items` (the bytes of version `base` in layout `layout_id`), in
    place; return the items it changed. Checked before any byte changes: the patch is for
    this base and layout (and makes `version`, if given), and each item's changes decode to
    positions inside it."""
    header, at = read_header(patch)
    if header.base != base or header.layout_id != layout_id:
        raise PatchError(f"the patch is from v{header.base} in layout {header.layout_id}; "
                         f"these bytes are v{base} in layout {layout_id}")
    if version is not None and header.version != version:
        raise PatchError(f"the patch makes v{header.version}, not v{version}")
    decoded = []
    for h in header.items:
        if h.item >= len(items) or (decoded and h.item <= decoded[-1][0]):
            raise PatchError(f"a patch names item {h.item} out of order or of {len(items)}")
        buf = items[h.item]
        if h.word != _word(buf.numel()):
            raise PatchError(f"a patch's word size for item {h.item} is {h.word}")
        payload = patch[at:at + h.nbytes]
        if len(payload) != h.nbytes:
            raise PatchError("a patch ends before its last item")
        at += h.nbytes
        positions, xor = decode_changes(bytes(payload), h.entries, h.word,
                                        buf.numel() // h.word)
        decoded.append((h.item, positions, xor))
    if at != len(patch):
        raise PatchError(f"a patch has {len(patch) - at} bytes after its last item")
    for k, positions, xor in decoded:
        buf = items[k]
        w = _words(buf, _word(buf.numel()))
        idx = torch.from_numpy(positions).to(w.device)
        change = torch.from_numpy(xor.view(np.int16) if xor.dtype == np.uint16 else xor)
        w[idx] ^= change.to(w.device)
    return [k for k, _, _ in decoded]
