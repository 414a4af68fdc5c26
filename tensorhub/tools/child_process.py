"""A child process of the `tensorhub demo` (and of the tests and benchmarks that start
TensorHub's own commands): started in its own process group, read line by line, always
stopped by PID (SIGTERM, then SIGKILL) with a bounded wait."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO


class ChildProcess:
    """A child in its own process group (a session), so stopping it stops everything it
    started. With ``stdout=PIPE`` (the default) its stdout is read line by line into
    `lines`; its stderr goes to `log_path` if given, else to ``stderr``. With
    ``stdin=PIPE`` it is told things line by line (`send_line`).

    ``popen`` starts it: `subprocess.Popen` by default; another launcher with the same
    signature (`tensorhub_testing.cluster.Host` passes one) starts it elsewhere, e.g. on an
    emulated host, and the handle works the same."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None,
                 name: str = "child", log_path: str | None = None, *,
                 cwd: str | None = None, stdout: int | IO | None = subprocess.PIPE,
                 stderr: int | IO | None = subprocess.DEVNULL,
                 stdin: int | IO | None = None,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        self.name = name
        self.lines: queue.Queue[str] = queue.Queue()
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in stop
        self.proc = popen(
            list(argv), stdin=stdin, stdout=stdout, stderr=self._log or stderr, cwd=cwd,
            env={**os.environ, **(env or {})}, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        if stdout == subprocess.PIPE:
            self._reader.start()

    @classmethod
    def tensorhub(cls, *args: str, **kw) -> ChildProcess:
        return cls([sys.executable, "-m", "tensorhub.tools.cli", *args], **kw)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no output within {timeout:.0f}s "
                               f"(exit code {self.proc.poll()})") from None

    def next_json(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.01, deadline - time.monotonic()))
            if line.startswith("{"):
                return json.loads(line)

    def send_line(self, text: str) -> None:
        """Write one line to its stdin (started with ``stdin=PIPE``)."""
        assert self.proc.stdin is not None, f"{self.name}: started without stdin=PIPE"
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once it has exited (negative: killed by that signal)."""
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for failure tests)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log:
            self._log.close()
        return self.proc.returncode
