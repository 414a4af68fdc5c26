"""The key model credentials are made with, kept in a file so that they outlive a restart.

A model's credential (`owners.py`) is an HMAC under the coordinator's owner key. A key new
in each process would let any token holder bind a model by publishing it first after a
restart; a key kept in a file (mode 600, made at the first start) keeps every trainer's
credential valid across restarts of the coordinator on that machine. A CURVE secret, where
there is one, gives the key instead (it is as secret and as lasting).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def default_owner_key_file() -> Path:
    """Where `tensorhub coordinator` keeps its owner key unless told otherwise."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(state) / "tensorhub" / "coordinator-owner.key"


def load_owner_key(path: str | os.PathLike) -> bytes:
    """The key in `path`, made there first (32 random bytes, hex, mode 600) if it is not."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # (another coordinator made it meanwhile: read theirs)
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"{path} does not hold an owner key (64 hex digits); remove it to "
                         f"make a new one (trainers' saved credentials then no longer count)")
    return key
