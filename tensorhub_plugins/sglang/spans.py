"""Which weight version produced which tokens, in SGLang's OpenAI-compatible answers.

SGLang 0.5.23 already tracks it per request in its scheduler: when the weight version
changes (`update_weights_from_tensor` with `weight_version`, or `/update_weight_version`),
every live request records how many tokens it had (`WeightVersionEvent`), and when it
finishes the scheduler turns those events into spans of output positions per version
(`meta_info["weight_versions"]`, e.g. `[{"version": "3", "start": 0, "end": 17},
{"version": "4", "start": 17, "end": 40}]`). Its OpenAI endpoints only pass on those of
the first choice of a non-streaming answer (`metadata.weight_versions`), and none in a
stream.

These hooks (registered by `plugin.register` in SGLang's main process) put them on every
choice, as `weight_versions` with integer versions where the label is one (TensorHub labels
versions by their number; `"default"` is the checkpoint the server started from):

- non-streaming `/v1/completions` and `/v1/chat/completions`: on each choice;
- streaming: on the chunk that finishes each choice (the one with `finish_reason`): the
  spans of the whole answer, positions counted from its first output token. (Earlier
  chunks carry none: the scheduler knows the spans only once a request finishes.)

Every hook here fails closed: an error leaves SGLang's own answer as it was.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("tensorhub.sglang")

FIELD = "weight_versions"
_COMPLETIONS = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion"
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"


def spans_of(meta_info: dict | None) -> list[dict] | None:
    """The version spans SGLang's scheduler reported for one answer, versions as ints where
    they are numbers; None when it reported none."""
    spans = (meta_info or {}).get("weight_versions")
    if not spans:
        return None
    out = []
    for span in spans:
        version = span["version"]
        if isinstance(version, str) and version.isdigit():
            version = int(version)
        out.append({"version": version, "start": int(span["start"]),
                    "end": int(span["end"])})
    return out


_STASH = "tensorhub_weight_versions"  # metadata key: per-choice spans, moved to the choices


def _after_build(response: Any, self, request, ret: list[dict], created: int) -> Any:
    """AFTER hook on `_build_completion_response` / `_build_chat_response`: each choice's
    spans, kept in the answer's `metadata` (the choice models forbid extra fields) until
    `_around_handle` moves them onto the choices. Other callers of the build (SGLang's
    Anthropic route) get SGLang's answer with that one extra metadata key."""
    try:
        if getattr(response, "metadata", None) is None or not hasattr(response, "choices"):
            return None  # an error answer: as SGLang made it
        response.metadata[_STASH] = {
            choice.index: spans for choice in response.choices
            if 0 <= choice.index < len(ret)
            and (spans := spans_of(ret[choice.index].get("meta_info"))) is not None}
    except Exception:
        log.exception("TensorHub: could not read the weight_versions of an answer")
    return None


def _around_handle(original, self, *args, **kwargs):
    """AROUND hook on the OpenAI routes' `handle_request`: a non-streaming answer leaves as
    JSON with `weight_versions` on each choice (SGLang's route passes a non-model answer
    through as it is)."""

    async def handled():
        response = await original(self, *args, **kwargs)
        try:
            metadata = getattr(response, "metadata", None)
            if not isinstance(metadata, dict) or _STASH not in metadata:
                return response
            from starlette.responses import Response

            body = response.model_dump(mode="json", by_alias=True)
            stash = body["metadata"].pop(_STASH)
            for choice in body.get("choices", []):
                spans = stash.get(str(choice.get("index", 0)),
                                  stash.get(choice.get("index", 0)))
                if spans is not None:
                    choice[FIELD] = spans
            return Response(content=json.dumps(body), media_type="application/json")
        except Exception:
            log.exception("TensorHub: could not add weight_versions to the answer")
            return response

    return handled()


class _Recorder:
    """Stands in for SGLang's TokenizerManager inside one streaming answer: passes every
    output through and keeps the version spans of each choice (by index)."""

    def __init__(self, manager, spans: dict[int, list[dict]]):
        self._manager = manager
        self._spans = spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    async def generate_request(self, *args, **kwargs):
        async for content in self._manager.generate_request(*args, **kwargs):
            try:
                for item in content if isinstance(content, list) else [content]:
                    spans = spans_of(item.get("meta_info"))
                    if spans is not None:
                        self._spans[item.get("index", 0)] = spans
            except Exception:
                log.exception("TensorHub: could not read weight_versions of a chunk")
            yield content


class _Serving:
    """Stands in for the OpenAI serving object inside one streaming answer, with the
    recording tokenizer manager."""

    def __init__(self, serving, manager: _Recorder):
        self._serving = serving
        self.tokenizer_manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._serving, name)


def with_spans(chunk: Any, spans: dict[int, list[dict]]) -> Any:
    """A server-sent event `data: {...}` with `weight_versions` on each choice it finishes;
    anything else unchanged."""
    if not isinstance(chunk, str) or not chunk.startswith("data: {") or not spans:
        return chunk
    try:
        body = json.loads(chunk[len("data: "):])
        changed = False
        for choice in body.get("choices") or []:
            if choice.get("finish_reason") and choice.get("index", 0) in spans:
                choice[FIELD] = spans[choice.get("index", 0)]
                changed = True
        return f"data: {json.dumps(body)}\n\n" if changed else chunk
    except Exception:
        return chunk


def _around_stream(original, self, *args, **kwargs):
    """AROUND hook on `_generate_completion_stream` / `_generate_chat_stream`."""
    spans: dict[int, list[dict]] = {}
    try:
        proxy = _Serving(self, _Recorder(self.tokenizer_manager, spans))
    except Exception:
        log.exception("TensorHub: streaming without weight_versions")
        return original(self, *args, **kwargs)

    async def stream():
        async for chunk in original(proxy, *args, **kwargs):
            yield with_spans(chunk, spans)

    return stream()


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for cls, build, stream in ((_COMPLETIONS, "_build_completion_response",
                                "_generate_completion_stream"),
                               (_CHAT, "_build_chat_response", "_generate_chat_stream")):
        HookRegistry.register(f"{cls}.{build}", _after_build, HookType.AFTER)
        HookRegistry.register(f"{cls}.{stream}", _around_stream, HookType.AROUND)
        HookRegistry.register(f"{cls}.handle_request", _around_handle, HookType.AROUND)
