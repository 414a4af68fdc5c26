"""One engine server process tree, started from tests (core venv side) and always stopped.

vLLM and SGLang run in their own venvs (each pins its own torch), so a server is a
subprocess of that venv's python. It gets its own process group (`start_new_session`), and
`stop()` signals the whole group by the leader's PID, so the engine's child processes die
with it and nothing is ever matched by name. Engine specifics (arguments, environment,
how to ask for greedy tokens) live in `vllm_server.py` and `sglang_server.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tensorhub.core.net import free_port

PORT_RETRIES = 3  # fresh ports tried when a server's HTTP port was taken during startup
SLOW_AFTER = 20.0  # seconds after which a request still unanswered has the stacks taken


class EngineServer:
    kind = "engine"

    def __init__(self, args: Sequence[str], env: Mapping[str, str], port: int,
                 log_path: str | Path | None):
        self.args = list(args)
        self.env = dict(env)
        # A temp folder of its own, removed when it stops: the engines leave IPC sockets and
        # store folders in their temp folder at every start.
        self._tmpdir = None
        if "TMPDIR" not in self.env:
            self._tmpdir = self.env["TMPDIR"] = os.path.join(
                tempfile.gettempdir(), f"tensorhub-{self.kind}-{port}-{os.getpid()}")
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path) if log_path else \
            Path(f"/tmp/{self.kind}-server-{port}.log")
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.host = None  # an emulated host (tensorhub_testing.cluster.Host) to run on

    def on(self, host) -> EngineServer:
        """Run on an emulated host: started there, and reached through its network (so
        `url`, on the host's loopback, stays as it is)."""
        self.host = host
        return self

    def _network(self):
        return self.host.network() if self.host is not None else contextlib.nullcontext()

    # -- lifecycle -------------------------------------------------------------------
    def launch(self) -> EngineServer:
        """Start the process without waiting (start several, then `wait_healthy` each)."""
        if self._tmpdir is not None:
            os.makedirs(self._tmpdir, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        self._log_start = self._log.tell()  # where this launch's output begins
        popen = self.host.spawn if self.host is not None else subprocess.Popen
        self.proc = popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def start(self, timeout: float = 240.0) -> EngineServer:
        """Launch the server and block until `/health` answers 200 (or raise)."""
        self.launch()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with self._network(), urllib.request.urlopen(self.url + "/health",
                                                         timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_healthy(self, timeout: float) -> None:
        """Block until `/health` answers. A server that lost its HTTP port to another
        process between `free_port` and its own bind (the engine's internal listeners pick
        ports too) is started again on a fresh port, up to `PORT_RETRIES` times."""
        deadline = time.monotonic() + timeout
        retries = PORT_RETRIES
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                if retries and self._lost_port():
                    retries -= 1
                    self._move_to(free_port())
                    continue
                raise RuntimeError(
                    f"{self.kind} exited with {self.proc.returncode} during startup; "
                    f"log tail:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.kind} not healthy after {timeout}s; log tail:\n"
                           f"{self.log_tail()}")

    def launch_output(self) -> str:
        """What the last launch has written to its log ("" before any, or unreadable)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_start", 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _lost_port(self) -> bool:
        """Whether the last launch exited because its port was taken."""
        return "address already in use" in self.launch_output().lower()

    def _move_to(self, port: int) -> None:
        """Launch again on `port` (the `--port` argument and `url` follow)."""
        old = self.port
        print(f"{self.kind}: port {old} was taken during startup; starting again on {port}",
              file=sys.stderr)
        self.stop()  # what the failed launch left of its process group
        self.args[self.args.index("--port") + 1] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.launch()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group (by the leader's PID), SIGKILL if it lingers,
        then wait until the whole group is gone so the next test starts clean."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            except ProcessLookupError:
                pass
        if proc is not None:
            deadline = time.monotonic() + 10
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                while time.monotonic() < deadline:
                    os.killpg(proc.pid, 0)  # raises ProcessLookupError once all are gone
                    time.sleep(0.1)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------
    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def request(self, path: str, payload: dict | None = None, timeout: float = 120.0,
                method: str | None = None, headers: Mapping[str, str] | None = None):
        """JSON request (POST when `payload` is given). Returns parsed JSON, or the text if
        the body is not JSON. Raises `urllib.error.HTTPError` on 4xx/5xx."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method or ("POST" if data else "GET"),
            headers={"Content-Type": "application/json", **(headers or {})})
        # A request still unanswered after SLOW_AFTER: where the server's threads are then,
        # while it is stuck (at the timeout it may be stuck no longer).
        early: list[str] = []
        watch = threading.Timer(SLOW_AFTER, lambda: early.append(self.stacks()))
        watch.daemon = True
        if timeout > 2 * SLOW_AFTER:
            watch.start()
        try:
            with self._network(), urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
        except TimeoutError as exc:
            watch.cancel()
            raise TimeoutError(
                f"{self.kind} at {self.url} did not answer {path} within {timeout} s; where "
                f"its threads were {SLOW_AFTER:.0f} s in:\n{''.join(early) or '<not taken>'}\n"
                f"and at the timeout:\n{self.stacks()}") from exc
        finally:
            watch.cancel()
        if early:
            print(f"{self.kind} at {self.url} answered {path} after more than {SLOW_AFTER:.0f}"
                  f" s; where its threads were then:\n{early[0]}", file=sys.stderr)
        if not body:
            return {}
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def stacks(self) -> str:
        """The threads of each process in this server's group that were doing something or
        were in our code (py-spy, with native frames): what a server that stopped answering
        was blocked on. CI keeps no files, so this goes into the error itself."""
        spy = _py_spy(self.args[0])
        if spy is None or self.proc is None:
            return "<py-spy not found: no stacks>"
        out = []
        for pid in _group(self.proc.pid):
            try:
                done = subprocess.run([spy, "dump", "--native", "--pid", str(pid)],
                                      capture_output=True, text=True, timeout=30)
                dump = done.stdout or f"<py-spy on {pid}: exit {done.returncode}: {done.stderr}>"
            except (OSError, subprocess.TimeoutExpired) as exc:
                # (py-spy cannot stop a thread that sleeps in the kernel: say where each is)
                dump = f"<py-spy failed: {exc}>\n{_kernel_threads(pid)}"
            out.append(_busy_threads(dump))
        return "\n".join(out)

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        raise NotImplementedError

    def tensorhub_status(self) -> dict:
        """`GET /tensorhub/status`, which both engine plugins serve on the engine's own port
        (with the server's TENSORHUB_TOKEN or TENSORHUB_HTTP_TOKEN, if it has one: without,
        the route answers callers on the engine's own host only)."""
        token = self.env.get("TENSORHUB_TOKEN") or self.env.get("TENSORHUB_HTTP_TOKEN")
        return self.request("/tensorhub/status", timeout=10,
                            headers={"Authorization": f"Bearer {token}"} if token else None)

    def status_now(self) -> dict:
        """`/tensorhub/status`, or ``{"error": ...}`` while the engine does not answer (not
        listening yet, or busy); an error the route answers with is raised."""
        try:
            return self.tensorhub_status()
        except urllib.error.HTTPError:
            raise  # the route answered: an error is an answer, not a delay
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            return {"error": str(exc)}

    def wait_serving(self, version: int, timeout: float = 120.0, interval: float = 0.2) -> dict:
        """Poll `/tensorhub/status` until the engine serves `version`; return the status.
        The one wait for every engine kind (tests, demo, benches)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status_now()
            if status.get("serving_version") == version:
                return status
            if time.monotonic() > deadline or not self.alive():
                raise TimeoutError(f"{self.kind} at {self.url} serves "
                                   f"v{status.get('serving_version')}, not v{version} after "
                                   f"{timeout}s: {status}\n{self.log_tail()}")
            time.sleep(interval)


def _py_spy(engine_python: str) -> str | None:
    """py-spy from this venv, the engine's, or a sibling venv (SGLang's pins it)."""
    here = [Path(sys.executable).parent, Path(engine_python).parent]
    venvs = Path(engine_python).parent.parent.parent
    candidates = [d / "py-spy" for d in here] + sorted(venvs.glob("*/bin/py-spy"))
    found = [str(c) for c in candidates if c.exists()] + [shutil.which("py-spy") or ""]
    return next((c for c in found if c), None)


def _group(leader: int) -> list[int]:
    """The processes of the group `leader` started (`start_new_session`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == leader:  # fields after the name: state, ppid, pgrp
                pids.append(int(entry.name))
    return sorted(pids)


def _kernel_threads(pid: int) -> str:
    """Each thread of `pid` as the kernel sees it: name, state (D: uninterruptible), the
    kernel function it waits in, and its kernel stack where readable (root)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip()
        except OSError:
            continue
        try:
            stack = " < ".join(line.split(" ", 1)[-1].split("+")[0]
                               for line in (task / "stack").read_text().splitlines()[:8])
        except OSError:
            stack = "?"
        lines.append(f"  thread {task.name} {name!r} state {state} wchan {wchan} [{stack}]")
    return "\n".join(lines) or f"  <no /proc/{pid}/task>"


def _busy_threads(dump: str) -> str:
    """A py-spy dump without its idle threads that are outside our code."""
    head, *threads = dump.split("\nThread ")
    keep = [t for t in threads if "(idle)" not in t.split("\n", 1)[0]
            or "tensorhub" in t or "nixl" in t]
    return "\n".join([head] + ["Thread " + t for t in keep])


def base_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # torch sets this in the test process the first time its compiler's cache is asked
    # for (`/tmp/torchinductor_<user>`): an engine that inherited it would compile into
    # that shared folder, never removed, instead of its own temp folder.
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env
