"""Which model a quantized engine follows: the trainer's quantized layout of its model, where
the trainer publishes one the engine can install, else the bf16 model it quantizes itself.

A trainer with `Publisher(quantize=[recipe])` publishes each version twice: `<model>` in bf16
and `<model>@<recipe>` quantized once (`tensorhub/quant/layouts.py`). An engine of that
recipe that follows the companion pulls half the bytes and quantizes nothing. It decides at
start, from what the coordinator knows then (`keeps_up`), and says which way it went and
why in its log; `TENSORHUB_QUANTIZED_LAYOUT=never` keeps it
on bf16, and `TENSORHUB_MODEL=<model>@<recipe>` names the companion outright.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tensorhub.core.errors import TensorHubError
from tensorhub.engines.fleet import FleetView
from tensorhub.engines.settings import EngineSettings
from tensorhub.quant.layouts import RECIPES, quantized_model, recipe_of

log = logging.getLogger("tensorhub.engines")


def keeps_up(settings: EngineSettings, companion: str) -> bool:
    """Whether the trainer publishes `companion` with its model: its newest version is the
    model's (a left-over companion of an earlier run, behind its model, does not count),
    or, before the model has a version, it is declared or published."""
    views = [FleetView.connect(settings.coordinator, m, timeout=5.0)
             for m in (settings.model, companion)]
    try:
        base, ours = (view.latest() for view in views)
        return ours >= base if ours else base == 0 and views[1].declared()
    finally:
        for view in views:
            view.close()


def followed_model(settings: EngineSettings, recipe: str | None,
                   cannot: Callable[[], str | None]) -> str:
    """The model an engine quantized by `recipe` (None: not quantized) follows. `cannot()`:
    why this engine cannot install the quantized layout (None: it can), asked only once the
    trainer is seen to publish one (the engine may check its own quantization for it)."""
    model = settings.model
    if recipe is None or recipe_of(model) is not None or settings.quantized_layout == "never":
        return model
    if recipe not in RECIPES:
        log.info("TensorHub: no quantized layout is made for %s (only %s): this engine pulls "
                 "%s and quantizes each version itself", recipe, ", ".join(sorted(RECIPES)),
                 model)
        return model
    companion = quantized_model(model, recipe)
    try:
        published = keeps_up(settings, companion)
    except TensorHubError as exc:
        log.warning("TensorHub: cannot ask the coordinator for %s (%s): this engine pulls %s "
                    "and quantizes each version itself", companion, exc, model)
        return model
    if not published:
        log.info("TensorHub: the trainer publishes no %s layout of %s (%s has no version "
                 "as new as its model's, nor a declaration; Publisher(quantize=[%r]) makes "
                 "one): this engine pulls %s and quantizes each version itself (decided at "
                 "start: start the "
                 "trainer, or its declare(), before the engines)", recipe, model, companion,
                 recipe, model)
        return model
    why = cannot()
    if why is not None:
        log.info("TensorHub: this engine pulls %s and quantizes each version itself: it "
                 "cannot install the trainer's quantized layout %s (%s)", model, companion, why)
        return model
    log.info("TensorHub: following %s, the trainer's %s layout of %s (about half the bytes "
             "of bf16, nothing quantized in the pause)", companion, recipe, model)
    return companion
