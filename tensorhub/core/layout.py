"""Layouts: the byte arrangement of a set of tensors, and tiny-tensor compaction.

A manifest (ordered name/dtype/shape/nbytes + compaction threshold) fixes every byte, and its
hash is the layout id. Tensors below the threshold are packed, 64-byte aligned, into one
contiguous *compact region* that travels as a single descriptor (2000 tiny READs cost ~4x one
big READ here); larger tensors travel straight from and into their own memory. A layout is
split into *items* (the compact region first, then each large tensor): items are what
holders describe, what checksums cover and what read plans address.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgpack
import torch

from tensorhub import settings
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import Manifest, MemoryDesc, TensorSpec
from tensorhub.core.errors import LayoutError
from tensorhub.core.experts import ExpertLayout
from tensorhub.core.memory import as_bytes, describe, dtype_name, torch_dtype
from tensorhub.core.schema import Strict
from tensorhub.core.shared_memory import shared_empty

ALIGN = 64  # bytes: where each tensor of a compact region starts (any dtype, a cache line)
# Tensors under this many bytes share one compact region, read in one READ, not one each. It
# is part of the layout (its id), so a trainer and its readers must agree on it.
DEFAULT_COMPACT_THRESHOLD = 1 << 20


class Item(Strict):
    """A unit of transfer: the compact region (many tiny tensors) or one large tensor."""

    kind: Literal["compact", "tensor"]
    nbytes: int
    tensors: list[int]  # indices into Manifest.tensors
    offsets: list[int]  # byte offset of each tensor inside the item (compact region only)


def manifest_of(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
    rows: Mapping[str, tuple[int, int]] | None = None,
    cols: Mapping[str, tuple[int, int]] | None = None,
    tiles: int | None = None,
    blocks: list[int] | None = None,
    experts: ExpertLayout | None = None,
    kv_heads: int | None = None,
) -> Manifest:
    """`rows`: name -> (first row, total rows) for a tensor that is a row slice of a larger
    one (a part of a sharded version, `Publisher(parts=...)`); `cols`: the same for a 2-D
    tensor that is a column slice; `tiles`: the part is one of a version in tiles
    (`tensorhub/tiles.py`), `experts` how it holds a mixture of experts' and `kv_heads`
    whether its K/V projections are split by head (`Manifest`);
    `blocks`: one of a version in layer blocks (`tensorhub/stages.py`)."""
    specs = []
    seen: set[str] = set()
    named_tensors = list(named_tensors)
    rows, cols = rows or {}, cols or {}
    unknown = (set(rows) | set(cols)) - {name for name, _ in named_tensors}
    if unknown:
        raise LayoutError(f"slices given for tensors not published: {sorted(unknown)}")
    for name, t in named_tensors:
        if name in seen:
            raise LayoutError(f"tensor name {name!r} appears twice")
        seen.add(name)
        pieces: dict[str, tuple[int, int, int]] = {}
        for dim, (what, given) in enumerate((("rows", rows), ("cols", cols))):
            if name in given:
                start, total = given[name]
                if t.dim() <= dim:
                    raise LayoutError(f"tensor {name!r}: {t.dim()}-D, no {what} to slice")
                pieces[what] = (start, start + t.shape[dim], total)
        try:
            specs.append(TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                    nbytes=t.numel() * t.element_size(), **pieces))
        except ValueError as exc:
            raise LayoutError(str(exc)) from None
    return Manifest(tensors=specs, compact_threshold=compact_threshold, tiles=tiles,
                    blocks=blocks, experts=experts, kv_heads=kv_heads)


def layout_id(manifest: Manifest) -> str:
    """Stable id of a byte layout: equal ids mean raw bytes can be exchanged as they are."""
    # (None fields left out: a manifest without row slices keeps the id it always had)
    blob = msgpack.packb(manifest.model_dump(mode="python", exclude_none=True),
                         use_bin_type=True)
    return hashlib.sha256(blob).hexdigest()[:24]


def layout_id_sliced(manifest: Manifest) -> str:
    """`layout_id`, with each tensor dumped and packed on its own (many short calls into
    Rust and C, not one as long as the manifest: another thread runs between them)."""
    from tensorhub.core.wire import _array_header, _map_header

    rest = manifest.model_dump(mode="python", exclude_none=True, exclude={"tensors"})
    parts = [_map_header(len(rest) + 1)]
    for name in type(manifest).model_fields:
        if name == "tensors":
            parts.append(msgpack.packb(name, use_bin_type=True))
            parts.append(_array_header(len(manifest.tensors)))
            parts.extend(msgpack.packb(t.model_dump(mode="python", exclude_none=True),
                                       use_bin_type=True) for t in manifest.tensors)
        elif name in rest:
            parts.append(msgpack.packb(name, use_bin_type=True))
            parts.append(msgpack.packb(rest[name], use_bin_type=True))
    return hashlib.sha256(b"".join(parts)).hexdigest()[:24]


def arena_bytes(manifest: Manifest) -> int:
    """Bytes of the one buffer `BoundLayout.allocate` gives a manifest's items."""
    return sum(-(-item.nbytes // ALIGN) * ALIGN for item in plan_items(manifest))


def check_manifest(manifest: Manifest) -> None:
    """Reject a manifest whose sizes do not follow from its dtypes and shapes."""
    sizes: dict[str, int] = {}
    for spec in manifest.tensors:
        numel = 1
        for d in spec.shape:
            numel *= d
        size = sizes.get(spec.dtype)
        if size is None:
            size = sizes[spec.dtype] = torch.empty((), dtype=torch_dtype(spec.dtype)).element_size()
        expected = numel * size
        if spec.nbytes != expected:
            raise LayoutError(
                f"tensor {spec.name!r}: nbytes {spec.nbytes} does not match "
                f"{spec.dtype}{spec.shape} ({expected} bytes)"
            )


def plan_items(manifest: Manifest) -> list[Item]:
    """Split a manifest into transfer items: one compact region, then each large tensor."""
    small, offsets, cursor = [], [], 0
    large = []
    for i, spec in enumerate(manifest.tensors):
        if spec.nbytes < manifest.compact_threshold:
            small.append(i)
            offsets.append(cursor)
            cursor += -(-spec.nbytes // ALIGN) * ALIGN
        else:
            large.append(i)
    items = []
    if small:
        items.append(Item(kind="compact", nbytes=cursor, tensors=small, offsets=offsets))
    for i in large:
        items.append(
            Item(kind="tensor", nbytes=manifest.tensors[i].nbytes, tensors=[i], offsets=[0])
        )
    return items


def allocatable_bytes(device: torch.device) -> int:
    """The most a version's buffers may take here: TENSORHUB_MAX_VERSION_GB if set, else
    the memory the device has free now (a manifest is another party's word: one that
    declares more must not get this process killed for memory)."""
    configured = settings.MAX_VERSION_GB.get()
    if configured is not None:
        return int(configured * 2**30)
    if device.type == "cuda":  # free, plus what PyTorch's cache holds unused
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
    free = [_cgroup_free()]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    return min((f for f in free if f is not None), default=2**62)  # (unknown: no cap)


def _cgroup_free(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup (v2) may still take, if it has a limit (a container)."""
    try:
        with open(f"{root}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{root}/memory.current") as f:
            used = int(f.read())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def check_allocatable(nbytes: int, device: torch.device) -> None:
    limit = allocatable_bytes(device)
    if nbytes > limit:
        raise LayoutError(
            f"a version of {nbytes / 2**30:.1f} GiB does not fit: at most "
            f"{limit / 2**30:.1f} GiB may be allocated on {device} (its free memory, or "
            f"{settings.MAX_VERSION_GB.name}); refused before allocating anything")


class BoundLayout:
    """A manifest bound to this process's tensors, plus the compact region that backs them.

    `item_bytes[k]` is the local memory of item k (what peers read from us, and what we read
    into): the compact buffer, or a large tensor's own bytes. Small tensors that live outside
    the compact buffer are copied in and out of it by `pack` and `scatter`; those that are
    views into it (`allocate`, `move_small_into_region`) need no copy at all, so a read of the
    region is the whole cost of receiving them (scattering 2000 tensors costs ~6 us each
    here, mostly per-tensor overhead: more than the read of their region itself).
    """

    def __init__(self, manifest: Manifest, tensors: Sequence[torch.Tensor],
                 compact: torch.Tensor | None = None):
        check_manifest(manifest)
        if len(tensors) != len(manifest.tensors):
            raise LayoutError(
                f"layout has {len(manifest.tensors)} tensors, got {len(tensors)}"
            )
        for spec, t in zip(manifest.tensors, tensors, strict=True):
            _check_tensor(spec, t)
        self.manifest = manifest
        self.layout_id = layout_id(manifest)
        self.tensors = list(tensors)
        self.items = plan_items(manifest)
        device = tensors[0].device if tensors else torch.device("cpu")
        self.compact: torch.Tensor | None = None
        self.item_bytes: list[torch.Tensor] = []
        for item in self.items:
            if item.kind == "compact":
                if compact is None:
                    compact = torch.zeros(item.nbytes, dtype=torch.uint8, device=device)
                self.compact = compact
                self.item_bytes.append(compact)
            else:
                self.item_bytes.append(as_bytes(self.tensors[item.tensors[0]]))
        self._slots = self._all_slots()

    @classmethod
    def allocate(cls, manifest: Manifest, device: str | torch.device = "cpu",
                 bounded: bool = True) -> BoundLayout:
        """Fresh tensors for a manifest (a publisher's snapshot; a worker that joins with no
        weights of its own), all views of one zero-filled buffer.

        Small tensors are views into the compact region, so a read of that one region
        lands every small tensor in place: no scatter copy at all. On CPU the buffer is
        shared memory (`core.shared_memory`), which same-host readers map and memcpy.
        `bounded`: refuse a manifest larger than the memory free here (one that another
        party sent; a trainer's snapshot of its own tensors is not checked)."""
        total = arena_bytes(manifest)
        if bounded:
            check_allocatable(total, torch.device(device))
        if torch.device(device).type == "cpu":
            arena = shared_empty(total)
        else:
            arena = torch.zeros(total, dtype=torch.uint8, device=device)
        return cls.over(manifest, arena)

    @classmethod
    def over(cls, manifest: Manifest, arena: torch.Tensor) -> BoundLayout:
        """The tensors of `manifest` as views of `arena` (`arena_bytes(manifest)` bytes),
        laid out as `allocate` lays them: another process that maps an allocated arena
        (the ranks of one engine sharing its copy) sees the same tensors."""
        items = plan_items(manifest)
        offsets, total = [], 0
        for item in items:
            offsets.append(total)
            total += -(-item.nbytes // ALIGN) * ALIGN
        device = arena.device
        tensors: list[torch.Tensor | None] = [None] * len(manifest.tensors)
        compact = None
        for item, start in zip(items, offsets, strict=True):
            region = arena[start : start + item.nbytes]
            if item.kind == "compact":
                compact = region
            for idx, off in zip(item.tensors, item.offsets, strict=True):
                s = manifest.tensors[idx]
                if s.nbytes:
                    view = region[off : off + s.nbytes].view(torch_dtype(s.dtype))
                    tensors[idx] = view.view(s.shape)
        for idx, s in enumerate(manifest.tensors):  # empty tensors own no bytes of the buffer
            if tensors[idx] is None:
                tensors[idx] = torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device)
        return cls(manifest, tensors, compact=compact)

    def move_small_into_region(self) -> int:
        """Make our small tensors views into the compact region, keeping their values and
        the tensor objects themselves (`Tensor.set_`, so a module's parameters and every
        holder of these tensors see the new storage); from then on `pack` and `scatter`
        have nothing to copy. Returns how many tensors moved.

        Only a tensor that is the sole owner of its whole storage moves: a view into a
        larger buffer (a fused parameter, a flat buffer) keeps its place and keeps being
        copied, since the buffer's other views would not follow. Views taken of a moved
        tensor *before* the move, and addresses captured earlier (CUDA graphs, registered
        memory), still point at the old storage: call this before any of those exist."""
        if self.compact is None:
            return 0
        self.pack()
        storage = self.compact.untyped_storage()
        base = self.compact.storage_offset() * self.compact.element_size()
        moved = 0
        with torch.no_grad():
            for idx, off, n in self._outside(self.tensors):
                t = self.tensors[idx]
                size = t.element_size()
                if t._base is not None or t.storage_offset() != 0 \
                        or t.untyped_storage().nbytes() != n \
                        or t.device != self.compact.device or (base + off) % size:
                    continue
                t.set_(storage, (base + off) // size, t.shape, t.stride())
                moved += 1
        return moved

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.manifest.tensors, self.tensors, strict=True)]

    def _all_slots(self) -> list[tuple[int, int, int]]:
        """(tensor index, offset in the compact region, nbytes) for every small tensor."""
        return [
            (idx, off, self.manifest.tensors[idx].nbytes)
            for item in self.items if item.kind == "compact"
            for idx, off in zip(item.tensors, item.offsets, strict=True)
        ]

    def _outside(self, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
        """Slots whose tensor lives outside the compact region (the rest need no copy)."""
        assert self.compact is not None
        base = self.compact.data_ptr()
        return [(i, off, n) for i, off, n in self._slots
                if n and tensors[i].data_ptr() != base + off]

    def pack(self, sources: Sequence[torch.Tensor] | None = None) -> None:
        """Copy the small tensors (ours, or `sources` in manifest order) into the compact region."""
        if self.compact is None:
            return
        src = self.tensors if sources is None else sources
        if self.compact.device.type == "cpu":
            # memoryview slice assignment: ~10x faster than hundreds of tiny torch copies.
            region = memoryview(self.compact.numpy())
            for idx, off, n in self._outside(src):
                region[off : off + n] = memoryview(as_bytes(src[idx]).numpy())
        else:
            for idx, off, n in self._outside(src):
                self.compact[off : off + n].copy_(as_bytes(src[idx]))

    def scatter(self) -> None:
        """Copy the compact region back into the small tensors that live outside it, after a
        read (none when they are all views into it)."""
        if self.compact is None:
            return
        if self.compact.device.type == "cpu":
            region = memoryview(self.compact.numpy())
            for idx, off, n in self._outside(self.tensors):
                memoryview(as_bytes(self.tensors[idx]).numpy())[:] = region[off : off + n]
        else:
            for idx, off, n in self._outside(self.tensors):
                as_bytes(self.tensors[idx]).copy_(self.compact[off : off + n])

    def copy_large_from(self, sources: Sequence[torch.Tensor]) -> None:
        for item in self.items:
            if item.kind == "tensor":
                i = item.tensors[0]
                self.tensors[i].copy_(sources[i])

    def checksums(self) -> list[str]:
        return [checksum(b) for b in self.item_bytes]

    def memory(self) -> list[MemoryDesc]:
        return [describe(b) for b in self.item_bytes]


def _check_tensor(spec: TensorSpec, t: torch.Tensor) -> None:
    if dtype_name(t.dtype) != spec.dtype or list(t.shape) != spec.shape:
        raise LayoutError(
            f"tensor {spec.name!r} is {dtype_name(t.dtype)}{list(t.shape)}, "
            f"the layout says {spec.dtype}{spec.shape}"
        )
    if not t.is_contiguous():
        raise LayoutError(f"tensor {spec.name!r} is not contiguous")
