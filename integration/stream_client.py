"""A client that streams greedy completions back to back from an engine's OpenAI-compatible
`/v1/completions` (the engine-neutral part of what a user feels of a weight swap).

Each stream records when each chunk arrived, the token ids it carried (SGLang:
`return_token_ids`), how the request ended, and the `weight_versions` spans the answer
carries. Used by the tests (no request may fail or be aborted through swaps) and for the
measurements in docs/sglang.md (worst gap between two tokens vs the quiet p99).
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass
class Answer:
    prompt: list[int]
    started: float
    times: list[float] = field(default_factory=list)  # one per chunk with tokens
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    spans: list[dict] | None = None
    error: str | None = None
    client: int = 0  # which of `StreamingClients` sent it

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival of the earlier token, gap to the next) for each pair of tokens."""
        return [(a, b - a) for a, b in itertools.pairwise(self.times)]


def stream_one(url: str, prompt: list[int], max_tokens: int, timeout: float = 300.0,
               model: str = "default", client: int = 0) -> Answer:
    parsed = urlparse(url)
    answer = Answer(prompt=list(prompt), started=time.time(), client=client)
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
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk or chunk.get("object") == "error":
                answer.error = json.dumps(chunk)[:500]
                break
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids:
                    answer.times.append(time.time())
                    answer.token_ids.extend(ids)
                if choice.get("finish_reason"):
                    answer.finish_reason = choice["finish_reason"]
                if "weight_versions" in choice:
                    answer.spans = choice["weight_versions"]
    except Exception as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return answer


class StreamingClients:
    """`clients` threads, each streaming `max_tokens`-token greedy completions of its
    prompts (round robin) back to back until `stop()`."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int, clients: int = 1):
        self.url = url
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            answer = stream_one(self.url, self.prompts[n % len(self.prompts)],
                                self.max_tokens, client=i)
            with self._lock:
                self.answers.append(answer)
            n += len(self._threads)

    def __enter__(self) -> StreamingClients:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        return list(self.answers)

    def __exit__(self, *exc) -> None:
        self.stop()


def client_gaps(answers: list[Answer]) -> list[tuple[float, float]]:
    """(arrival of a token, gap to the next token the same client received), over each
    client's answers back to back: a gap between two answers (the next one's first token
    after the last one's) counts, as the client feels it."""
    out = []
    for client in sorted({a.client for a in answers}):
        times = [t for a in sorted((a for a in answers if a.client == client),
                                   key=lambda a: a.started) for t in a.times]
        out += [(a, b - a) for a, b in itertools.pairwise(times)]
    return out


def gap_figures(answers: list[Answer], windows: list[tuple[float, float]],
                margin: float = 0.0) -> dict:
    """The worst gap between two tokens a client received that spans a window (a swap:
    (start, end) in `time.time()`), and the p50/p99 of the gaps that touch none."""
    across, quiet = [], []
    for at, gap in client_gaps(answers):
        hit = any(at <= end + margin and at + gap >= start - margin
                  for start, end in windows)
        (across if hit else quiet).append(gap)
    quiet.sort()

    def pct(p: float) -> float | None:
        return quiet[min(len(quiet) - 1, int(p * len(quiet)))] if quiet else None

    return {"worst_across_ms": max(across) * 1e3 if across else None,
            "quiet_p50_ms": (pct(0.5) or 0) * 1e3, "quiet_p99_ms": (pct(0.99) or 0) * 1e3,
            "gaps_across": len(across), "gaps_quiet": len(quiet)}
