"""What tells two layouts apart, tensor by tensor: the answer a reader gets when its own
tensors do not match the layout a version is published in.

A layout id is a hash, so two ids that differ say nothing of why. The reader has its own
manifest and asks the coordinator for the published one (it keeps every version's manifest),
and this module says, within a few lines, which names are missing or extra, which tensors
differ in dtype, shape or row slice, whether only the order differs (it matters: the order
fixes where each byte lies), and whether the compaction threshold differs.
"""

from __future__ import annotations

from tensorhub.core.data_types import Manifest, TensorSpec

SHOWN = 5  # names or tensors listed per kind of difference; the rest are counted


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    more = len(names) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _spec_text(spec: TensorSpec) -> str:
    piece = ""
    if spec.piece is not None:
        dim, start, stop, total = spec.piece
        piece = f" {('rows', 'columns')[dim]} {start}:{stop} of {total}"
    return f"{spec.dtype}{list(spec.shape)}{piece}"


def layout_difference(ours: Manifest, published: Manifest) -> list[str]:
    """One line per kind of difference between a reader's manifest and the published one;
    empty when they are the same."""
    mine = {s.name: s for s in ours.tensors}
    theirs = {s.name: s for s in published.tensors}
    lines = []
    missing = [n for n in theirs if n not in mine]
    extra = [n for n in mine if n not in theirs]
    if missing:
        lines.append(f"missing here ({len(missing)}, published but not among this reader's "
                     f"tensors): {_listed(missing)}")
    if extra:
        lines.append(f"extra here ({len(extra)}, not in the published version): "
                     f"{_listed(extra)}")
    differing = [n for n in theirs if n in mine
                 and (mine[n].dtype, mine[n].shape, mine[n].piece)
                 != (theirs[n].dtype, theirs[n].shape, theirs[n].piece)]
    if differing:
        shown = "; ".join(f"{n!r} is {_spec_text(mine[n])} here, {_spec_text(theirs[n])} "
                          f"published" for n in differing[:SHOWN])
        more = len(differing) - SHOWN
        lines.append(f"differing ({len(differing)}): {shown}"
                     + (f"; and {more} more" if more > 0 else ""))
    if not (missing or extra or differing):
        order_mine = [s.name for s in ours.tensors]
        order_theirs = [s.name for s in published.tensors]
        if order_mine != order_theirs:
            at = next(i for i, (a, b) in enumerate(zip(order_mine, order_theirs, strict=True))
                      if a != b)
            lines.append(f"the same tensors in another order (first at position {at}: "
                         f"{order_mine[at]!r} here, {order_theirs[at]!r} published); the "
                         f"order matters, as it fixes where each byte lies: give the tensors "
                         f"in the publisher's order")
    if ours.compact_threshold != published.compact_threshold:
        lines.append(f"compaction threshold {ours.compact_threshold} here, "
                     f"{published.compact_threshold} published: pass "
                     f"compact_threshold={published.compact_threshold}")
    return lines


def explain_mismatch(model: str, version: int, ours: Manifest, published: Manifest,
                     our_id: str, published_id: str) -> str:
    """The whole message: which layouts, how they differ, and what to do."""
    lines = layout_difference(ours, published) or ["no difference in names, dtypes, shapes, "
                                                   "order or threshold was found"]
    return (f"{model!r} v{version} is published in layout {published_id}, this reader's "
            f"tensors make layout {our_id}:\n  " + "\n  ".join(lines)
            + "\ngive the replica tensors named, typed, shaped and ordered as the "
              "publisher's (or none: it then allocates them from the published layout)")
