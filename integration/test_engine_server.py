"""The engine-server harness itself, with a stand-in server (no engine): fast."""

from __future__ import annotations

import sys
import textwrap

import pytest

from integration.engine_server import EngineServer, free_port

# Fails like uvicorn on its first start (its port taken), serves /health on the next.
FLAKY_SERVER = textwrap.dedent("""
    import http.server, os, sys
    port, marker = int(sys.argv[sys.argv.index("--port") + 1]), sys.argv[1]
    if not os.path.exists(marker):
        open(marker, "w").close()
        print(f"ERROR: [Errno 98] error while attempting to bind on address "
              f"('127.0.0.1', {port}): address already in use", flush=True)
        sys.exit(3)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def test_a_server_whose_port_was_taken_during_startup_starts_again_on_another(tmp_path):
    port = free_port()
    server = EngineServer([sys.executable, "-c", FLAKY_SERVER, str(tmp_path / "tried"),
                           "--port", str(port)], {}, port, tmp_path / "server.log")
    try:
        server.start(timeout=30)
        assert server.port != port
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.healthy()
        assert "address already in use" in server.log_path.read_text()
    finally:
        server.stop()
    assert not server.alive()


def test_a_server_that_fails_for_another_reason_is_not_started_again(tmp_path):
    port = free_port()
    server = EngineServer([sys.executable, "-c", "import sys; print('bad model'); sys.exit(2)",
                           "--port", str(port)], {}, port, tmp_path / "server.log")
    with pytest.raises(RuntimeError, match=r"exited with 2 during startup(.|\n)*bad model"):
        server.start(timeout=30)
    assert server.port == port
