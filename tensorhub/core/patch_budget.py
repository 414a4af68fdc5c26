"""Whether a patch pays: decided before it is built, and again before a reader takes it.

A patch is worth making only if a reader holding its base has the new version sooner
through it than through the whole: the trainer's time to make it (compare and copy every word,
encode the changed ones, offer the patch), plus the patch's bytes at the readers' pull rate, plus a
reader's time to apply it and check the items it touched, against the whole version's
bytes at that pull rate. On one host a whole pull runs at memory speed and a patch rarely
pays; across a WAN the whole crawls and a sparse patch wins many times over.

The trainer knows its density before building anything from a sample of a few windows of
words (`core/patch.py: sample_changes`, a small fraction of the words an encode compares),
its own rates from the patches it built, and the readers' pull rate from the coordinator
(the slowest reader's last whole pull, `Published.pull_rate`). It builds the patch when
the slowest reader gains by it; each reader then decides for itself, on its own measured
pull and apply rates, and pulls whole where the patch would be slower.

Every rate here is an average of measurements, starting from a prior until one is made;
nothing here reads a clock or a socket: callers time their work and report it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorhub import settings

# How much a new measurement moves a rate (an exponential average): a few steps forget a
# changed machine, one odd step does not swing the choice.
_WEIGHT = 0.3


@dataclass
class Rate:
    """Seconds (or bytes) per unit, averaged over the measurements made; `prior` until one
    is. A `pinned` rate is `value` and learns nothing (a link whose rate one knows)."""

    prior: float
    value: float | None = None
    pinned: bool = False

    @classmethod
    def known(cls, value: float) -> Rate:
        return cls(value, value, pinned=True)

    @property
    def per_unit(self) -> float:
        return self.prior if self.value is None else self.value

    @property
    def measured(self) -> bool:
        return self.value is not None

    def observe(self, amount: float, units: float) -> None:
        """`amount` (seconds, bytes) was spent on `units` (words, bytes); ignored when
        either is not positive (nothing to learn from)."""
        if units <= 0 or amount <= 0 or self.pinned:
            return
        now = amount / units
        self.value = now if self.value is None else (1 - _WEIGHT) * self.value + _WEIGHT * now


@dataclass(frozen=True)
class Verdict:
    """A decision and the two times it weighed (seconds; `whole_s` None: no pull rate
    known, so the patch is not ruled out by time)."""

    patch: bool
    patch_s: float
    whole_s: float | None
    why: str


@dataclass
class PatchCosts:
    """The rates a decision weighs: the trainer's (making a patch: per word compared, copied
    and offered, and per change encoded), the patch's size per change, a reader's (the fixed
    cost of a patch's pull, apply, check) and the readers' whole-pull rate."""

    make_s_per_word: Rate = field(
        default_factory=lambda: Rate(settings.PATCH_PRIOR_MAKE_S_PER_WORD))
    encode_s_per_change: Rate = field(
        default_factory=lambda: Rate(settings.PATCH_PRIOR_ENCODE_S_PER_CHANGE))
    bytes_per_change: Rate = field(
        default_factory=lambda: Rate(settings.PATCH_PRIOR_BYTES_PER_CHANGE))
    apply_s_per_patch_byte: Rate = field(
        default_factory=lambda: Rate(settings.PATCH_PRIOR_APPLY_S_PER_BYTE))
    check_s_per_byte: Rate = field(
        default_factory=lambda: Rate(settings.PATCH_PRIOR_CHECK_S_PER_BYTE))
    pull_s_per_patch: Rate = field(
        default_factory=lambda: Rate(settings.PATCH_PRIOR_PULL_S_PER_PATCH))
    pull_s_per_byte: Rate = field(default_factory=lambda: Rate(0.0))

    def pull_rate_told(self, bytes_per_s: float | None) -> None:
        """The coordinator's word on the readers' pull rate (bytes/s), if it had one: the
        latest (it is a measurement of every reader already), unless the rate is pinned."""
        if bytes_per_s and not self.pull_s_per_byte.pinned:
            self.pull_s_per_byte.value = 1 / bytes_per_s

    def built(self, words: int, changes: int, make_s: float, encode_s: float,
              nbytes: int) -> None:
        """A patch of `changes` changed words out of `words`, `nbytes` long, took `make_s`
        besides the `encode_s` its changes took to encode (comparing, copying, offering it:
        all the trainer spent on it that a whole version does not cost)."""
        self.make_s_per_word.observe(make_s, words)
        self.encode_s_per_change.observe(encode_s, changes)
        self.bytes_per_change.observe(nbytes, changes)

    def applied(self, patch_bytes: int, apply_s: float, checked_bytes: int,
                check_s: float) -> None:
        """A reader applied `patch_bytes` of patches in `apply_s` and checked the
        `checked_bytes` of items they touched in `check_s`."""
        self.apply_s_per_patch_byte.observe(apply_s, patch_bytes)
        self.check_s_per_byte.observe(check_s, checked_bytes)

    def pulled_patches(self, patches: int, patch_bytes: int, seconds: float) -> None:
        """A reader pulled `patches` patches of `patch_bytes` in all in `seconds`: what it
        took beyond their bytes at the whole-pull rate is each one's fixed cost."""
        fixed = seconds - patch_bytes * self.pull_s_per_byte.per_unit
        self.pull_s_per_patch.observe(fixed, patches)

    def pulled_whole(self, nbytes: int, seconds: float) -> None:
        """A reader pulled a whole version of `nbytes` in `seconds`."""
        if nbytes >= settings.PATCH_RATE_MIN_BYTES:
            self.pull_s_per_byte.observe(seconds, nbytes)

    def _whole_s(self, nbytes: int) -> float | None:
        return nbytes * self.pull_s_per_byte.per_unit if self.pull_s_per_byte.measured \
            else None

    def _reader_s(self, patch_bytes: float, nbytes: int, patches: int = 1) -> float:
        """A reader's time for patches: pull them, apply them, check what they touched (at a
        density worth a patch, nearly every item of a model: all of them, counted)."""
        return patches * self.pull_s_per_patch.per_unit \
            + patch_bytes * (self.pull_s_per_byte.per_unit
                             + self.apply_s_per_patch_byte.per_unit) \
            + nbytes * self.check_s_per_byte.per_unit

    def trainer_verdict(self, sampled_words: int, sampled_changes: int, words: int,
                        nbytes: int) -> Verdict:
        """Whether to build the patch of a version of `words` words (`nbytes` bytes) of
        which a sample of `sampled_words` had `sampled_changes` changed."""
        if not sampled_words:  # (nothing could be sampled: the writer's own budget decides)
            return Verdict(True, 0.0, self._whole_s(nbytes), "no sample of the words")
        density = sampled_changes / sampled_words
        changes = density * words
        patch_bytes = changes * self.bytes_per_change.per_unit
        if patch_bytes > settings.PATCH_MAX_RATIO * nbytes:
            return Verdict(False, float("inf"), self._whole_s(nbytes),
                           f"{density:.2%} of the words changed: its patch would be over "
                           f"{settings.PATCH_MAX_RATIO:.0%} of the version")
        make_s = words * self.make_s_per_word.per_unit \
            + changes * self.encode_s_per_change.per_unit
        patch_s = make_s + self._reader_s(patch_bytes, nbytes)
        return self._weigh(patch_s, nbytes, f"{density:.2%} of the words changed")

    def reader_verdict(self, patch_bytes: int, nbytes: int, patches: int = 1) -> Verdict:
        """Whether a reader takes a chain of `patches` patches, `patch_bytes` in all, rather
        than the whole version of `nbytes`."""
        return self._weigh(self._reader_s(patch_bytes, nbytes, patches), nbytes,
                           f"{patch_bytes / nbytes:.4f} of the version as patches")

    def _weigh(self, patch_s: float, nbytes: int, what: str) -> Verdict:
        whole_s = self._whole_s(nbytes)
        if whole_s is None:
            return Verdict(True, patch_s, None, f"{what}; no whole pull measured yet")
        pays = patch_s < whole_s
        return Verdict(pays, patch_s, whole_s,
                       f"{what}: ~{patch_s:.3f} s as a patch against ~{whole_s:.3f} s whole")
