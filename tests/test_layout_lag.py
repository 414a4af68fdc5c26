"""An engine that follows the trainer's quantized layout says when the trainer stops
publishing it (`engines.quantized.LayoutLag`), and when it is published again."""

from __future__ import annotations

import pytest

from tensorhub.engines import LayoutLag

LAYOUT = "policy@fp8_per_channel"


def test_a_layout_one_step_behind_for_less_than_the_grace_says_nothing():
    lag = LayoutLag(LAYOUT, warn_after=60.0)
    assert lag.observe(model_latest=5, layout_latest=4, now=0.0) is None
    assert lag.observe(model_latest=5, layout_latest=4, now=59.0) is None
    assert lag.observe(model_latest=6, layout_latest=5, now=100.0) is None  # v5 came in time
    assert lag.behind is None


def test_a_model_version_without_its_layout_past_the_grace_warns_once_and_shows_in_status():
    lag = LayoutLag(LAYOUT, warn_after=60.0)
    assert lag.observe(model_latest=5, layout_latest=4, now=0.0) is None
    said = lag.observe(model_latest=7, layout_latest=4, now=61.0)
    assert said is not None
    assert "policy v5 was published 61 s ago" in said
    assert "still at v4" in said and "serves v4" in said
    assert "quantize=['fp8_per_channel']" in said and "TENSORHUB_QUANTIZED_LAYOUT=never" in said
    assert lag.behind == {"model": "policy", "model_version": 7, "layout_version": 4,
                          "for_s": 61.0}
    assert lag.observe(model_latest=8, layout_latest=4, now=70.0) is None  # (once)
    assert lag.behind["model_version"] == 8 and lag.behind["for_s"] == 70.0


def test_a_layout_that_catches_up_says_so_and_clears_the_status():
    lag = LayoutLag(LAYOUT, warn_after=60.0)
    lag.observe(model_latest=5, layout_latest=4, now=0.0)
    assert lag.observe(model_latest=5, layout_latest=4, now=61.0) is not None
    said = lag.observe(model_latest=6, layout_latest=6, now=80.0)
    assert said == ("TensorHub: policy@fp8_per_channel is published again (v6): this engine "
                    "follows its model once more")
    assert lag.behind is None
    assert lag.observe(model_latest=6, layout_latest=6, now=90.0) is None


def test_the_grace_counts_from_when_each_model_version_was_first_seen():
    """A trainer that publishes every few seconds, its layout always one version behind
    when looked at, is keeping up: each version's layout comes within the grace."""
    lag = LayoutLag(LAYOUT, warn_after=60.0)
    for step in range(40):
        assert lag.observe(model_latest=step + 2, layout_latest=step + 1, now=5.0 * step) \
            is None
    assert lag.behind is None


def test_it_looks_again_only_every_few_seconds():
    lag = LayoutLag(LAYOUT, every=5.0)
    assert [lag.due(t) for t in (0.0, 1.0, 4.9, 5.0, 9.0, 10.1)] == \
        [True, False, False, True, False, True]


def test_only_an_engine_that_follows_a_quantized_layout_watches_it():
    assert LayoutLag.following("policy") is None
    assert LayoutLag.following("policy.patch") is None
    assert LayoutLag.following(LAYOUT).model == "policy"
    with pytest.raises(ValueError, match="no quantized layout"):
        LayoutLag("policy")
