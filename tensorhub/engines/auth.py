"""Who may call an engine's TensorHub HTTP routes (pause generation, swap weights, roll
back), engine-agnostic so that every engine plugin asks the same way.

With a token (TENSORHUB_TOKEN or TENSORHUB_TOKEN_FILE, else TENSORHUB_HTTP_TOKEN): any
caller that sends `Authorization: Bearer <token>`. Without one: callers on this host only
(loopback), never the network. Fails closed: a token file that cannot be read opens nothing.
"""

from __future__ import annotations

import hmac

from tensorhub import settings
from tensorhub.core.client import token_from_env
from tensorhub.core.net import is_loopback

REFUSED = ("TensorHub routes need 'Authorization: Bearer <token>' (the value of "
           "TENSORHUB_TOKEN); with no token set they answer callers on this host only")


def route_token() -> str | None:
    """The token the routes require, or None when none is configured."""
    return token_from_env() or settings.HTTP_TOKEN.get() or None


def authorized(authorization: str | None, client_host: str | None) -> bool:
    """Whether a caller at `client_host` sending this `Authorization` value may call."""
    try:
        token = route_token()
    except OSError:
        return False
    if not token:
        return is_loopback(client_host)
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":  # (the scheme is case-insensitive: RFC 9110)
        return False
    given = given.strip()
    return hmac.compare_digest(given.encode(), token.encode())
