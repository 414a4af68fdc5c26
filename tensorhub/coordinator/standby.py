"""Readers placed ahead: the forest of a model's first version, grown before it exists.

With no version yet, every reader of a fleet would send its first plan request when the
first version is announced, and they all wait in the one coordinator's queue: its time
per first plan, times the fleet, lands on the version's critical path (4096 readers:
longer than the data takes). So a reader whose buffers are ready stands by (`StandBy`):
it is placed now in a *standing forest* of (model, layout), under a placeholder root,
`PUBLISHER`, for whoever publishes, and told its parents (`Placement`). When a version is
published in that layout with no earlier version's forest to grow from, its forest adopts
the standing one as it would the last version's (`Forest.adopt`): every reader on standby
pulls at once from the parents it was told, and confirms while it reads, as a steady fleet
does. The publisher's endpoint and regions come with the announcement.

A reader with no buffers of its own (an engine's checkpoint copy, allocated from the
version's manifest) can stand by too if the trainer declared that manifest ahead
(`Declare`): it allocates from the declaration and stands by like the rest.

The standing forest is soft state, like every record here: lost with a restart (readers
then ask as usual), and a reader that leaves is taken out (its children get new parents
when they confirm). No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorhub.coordinator.forest import Forest
from tensorhub.core.data_types import PUBLISHER, Manifest
from tensorhub.core.layout import layout_id


@dataclass
class Standing:
    """One (model, layout)'s standing forest, and what it knows of its readers."""

    forest: Forest
    sizes: tuple[int, ...]  # the layout's item sizes (every reader's regions have these)
    memory: dict[str, tuple] = field(default_factory=dict)  # reader -> its stored regions


class StandingForests:
    def __init__(self, stripes: int, fanout: int, grace: float):
        self.stripes, self.fanout, self.grace = stripes, fanout, grace
        self._by_key: dict[tuple[str, str], Standing] = {}
        # model -> the manifest declared for its first version, and that layout's id
        self._declared: dict[str, tuple[Manifest, str]] = {}
        self._declarers: dict[str, str] = {}  # model -> the worker that declared it

    def declare(self, model: str, manifest: Manifest, by: str = "") -> None:
        self._declared[model] = (manifest, layout_id(manifest))
        self._declarers[model] = by

    def declared_models(self) -> list[str]:
        return list(self._declared)

    def declared_by(self, model: str) -> str | None:
        return self._declarers.get(model) if model in self._declared else None

    def declared(self, model: str) -> tuple[Manifest, str] | None:
        return self._declared.get(model)

    def get(self, model: str, layout_id: str) -> Standing | None:
        return self._by_key.get((model, layout_id))

    def place(self, model: str, layout_id: str, worker_id: str, dc: str,
              sizes: tuple[int, ...], memory: tuple, expected: int, now: float,
              publisher_dc: Callable[[], str]) -> list[str | None]:
        """Place a reader (again: its parents so far, pending stripes filled if they can
        be), with `memory` its regions; `publisher_dc`: where the publisher is expected
        (the placeholder root's datacenter, so its readers there need no gateway), asked
        only when the forest is new."""
        standing = self._by_key.get((model, layout_id))
        if standing is None:
            # (no version yet, so no reader is kept waiting by a leaf's wait for the
            # interior readers to come: it waits up to `grace` whenever they are owed)
            forest = Forest(self.stripes, self.fanout, self.grace, settle=math.inf)
            forest.publisher = PUBLISHER
            forest.add_root(PUBLISHER, publisher_dc(), reader=False)
            standing = self._by_key[(model, layout_id)] = Standing(forest, sizes)
        elif sizes != standing.sizes:
            raise ValueError(f"regions of {len(sizes)} items ({sum(sizes)} bytes) do not fit "
                             f"layout {layout_id}, whose readers on standby have "
                             f"{len(standing.sizes)} items ({sum(standing.sizes)} bytes)")
        standing.memory[worker_id] = memory
        parents = standing.forest.join(worker_id, dc, expected, now)
        for s, parent in enumerate(parents):  # a parent that left since: another one
            if parent is not None and parent != PUBLISHER and parent not in standing.memory:
                parents[s] = standing.forest.replace(worker_id, s, {parent}, now)
        return parents

    def take(self, model: str, layout_id: str, sizes: tuple[int, ...]) -> Forest | None:
        """The standing forest of a version now published in that layout (it is used once:
        later versions grow from this one's forest); None if there is none, or if its
        readers' regions do not fit the published items."""
        standing = self._by_key.pop((model, layout_id), None)
        if standing is None or standing.sizes != sizes:
            return None
        return standing.forest

    def forget(self, worker_id: str) -> None:
        """A reader left: out of every standing forest (its children get another parent
        when they stand by again, or when they confirm)."""
        for key, standing in list(self._by_key.items()):
            if standing.memory.pop(worker_id, None) is not None:
                standing.forest.remove(worker_id)
                if not standing.memory:
                    del self._by_key[key]

    def drop_model(self, model: str) -> None:
        """A version of `model` is out: standing forests of its other layouts (or of a
        sharded first version) will never be taken, and readers allocate from the
        version's manifest, not from a declaration."""
        self._declared.pop(model, None)
        self._declarers.pop(model, None)
        for key in [k for k in self._by_key if k[0] == model]:
            del self._by_key[key]

    def __len__(self) -> int:
        return sum(len(s.memory) for s in self._by_key.values())
