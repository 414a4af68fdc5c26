"""Which version produced which tokens, on vLLM's OpenAI-compatible routes.

vLLM tracks, per answer, spans of output tokens by the weight version label in force when
each token was sampled (`CompletionOutput.weight_versions`, labelled by the front end at
every swap) but returns them only on its `/inference/v1/generate` route. With requests kept
through a swap (pause mode `keep`) one answer can come from two versions, and a trainer
needs to know which tokens are off-policy. So every choice of `/v1/completions` and
`/v1/chat/completions` gets them too, as `weight_versions: [{"version": 3, "start": 0,
"end": 17}, ...]` (token positions `[start, end)` of that choice's output), on the last
chunk of a stream (the one with `finish_reason`).

The serving classes are wrapped once, in the API server's process, when the front end
starts: the engine's result stream is read through as vLLM reads it, and each response
gets the spans of its choices; nothing else of the response changes.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

log = logging.getLogger("tensorhub.vllm")

FIELD = "weight_versions"


def spans_of(output: Any) -> list[dict] | None:
    """An output's spans, versions as ints where the label is one (TensorHub labels the
    weights by version number; "default" is the checkpoint the engine started from), as
    the SGLang plugin gives them."""
    spans = getattr(output, FIELD, None)
    if not spans:
        return None
    out = []
    for span in spans:
        span = dict(span) if isinstance(span, dict) else asdict(span)
        if isinstance(span["version"], str) and span["version"].isdigit():
            span["version"] = int(span["version"])
        out.append(span)
    return out


class _Recorder:
    """Reads an engine result stream through, keeping each choice's spans by its index in
    the response (`index(item, output)`)."""

    def __init__(self, source: AsyncIterator, index: Callable[[Any, Any], int],
                 outputs: Callable[[Any], list]):
        self.source, self.index, self.outputs = source, index, outputs
        self.spans: dict[int, list[dict]] = {}

    async def __aiter__(self):
        async for item in self.source:
            try:
                for output in self.outputs(item):
                    spans = spans_of(output)
                    if spans is not None:
                        self.spans[self.index(item, output)] = spans
            except Exception:  # the answer goes out without spans, never fails for them
                log.exception("TensorHub: could not read the weight_versions of an answer")
            yield item

    def add_to_chunk(self, chunk: str) -> str:
        """An SSE chunk (`data: {...}`) with the spans added to its finished choices."""
        if not self.spans or not chunk.startswith("data: {"):
            return chunk
        try:
            body = json.loads(chunk[len("data: "):])
        except ValueError:
            return chunk
        changed = False
        for choice in body.get("choices") or ():
            spans = self.spans.get(choice.get("index"))
            if choice.get("finish_reason") is not None and spans is not None:
                choice[FIELD] = spans
                changed = True
        return f"data: {json.dumps(body)}\n\n" if changed else chunk


def _with_recorder(fn: Callable, index, outputs, stream: bool):
    """Wrap a serving method that takes `result_generator`."""
    signature = inspect.signature(fn)

    if stream:
        @functools.wraps(fn)
        async def wrapped(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            recorder = _Recorder(bound.arguments["result_generator"], index, outputs)
            bound.arguments["result_generator"] = recorder.__aiter__()
            async for chunk in fn(*bound.args, **bound.kwargs):
                yield recorder.add_to_chunk(chunk) if isinstance(chunk, str) else chunk
    else:
        @functools.wraps(fn)
        async def wrapped(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            recorder = _Recorder(bound.arguments["result_generator"], index, outputs)
            bound.arguments["result_generator"] = recorder.__aiter__()
            response = await fn(*bound.args, **bound.kwargs)
            try:
                for choice in getattr(response, "choices", None) or ():
                    spans = recorder.spans.get(choice.index)
                    if spans is not None:
                        setattr(choice, FIELD, spans)
            except Exception:
                log.exception("TensorHub: could not add weight_versions to an answer")
            return response
    return wrapped


def _completion_response(fn: Callable) -> Callable:
    """`request_output_to_completion_response`: choices are made in the order of the
    results and their outputs."""
    @functools.wraps(fn)
    def wrapped(self, final_res_batch, *args, **kwargs):
        response = fn(self, final_res_batch, *args, **kwargs)
        try:
            spans = [spans_of(o) for res in final_res_batch for o in res.outputs]
            for choice, found in zip(response.choices, spans, strict=False):
                if found is not None:
                    setattr(choice, FIELD, found)
        except Exception:
            log.exception("TensorHub: could not add weight_versions to an answer")
        return response
    return wrapped


def install() -> bool:
    """Wrap vLLM's OpenAI serving classes (once per process). False if this vLLM lacks
    them (then answers carry no spans; logged)."""
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError as exc:
        log.warning("TensorHub: no per-token versions on the OpenAI routes (%s)", exc)
        return False
    if getattr(OpenAIServingCompletion, "_tensorhub_versions", False):
        return True
    comp = OpenAIServingCompletion
    original_stream = comp.completion_stream_generator

    @functools.wraps(original_stream)
    async def completion_stream(self, request, *args, **kwargs):
        per_prompt = 1 if request.n is None else request.n
        # (the stream yields (prompt index, RequestOutput); a choice's index counts both)
        wrapped = _with_recorder(
            original_stream, lambda item, output: item[0] * per_prompt + output.index,
            lambda item: item[1].outputs, stream=True)
        async for chunk in wrapped(self, request, *args, **kwargs):
            yield chunk

    comp.completion_stream_generator = completion_stream
    comp.request_output_to_completion_response = _completion_response(
        comp.request_output_to_completion_response)
    chat = OpenAIServingChat
    chat.chat_completion_stream_generator = _with_recorder(
        chat.chat_completion_stream_generator, lambda item, output: output.index,
        lambda item: item.outputs, stream=True)
    chat.chat_completion_full_generator = _with_recorder(
        chat.chat_completion_full_generator, lambda item, output: output.index,
        lambda item: item.outputs, stream=False)
    comp._tensorhub_versions = True
    return True
