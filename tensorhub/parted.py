"""A reader of sharded versions: one `Replica` per part, one version for all of them.

A version published by K trainer ranks (`Publisher(part=r, parts=K)`) is K ordinary
layouts. `PartedReplica` pulls each part with a replica of its own (its own place in that
part's relay forest, so each part fans out as any version does) and calls the version
its own only once every part is pulled and verified: a reader never serves or exposes a
mix of two versions' parts. Row slices of one tensor, spread over parts, are joined.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from tensorhub.core.data_types import GetManifest, Part
from tensorhub.replica import Replica


class PartedReplica:
    def __init__(self, coordinator: str, model: str, *, name: str = "replica",
                 transport: str | None = None, token: str | None = None,
                 timeout: float = 10.0, labels: dict[str, str] | None = None,
                 chunked: bool = True):
        """Pulls any version of `model`, sharded (K parts) or not (one part). Each part
        has a worker of its own, named `<name>.part<r>`."""
        self.coordinator, self.model, self.name = coordinator, model, name
        self._kw = {"transport": transport, "token": token, "timeout": timeout,
                    "labels": labels, "chunked": chunked}
        self.replicas: list[Replica] = [self._replica(0)]
        self.version: int | None = None

    def _replica(self, part: int) -> Replica:
        return Replica(self.coordinator, self.model, name=f"{self.name}.part{part}",
                       part=part, **self._kw)

    def pull(self, version: int | str = "latest", timeout: float = 60.0) -> int:
        """Pull every part of `version` (or the latest) at once; return the version. If a
        part fails, the error is raised and `version` is None: no complete version."""
        reply = self.replicas[0].session.call(GetManifest(model=self.model, version=version))
        target, parts = reply.version, reply.parts
        while len(self.replicas) < parts:
            self.replicas.append(self._replica(len(self.replicas)))
        for r, replica in enumerate(self.replicas):  # (what their `Hold`s tell a restart)
            replica.part = Part(part=r, parts=parts)
        if len(self.replicas) > parts:
            raise ValueError(f"{self.model} v{target} has {parts} part(s); this reader pulled "
                             f"{len(self.replicas)} before: start a new PartedReplica")
        if self.version == target:
            return target
        self.version = None
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            futures = [pool.submit(r.pull, target, timeout) for r in self.replicas]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        self.version = target
        return target

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version, whole: a tensor published as row slices by several
        ranks is joined here (a copy); the others are views of the pulled buffers."""
        whole: dict[str, torch.Tensor] = {}
        slices: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for replica in self.replicas:
            specs = {s.name: s for s in replica.layout.manifest.tensors} if replica.layout else {}
            for name, tensor in replica.tensors.items():
                rows = specs[name].rows
                if rows is None:
                    whole[name] = tensor
                else:
                    slices.setdefault(name, []).append((rows[0], tensor))
        for name, pieces in slices.items():
            whole[name] = torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])])
        return whole

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> PartedReplica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
