"""A load that failed half-way is undone by loading the version served before again (or
the checkpoint the engine started from), and the outcome is told in the error's words."""

from __future__ import annotations

import pytest

from tensorhub.core.errors import TensorHubError
from tensorhub.engines.checkpoint_copy import TornLoad
from tensorhub.engines.outcome import outcome_in
from tensorhub.engines.restore import restore_after


def test_the_version_served_before_is_loaded_again():
    loaded = []
    with pytest.raises(TensorHubError) as caught:
        restore_after(TornLoad(3, RuntimeError("a bug")), 2, loaded.append, None)
    assert loaded == [2]
    assert caught.value.code == "restored" and outcome_in(repr(caught.value)) == "restored"
    assert "loading v3 failed half-way: a bug" in str(caught.value)


def test_an_engine_that_applied_no_version_reloads_its_checkpoint():
    from_disk = []
    with pytest.raises(TensorHubError) as caught:
        restore_after(TornLoad(1), None, lambda v: None, lambda: from_disk.append(True))
    assert from_disk == [True] and caught.value.code == "restored_checkpoint"
    assert outcome_in(str(caught.value)) == "restored_checkpoint"


def no_peer(version: int) -> None:
    raise TensorHubError(f"no holder of v{version}", code="no_holder")


def test_where_no_peer_holds_the_version_served_before_the_checkpoint_is_loaded():
    from_disk = []
    with pytest.raises(TensorHubError) as caught:
        restore_after(TornLoad(3), 2, no_peer, lambda: from_disk.append(True))
    assert from_disk == [True]
    assert outcome_in(str(caught.value)) == "restored_checkpoint"


def test_a_restore_that_fails_leaves_the_weights_torn():
    with pytest.raises(TensorHubError) as caught:
        restore_after(TornLoad(3, RuntimeError("a bug")), 2, no_peer, None)
    assert caught.value.code == "torn" and outcome_in(str(caught.value)) == "torn"
    assert "no holder of v2" in str(caught.value)
    assert outcome_in("swap to v3 failed: the copy is busy") is None
