"""Read grants: the coordinator's word that a reader may read a holder, which the holder
checks before it serves a byte (the zmq fallback; NIXL/UCX cannot ask, see the README's
Security section).

Each holder makes a random key and gives it to the coordinator when it registers (over the
control plane, which only token holders reach). A plan, a standby placement or an
announcement names its sources with a grant made under each source's key for the reader it
was made for (`*` in announcements, which every token holder hears): `reader.mac`. A holder
serves a request only if its grant is one of its own key's. Whoever never saw a plan (no
token) has no grant; a grant says nothing of which bytes, so leases still decide what is
read when.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

ANY_READER = "*"  # a grant in an announcement: for every token holder
KEY_HEX = 64  # a grant's key: 32 random bytes as hex


def new_key() -> str:
    return secrets.token_hex(KEY_HEX // 2)


def _mac(key: str, reader: str) -> str:
    return hmac.new(bytes.fromhex(key), reader.encode(), hashlib.sha256).hexdigest()[:32]


def issue(key: str | None, reader: str) -> str | None:
    """A grant to read the holder whose key is `key` (None: a holder that asks for none)."""
    return f"{reader}.{_mac(key, reader)}" if key else None


def valid(key: str, grant: str | None) -> bool:
    """Whether `grant` was issued under `key`."""
    if not grant or "." not in grant:
        return False
    reader, mac = grant.rsplit(".", 1)
    return hmac.compare_digest(mac, _mac(key, reader))
