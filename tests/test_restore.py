"""A load that failed half-way is undone by loading the version served before again (or
the checkpoint the engine started from), and the outcome is raised typed."""

from __future__ import annotations

import pytest

from tensorhub.core.errors import TensorHubError
from tensorhub.engines.checkpoint_copy import TornLoad
from tensorhub.engines.outcome import InstallFailed
from tensorhub.engines.restore import restore_after


def test_the_version_served_before_is_loaded_again():
    loaded = []
    with pytest.raises(InstallFailed) as caught:
        restore_after(TornLoad(3, RuntimeError("a bug")), 2, loaded.append, None)
    assert loaded == [2]
    assert caught.value.code == "restored"
    assert (caught.value.outcome.kind, caught.value.outcome.version) == ("restored", 3)
    assert "loading v3 failed half-way: a bug" in str(caught.value)


def test_an_engine_that_applied_no_version_reloads_its_checkpoint():
    from_disk = []
    with pytest.raises(InstallFailed) as caught:
        restore_after(TornLoad(1), None, lambda v: None, lambda: from_disk.append(True))
    assert from_disk == [True] and caught.value.outcome.kind == "restored_checkpoint"


def no_peer(version: int) -> None:
    raise TensorHubError(f"no holder of v{version}", code="no_holder")


def test_where_no_peer_holds_the_version_served_before_the_checkpoint_is_loaded():
    from_disk = []
    with pytest.raises(InstallFailed) as caught:
        restore_after(TornLoad(3), 2, no_peer, lambda: from_disk.append(True))
    assert from_disk == [True]
    assert caught.value.outcome.kind == "restored_checkpoint"


def test_a_restore_that_fails_leaves_the_weights_torn():
    with pytest.raises(InstallFailed) as caught:
        restore_after(TornLoad(3, RuntimeError("a bug")), 2, no_peer, None)
    assert caught.value.code == "torn" and caught.value.outcome.kind == "torn"
    assert "no holder of v2" in caught.value.outcome.reason
