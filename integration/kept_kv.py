"""Pause mode `keep_kv` end to end, the same for both engines: requests in flight keep their
KV through a swap, and a prompt cached before the swap is never served to a request after
it. Engine-neutral (`/v1/completions` with token-id prompts; the engine must report cached
prompt tokens: vLLM `--enable-prompt-tokens-details`, SGLang `--enable-cache-report`)."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse

from integration.stream_client import Answer, StreamingClients, stream_one
from integration.tiny_model import hf_greedy
from tensorhub import Publisher


def complete(url: str, model: str, prompt: Sequence[int], max_tokens: int
             ) -> tuple[list[int], int]:
    """One greedy completion: (its token ids, the prompt tokens the engine took from its
    prefix cache)."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "model": model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}),
            {"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 200, body
    [choice] = body["choices"]
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(choice["token_ids"]), int(details.get("cached_tokens") or 0)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    pairs = zip(a, b, strict=False)
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))


def check_keep_kv(engine, address: str, model_dir: Path, old: dict, new: dict,
                  wait_serving: Callable[[int], object], prompts: Sequence[Sequence[int]],
                  tokens: int, freeze_file: Path | None = None,
                  thaw: Callable[[], object] | None = None,
                  preemptions: Callable[[], float] | None = None) -> None:
    """`engine` (started in `keep_kv`, following model "kept-kv" at `address`) is made to
    serve `old`; then `new` is published while clients stream, and:
    - no request failed, and an answer's tokens before the swap equal HF's on `old`;
    - a long prompt answered twice before the swap came from the cache the second time,
      and after the swap is computed again (no token cached before the swap) and gives
      HF's tokens on `new`;
    - with `freeze_file`, `thaw` and `preemptions` (`request_cut_by_a_swap`): a lone
      request cut by one more swap kept its KV."""
    with Publisher(address, "kept-kv", name="kept-kv-trainer") as pub:
        wait_serving(pub.publish(old))
        _through_a_swap(engine.url, engine.model, model_dir, old, new, pub.publish,
                        wait_serving, prompts, tokens)
        if freeze_file is not None and thaw is not None and preemptions is not None:
            dropped, answer = request_cut_by_a_swap(
                engine.url, engine.model, long_prompt(prompts), freeze_file, thaw,
                lambda: wait_serving(pub.publish(old)), preemptions)
            assert dropped == 0, f"the request's KV was dropped by the swap ({answer.spans})"


def long_prompt(prompts: Sequence[Sequence[int]]) -> list[int]:
    """300 tokens: long enough to be cached in blocks, and to tell one lookup from two."""
    return [t for _ in range(40) for t in prompts[0]][:300]


def request_cut_by_a_swap(url: str, model: str, prompt: Sequence[int], freeze_file: Path,
                          thaw: Callable[[], object], swap: Callable[[], object],
                          counter: Callable[[], float], tokens: int = 180
                          ) -> tuple[float, Answer]:
    """One request alone on the engine, frozen by the engine itself right after its first
    token (`freeze_file`: the test fault `faults.freeze_fault_env`, so it cannot finish
    before the swap however late this process runs), then cut by `swap()` (publish, and
    wait until served; the swap's resume ends the freeze, `thaw()` where the swap failed):
    how much `counter()` (an engine metric) moved meanwhile, and the answer, whose spans
    name two versions."""
    before = counter()
    first_token = threading.Event()
    got: dict[str, Answer] = {}
    freeze_file.touch()
    reader = threading.Thread(target=lambda: got.update(answer=stream_one(
        url, model, prompt, tokens, first_token=first_token)))
    reader.start()
    swapped = False
    try:
        assert first_token.wait(120), "the request produced no token"
        assert not freeze_file.exists(), "the engine did not freeze the request"
        swap()
        swapped = True
    finally:
        freeze_file.unlink(missing_ok=True)
        if not swapped:
            thaw()
        reader.join(300)
    answer = got.get("answer")
    assert answer is not None, "the request did not end"
    assert answer.ok, answer.error
    assert len({int(s["version"]) for s in answer.spans or ()}) == 2, \
        f"the swap did not cut the request: {answer.spans}"
    return counter() - before, answer


def _through_a_swap(url: str, model: str, model_dir: Path, old: dict, new: dict,
                    publish: Callable[[dict], int], wait_serving: Callable[[int], object],
                    prompts: Sequence[Sequence[int]], tokens: int) -> None:
    prompt = long_prompt(prompts)
    first, _ = complete(url, model, prompt, tokens)
    again, cached = complete(url, model, prompt, tokens)
    assert cached > 0 and again == first, f"the prompt was not cached ({cached} tokens)"
    client = StreamingClients(url, prompts, tokens, model=model).start()
    try:
        time.sleep(1.0)
        version = publish(new)
        wait_serving(version)
        time.sleep(1.0)
    finally:
        answers = client.stop()
    after, cached_after = complete(url, model, prompt, tokens)
    # (the clients' prompts, streamed after the swap too, may be cached under the new epoch)
    theirs = max(shared_prefix(prompt, p) for p in prompts)
    assert cached_after <= theirs < cached, \
        f"{cached_after} prompt tokens came from before the swap ({theirs} shared with clients)"
    [want] = hf_greedy(model_dir, [prompt], tokens, state_dict=new, skip_ties=True)
    assert want is None or after == want, "the prompt after the swap differs from HF"
    seen = set()
    for a in answers:
        assert a.ok, f"a request failed: {a.error}"
        assert a.spans and a.spans[0]["start"] == 0, a.spans
        seen |= {int(s["version"]) for s in a.spans}
        if int(a.spans[0]["version"]) == version - 1:
            end = a.spans[0]["end"]
            [w] = hf_greedy(model_dir, [a.prompt], end, state_dict=old, skip_ties=True)
            assert w is None or a.token_ids[:end] == w, "tokens before the swap differ"
    assert seen == {version - 1, version}, f"saw versions {seen}"
