"""The prefix-cache salt that keeps KV computed with one set of weights from serving a
request that arrived under another.

In pause mode `keep_kv` an engine's prefix cache is not flushed at a swap: requests in
flight keep the KV they computed with the old weights, so the pause is the install alone. A
prompt cached before the swap must still never serve a request that arrives after it. Both
engines hash a per-request salt into their prefix cache (vLLM's and SGLang's `cache_salt`),
so each request is salted with the swap epoch it arrived in (`SwapController.epoch`, which
moves on once generation is paused for a swap): blocks salted with one epoch were computed
by requests that arrived in it, and no request shares a cached block with another epoch's.
A salt the client set is kept, in front of ours.

Blocks salted with an epoch were computed by requests that arrived in it, and those ran on
that epoch's weights, except a request that was queued or running when the next swap paused
the engine: it goes on with the new weights and the KV it has, which is what `keep_kv` is.
The epoch is counted by one front end; a random part per process keeps two engines, or one
engine restarted, from naming different weights alike in a KV store they share."""

from __future__ import annotations

import secrets

PREFIX = "tensorhub-"
_PROCESS = secrets.token_hex(4)


def salted(client_salt: str | None, epoch: int) -> str:
    """The salt a request arriving in swap `epoch` gets, the client's own in front."""
    ours = f"{PREFIX}{_PROCESS}-{epoch}"
    return f"{client_salt}|{ours}" if client_salt else ours
