"""Pause mode `keep_kv` in SGLang: every request's prefix-cache salt names the swap epoch it
arrived in (`tensorhub.engines.kv_salt`), so the radix cache, which SGLang does not flush
while requests are kept in place, never serves a prompt cached under one set of weights to a
request that arrived under another.

The salt is set on the tokenized request, in SGLang's main process, where the driver keeps
the epoch; the scheduler keys its radix cache by it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensorhub.engines import salted

TOKENIZED = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"


def why_not(tokenizer_workers: int) -> str | None:
    """Why requests could not all be salted here (then `keep_kv` must not be used)."""
    if tokenizer_workers > 1:
        return (f"--tokenizer-worker-num {tokenizer_workers}: the other tokenizer processes "
                f"would not salt their requests")
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    if "cache_salt" not in getattr(TokenizedGenerateReqInput, "__struct_fields__", ()):
        return "this SGLang's tokenized requests have no cache_salt"
    return None


def salt_requests(epoch: Callable[[], int | None]) -> None:
    """Salt every request SGLang tokenizes with `epoch()` at that moment (none where it is
    None: not in `keep_kv`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_tokenized(result: Any, *args, **kwargs) -> Any:
        now = epoch()
        if now is not None and hasattr(result, "cache_salt"):  # (embeddings have none)
            result.cache_salt = salted(result.cache_salt, now)
        return result

    HookRegistry.register(TOKENIZED, after_tokenized, HookType.AFTER)
