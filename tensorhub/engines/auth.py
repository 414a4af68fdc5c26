"""The bearer-token check of an engine's TensorHub HTTP routes, engine-agnostic so that
every engine plugin asks for the same token the same way: `Authorization: Bearer <token>`
where the token is TENSORHUB_TOKEN (or TENSORHUB_TOKEN_FILE), else TENSORHUB_HTTP_TOKEN;
no token configured, no check (as the vLLM routes)."""

from __future__ import annotations

import hmac
import os

from tensorhub.core.client import token_from_env


def route_token() -> str | None:
    """The token the routes require, or None when none is configured."""
    return token_from_env() or os.environ.get("TENSORHUB_HTTP_TOKEN") or None


def authorized(authorization: str | None) -> bool:
    """Whether an `Authorization` header value opens the routes. Fails closed: a token that
    cannot be read (an unreadable TENSORHUB_TOKEN_FILE) opens nothing."""
    try:
        token = route_token()
    except OSError:
        return False
    if not token:
        return True
    given = (authorization or "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(given.encode(), token.encode())
