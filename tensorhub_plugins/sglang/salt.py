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


def salt_requests(epoch: Callable[[], int]) -> None:
    """Salt every request SGLang tokenizes with `epoch()` at that moment."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_tokenized(result: Any, *args, **kwargs) -> Any:
        if hasattr(result, "cache_salt"):
            result.cache_salt = salted(result.cache_salt, epoch())
        return result

    HookRegistry.register(TOKENIZED, after_tokenized, HookType.AFTER)
