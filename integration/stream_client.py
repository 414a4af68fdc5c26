"""Clients that stream greedy completions from an engine back to back, as rollout workers
do, and keep when each token arrived and what each answer said.

What an update costs the engine's users is read from them: the longest gap between two
tokens a client received across a swap, against the gaps of a quiet stretch; requests that
failed or were aborted; and, per answer, which version produced which tokens (the
`weight_versions` spans on its last chunk). Engine-neutral (`/v1/completions` with token-id
prompts and `return_token_ids`); kept free of pytest: the benchmarks use it too.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass
class Answer:
    prompt: list[int]
    started: float  # time.perf_counter(), as every time here
    client: int = 0  # which of the clients sent it
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # one per token received
    finish_reason: str | None = None
    spans: list[dict] | None = None  # weight_versions
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")


def stream_one(url: str, model: str, prompt: Sequence[int], max_tokens: int,
               client: int = 0, timeout: float = 300.0,
               first_token: threading.Event | None = None) -> Answer:
    """One streamed greedy completion of `prompt` (`first_token` is set once a token
    arrived)."""
    parsed = urlparse(url)
    answer = Answer(prompt=list(prompt), started=time.perf_counter(), client=client)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "return_token_ids": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            answer.error = f"HTTP {r.status}: {r.read()[:500]!r}"
            return answer
        while line := r.readline():
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk or chunk.get("object") == "error":
                answer.error = json.dumps(chunk)[:500]
                break
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                now = time.perf_counter()
                answer.times.extend([now] * len(ids))
                answer.token_ids.extend(ids)
                if ids and first_token is not None:
                    first_token.set()
                if choice.get("finish_reason"):
                    answer.finish_reason = choice["finish_reason"]
                if choice.get("weight_versions") is not None:
                    answer.spans = choice["weight_versions"]
    except (OSError, ValueError, http.client.HTTPException) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if answer.error is None and answer.finish_reason not in ("length", "stop"):
        answer.error = f"finished with {answer.finish_reason!r}"
    return answer


class StreamingClients:
    """`clients` threads, each streaming `max_tokens`-token greedy completions of `prompts`
    (round robin) from `url` back to back, from `start()` (or `with`) until `stop()`."""

    def __init__(self, url: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                 clients: int = 1, model: str = "default"):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.prompts = [list(p) for p in prompts]
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"stream-client-{i}") for i in range(clients)]

    def start(self) -> StreamingClients:
        for t in self._threads:
            t.start()
        return self

    __enter__ = start

    def stop(self, timeout: float = 300.0) -> list[Answer]:
        """Stop after the answers in flight; every answer, in the order they started."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"a client's last request to {self.url} did not end "
                                   f"within {timeout:.0f} s")
        return sorted(self.answers, key=lambda a: a.started)

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            answer = stream_one(self.url, self.model, self.prompts[k % len(self.prompts)],
                                self.max_tokens, client=i)
            with self._lock:
                self.answers.append(answer)
            k += len(self._threads)

    # ------------------------------------------------------------------ what they saw
    def _pairs(self, start: float, end: float, within: bool | None = None
               ) -> list[tuple[float, float]]:
        """(earlier, later) arrival of consecutive tokens one client received (across its
        answers back to back: a new answer's first token counts its wait from the last
        one), for the pairs whose gap overlaps [start, end] (`time.perf_counter()`): a swap
        with no token inside it still shows as the gap around it. `within=True` keeps the
        pairs inside one answer (what a request in flight felt), `within=False` only the
        waits for an answer's first token (what a new request felt, its prefill included)."""
        with self._lock:
            answers = list(self.answers)
        out = []
        for client in range(len(self._threads)):
            marked = [(t, i == 0) for a in sorted((a for a in answers if a.client == client),
                                                 key=lambda a: a.started)
                      for i, t in enumerate(a.times)]
            out += [(a, b) for (a, _), (b, first) in itertools.pairwise(marked)
                    if a <= end and b >= start and (within is None or within != first)]
        return out

    def gaps(self, start: float, end: float, within: bool | None = None) -> list[float]:
        return [b - a for a, b in self._pairs(start, end, within)]

    def worst_gap(self, start: float, end: float) -> float:
        return max(self.gaps(start, end), default=0.0)

    def worst_gap_at(self, start: float, end: float) -> tuple[float, float]:
        """(when the worst gap overlapping [start, end] began, when it ended)."""
        return max(self._pairs(start, end), key=lambda p: p[1] - p[0], default=(start, start))

    def failed(self) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if not a.ok]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
