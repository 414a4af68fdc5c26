"""A model belongs to its publisher: the first trainer to publish a model (each part of a
sharded one) binds it, and while it is registered only a publish showing the credential
that first publish returned is taken, and only a registration showing it may state the
model's published versions (`Register.published`). A binding lapses when the worker that
holds it is forgotten (it left, or died): the next publish binds the model anew, and the
old credential, being older, wins it back when its trainer registers again with it (a
resumed job: `Publisher(owners=...)`).

A credential is `part.issued.nonce.mac`: the part it binds, when it was issued (wall-clock
ns), a random nonce, and an HMAC of (model, part, issued, nonce) under the coordinator's
owner key. The key derives
from the coordinator's CURVE secret when it has one (`--curve-secret-file`), else from the
key file `tensorhub coordinator` keeps (`--owner-key-file`, `owner_key.py`): credentials
then verify across coordinator restarts, and a trainer that registers again after a restart
re-binds its models with them; when a token holder published first into that window (it
binds the model anew), the older credential wins. A coordinator with neither (one made in
a process, with no `owner_key_file`) has a key of its own: after a restart the first
publish of a model binds it again.

A model's companions (its patches, its quantized layouts: `companion_of`) are taken only
from the worker that holds the model's binding, so nobody else can publish bytes that the
model's engines would take as its trainer's.

Pure bookkeeping (the key and the wall clock are given): no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorhub.core.patch import PATCH_SUFFIX, is_patch_model
from tensorhub.quant.layouts import model_of


def owner_key(curve_secret: str | None, kept: bytes | None = None) -> tuple[bytes, bool]:
    """The key credentials are made with, and whether it outlives this process: from the
    CURVE secret, else the key kept in a file (`owner_key.py`), else a new one."""
    if curve_secret:
        return hashlib.sha256(b"tensorhub-model-owner\0" + curve_secret.encode()).digest(), True
    if kept:
        return hashlib.sha256(b"tensorhub-model-owner\0" + kept).digest(), True
    return secrets.token_bytes(32), False


@dataclass
class Owners:
    key: bytes
    persistent: bool
    wall_clock: Callable[[], float] = time.time
    # (model, part) -> the credential that binds it
    bound: dict[tuple[str, int], str] = field(default_factory=dict)
    # (model, part) -> the worker that last showed its credential: the binding lapses when
    # that worker is forgotten (a trainer that left or died; its credential, older than any
    # binding made since, wins the model back when it registers again)
    by: dict[tuple[str, int], str] = field(default_factory=dict)

    def _mac(self, model: str, part: int, issued: str, nonce: str) -> str:
        msg = f"{model}\0{part}\0{issued}\0{nonce}".encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()[:32]

    def issue(self, model: str, part: int, worker: str) -> str:
        issued, nonce = f"{int(self.wall_clock() * 1e9):x}", secrets.token_hex(8)
        credential = f"{part}.{issued}.{nonce}.{self._mac(model, part, issued, nonce)}"
        self.bound[(model, part)] = credential
        self.by[(model, part)] = worker
        return credential

    def shown_by(self, model: str, part: int, worker: str) -> None:
        """`worker` showed the credential of (model, part): the binding is kept while it
        is registered."""
        self.by[(model, part)] = worker

    def worker_gone(self, worker: str) -> None:
        for key in [k for k, w in self.by.items() if w == worker]:
            del self.by[key]
            self.bound.pop(key, None)

    def valid(self, model: str, part: int, credential: str | None) -> bool:
        """Whether `credential` was made by this key for (model, part)."""
        if not credential or credential.count(".") != 3:
            return False
        made_for, issued, nonce, mac = credential.split(".")
        return made_for == str(part) and hmac.compare_digest(
            mac, self._mac(model, part, issued, nonce))

    def held_by(self, model: str, worker: str) -> bool:
        """Whether `worker` holds a binding of `model` (of any part)."""
        return any(m == model and w == worker for (m, _), w in self.by.items())

    def owns(self, model: str, part: int, credential: str | None) -> bool:
        """Whether `credential` is the one binding (model, part)."""
        bound = self.bound.get((model, part))
        return bound is not None and credential is not None \
            and hmac.compare_digest(bound.encode(), credential.encode())

    def is_bound(self, model: str, part: int = 0) -> bool:
        return (model, part) in self.bound

    def claim(self, model: str, credential: str | None, worker: str = "") -> bool:
        """A trainer registering (again) shows `credential`: True if it owns the model (the
        part the credential names), binding it again when the credential is valid and no
        younger than the binding there is (one made after a restart, before it came
        back)."""
        part = part_of(credential)
        if part is None or not self.valid(model, part, credential):
            return False
        bound = self.bound.get((model, part))
        if bound is None or _issued(credential) <= _issued(bound):
            self.bound[(model, part)] = credential
            if worker:
                self.by[(model, part)] = worker
            return True
        return False



def companion_of(model: str) -> str | None:
    """The model `model` goes with: its patches (`<m>.patch`) and its quantized layouts
    (`<m>@<recipe>`) are published by `m`'s trainer alone (the engines that take them trust
    them as `m`'s); None for a model of its own."""
    if is_patch_model(model):
        return model.removesuffix(PATCH_SUFFIX)
    return model_of(model)


def part_of(credential: str | None) -> int | None:
    try:
        return int(credential.split(".", 1)[0]) if credential else None
    except ValueError:
        return None


def _issued(credential: str) -> int:
    return int(credential.split(".")[1], 16)
