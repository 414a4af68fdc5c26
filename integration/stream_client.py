"""A client that streams greedy completions from an engine back to back, as a rollout
worker does, and keeps when each token arrived and what each answer said.

What an update costs the engine's users is read from it: the longest gap between two
tokens the client received across a swap, against the gaps of a quiet stretch; requests
that failed or were aborted; and, per answer, which version produced which tokens
(`weight_versions`). Kept free of pytest: the benchmarks use it too.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Answer:
    prompt: list[int]
    started: float
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # one per token received
    finish_reason: str | None = None
    weight_versions: list[dict] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")


class StreamingClient:
    """Streams `/v1/completions` (token-id prompts, temperature 0, `ignore_eos`) from
    `url`, one request after another, until `stop()`."""

    def __init__(self, url: str, model: str, prompts: Sequence[Sequence[int]],
                 max_tokens: int, headers: dict[str, str] | None = None):
        self.url, self.model = url, model
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stream-client")

    def start(self) -> StreamingClient:
        self._thread.start()
        return self

    def stop(self, timeout: float = 120.0) -> list[Answer]:
        """Stop after the answer in flight; the answers, in order."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the client's last request to {self.url} did not end within "
                               f"{timeout:.0f} s")
        return self.answers

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            self.answers.append(self._one(self.prompts[k % len(self.prompts)]))
            k += 1

    def _one(self, prompt: list[int]) -> Answer:
        answer = Answer(prompt=prompt, started=time.perf_counter())
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(body).encode(), headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        answer.error = str(chunk["error"])
                        continue
                    for choice in chunk.get("choices") or ():
                        ids = choice.get("token_ids")
                        got = len(ids) if ids is not None else int(bool(choice.get("text")))
                        now = time.perf_counter()
                        answer.arrivals.extend([now] * got)
                        answer.token_ids.extend(ids or [])
                        if choice.get("finish_reason") is not None:
                            answer.finish_reason = choice["finish_reason"]
                        if choice.get("weight_versions") is not None:
                            answer.weight_versions = choice["weight_versions"]
        except (urllib.error.URLError, OSError, ValueError) as exc:
            answer.error = f"{type(exc).__name__}: {exc}"
        if answer.error is None and answer.finish_reason not in ("length", "stop"):
            answer.error = f"finished with {answer.finish_reason!r}"
        return answer

    # ------------------------------------------------------------------ what it saw
    def arrivals(self) -> list[float]:
        """Every token's arrival, in order (the client's one stream of tokens: a new
        request's first token counts its wait from the one before)."""
        return [t for a in list(self.answers) for t in a.arrivals]

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens whose later token came in [start, end]."""
        times = self.arrivals()
        return [b - a for a, b in itertools.pairwise(times) if start <= b <= end]

    def worst_gap(self, start: float, end: float) -> float:
        return max(self.gaps(start, end), default=0.0)

    def failed(self) -> list[Answer]:
        return [a for a in self.answers if not a.ok]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
