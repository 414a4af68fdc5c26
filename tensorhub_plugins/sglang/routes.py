"""`GET /tensorhub/status` on the SGLang server's own HTTP port, as vLLM's plugin has.

SGLang has no plugin hook for HTTP routes, but its FastAPI app is a module-level object
(`sglang.srt.entrypoints.http_server.app`) and SGLang runs the plugin's `register()` in its
main process before the server starts, so a route added to it then is served like SGLang's
own (behind SGLang's own `--api-key` middleware too, when one is set). With
`--tokenizer-worker-num > 1` the HTTP workers re-import the app in processes of their own,
where the route is absent (404).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

# At module level: FastAPI resolves the handler's (string) annotations in these globals.
from fastapi import HTTPException, Request

from tensorhub.engines import REFUSED, authorized

if TYPE_CHECKING:
    from tensorhub_plugins.sglang.driver import Driver

log = logging.getLogger("tensorhub.sglang")
STATUS_ROUTE = "/tensorhub/status"


def add_routes(driver: Driver | None) -> bool:
    """Add the TensorHub routes to SGLang's app; False (logged) when that is not possible.
    Without a driver (TensorHub not configured) the route answers 503, as vLLM's does."""
    try:
        from sglang.srt.entrypoints.http_server import app
    except Exception as exc:
        log.warning("cannot add %s to SGLang's HTTP server: %s", STATUS_ROUTE, exc)
        return False

    def tensorhub_status(request: Request) -> dict:
        """The driver's status (a plain `def`: FastAPI runs it off the event loop)."""
        if driver is None:
            raise HTTPException(503, "TensorHub is not configured on this server "
                                     "(set TENSORHUB_COORDINATOR)")
        # Behind SGLang's `--api-key` middleware, a caller that got here showed that key.
        if not driver.api_key and not authorized(
                request.headers.get("authorization"),
                request.client.host if request.client else None):
            raise HTTPException(401, REFUSED)
        try:
            return driver.status()
        except Exception as exc:  # never a traceback into SGLang's server
            log.warning("TensorHub status: %s", exc)
            raise HTTPException(500, f"TensorHub status failed: {exc}") from None

    try:
        app.add_api_route(STATUS_ROUTE, tensorhub_status, methods=["GET"])
    except Exception as exc:
        log.warning("cannot add %s to SGLang's HTTP server: %s", STATUS_ROUTE, exc)
        return False
    return True
