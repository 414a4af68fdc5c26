"""Which model a quantized engine follows: the trainer's quantized layout of its model, where
the trainer publishes one the engine can install, else the bf16 model it quantizes itself.

A trainer with `Publisher(quantize=[recipe])` publishes each version twice: `<model>` in bf16
and `<model>@<recipe>` quantized once (`tensorhub/quant/layouts.py`). An engine of that
recipe that follows the companion pulls half the bytes and quantizes nothing. It decides at
start, from what the coordinator knows then (`keeps_up`), and says which way it went and
why in its log; `TENSORHUB_QUANTIZED_LAYOUT=never` keeps it
on bf16, and `TENSORHUB_MODEL=<model>@<recipe>` names the companion outright.

An engine that follows the companion serves nothing newer than it: if the trainer stops
publishing it (restarted without `quantize`), the engine would stay on an old version
while its model moves on. `LayoutLag` watches for that and says so, in the log and in
the engine's status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tensorhub.core.errors import TensorHubError
from tensorhub.engines.fleet import FleetView
from tensorhub.engines.settings import EngineSettings
from tensorhub.quant.layouts import RECIPES, model_of, quantized_model, recipe_of

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


# How long a version of the model may go without its quantized layout before an engine that
# follows the layout says it is left behind (the trainer quantizes right after publishing
# bf16: seconds, not minutes).
LAYOUT_LAG_WARN = 60.0
# How often such an engine looks at its model's newest version.
LAYOUT_LAG_EVERY = 5.0


class LayoutLag:
    """Whether the trainer still publishes the quantized layout an engine follows
    (`companion`). I/O-free: the engine tells it, every `LAYOUT_LAG_EVERY` seconds
    (`due`), the model's and the layout's newest versions (`observe`), and logs what it
    returns: a warning once a version of the model has gone `LAYOUT_LAG_WARN` seconds
    without its layout, and a line when the layout catches up again. `behind` is what the
    engine's status shows meanwhile."""

    def __init__(self, companion: str, warn_after: float = LAYOUT_LAG_WARN,
                 every: float = LAYOUT_LAG_EVERY) -> None:
        model = model_of(companion)
        if model is None:
            raise ValueError(f"{companion!r} is no quantized layout of a model")
        self.companion, self.model = companion, model
        self.warn_after, self.every = warn_after, every
        self.behind: dict | None = None  # {model_version, layout_version, for_s} once warned
        self._waiting: list[tuple[int, float]] = []  # model versions not in the layout yet
        self._next = 0.0

    @classmethod
    def following(cls, model: str) -> LayoutLag | None:
        """The watch for an engine that follows `model` (None: no quantized layout)."""
        return cls(model) if model_of(model) is not None else None

    def due(self, now: float) -> bool:
        """Whether to look again (then `observe`)."""
        if now < self._next:
            return False
        self._next = now + self.every
        return True

    def observe(self, model_latest: int, layout_latest: int, now: float) -> str | None:
        """What to log now that the model's newest version is `model_latest` and the
        layout's `layout_latest` (None: nothing)."""
        if model_latest > (self._waiting[-1][0] if self._waiting else layout_latest):
            self._waiting.append((model_latest, now))
        self._waiting = [(v, t) for v, t in self._waiting if v > layout_latest]
        if not self._waiting:
            if self.behind is None:
                return None
            self.behind = None
            return (f"TensorHub: {self.companion} is published again (v{layout_latest}): "
                    f"this engine follows its model once more")
        oldest, since = self._waiting[0]
        waited = now - since
        if waited < self.warn_after:
            return None
        first = self.behind is None
        self.behind = {"model": self.model, "model_version": model_latest,
                       "layout_version": layout_latest, "for_s": round(waited, 1)}
        if not first:
            return None
        recipe = recipe_of(self.companion)
        return (f"TensorHub: {self.model} v{oldest} was published {waited:.0f} s ago and its "
                f"{recipe} layout {self.companion} is still at v{layout_latest}: this engine "
                f"serves v{layout_latest} until the trainer publishes the layout again "
                f"(Publisher(..., quantize=[{recipe!r}])); to follow {self.model} in bf16 "
                f"instead, restart it with TENSORHUB_QUANTIZED_LAYOUT=never")
