"""The engine API: what the vLLM and SGLang plugins (`tensorhub_plugins`) build on, with no
engine imports here. Plugins import from this package (the names below) and from
`tensorhub`'s top level, never from `tensorhub.core` or `tensorhub.coordinator`."""

from tensorhub.engines import sparse_install
from tensorhub.engines.auth import REFUSED, authorized
from tensorhub.engines.background_check import BackgroundCheck, CheckAnswer, all_ready, refusal_in
from tensorhub.engines.background_priority import yield_to_engine
from tensorhub.engines.checkpoint_copy import CheckpointCopy, TornLoad, alone, versions_to_release
from tensorhub.engines.fleet import FleetView, Holdings, LayoutHolders, layout_labels
from tensorhub.engines.follow import FollowLoop, PendingPulls, Update
from tensorhub.engines.kv_salt import salted
from tensorhub.engines.logs import show_tensorhub_logs
from tensorhub.engines.outcome import InstallFailed, LoadOutcome, worst_outcome
from tensorhub.engines.quantized import LayoutLag, followed_model
from tensorhub.engines.restore import restore_after
from tensorhub.engines.settings import EngineSettings, load_settings
from tensorhub.engines.share_check import ShareCheck
from tensorhub.engines.shared_copy import (
    SharedCopyReader,
    apply_shared,
    copy_holders,
    node_of,
    one_copy_per_engine,
)
from tensorhub.engines.swap import StepClock, SwapController, SwapSteps
from tensorhub.engines.votes import RankVote
from tensorhub.engines.weights_check import (
    checkpoint_tensors,
    from_checkpoint,
    tied_optional,
)
from tensorhub.stages import stage_share
from tensorhub.tiles import NodeExperts, node_share

__all__ = [
    "REFUSED",
    "BackgroundCheck",
    "CheckAnswer",
    "CheckpointCopy",
    "EngineSettings",
    "FleetView",
    "FollowLoop",
    "Holdings",
    "InstallFailed",
    "LayoutHolders",
    "LayoutLag",
    "LoadOutcome",
    "NodeExperts",
    "PendingPulls",
    "RankVote",
    "ShareCheck",
    "SharedCopyReader",
    "StepClock",
    "SwapController",
    "SwapSteps",
    "TornLoad",
    "Update",
    "all_ready",
    "alone",
    "apply_shared",
    "authorized",
    "checkpoint_tensors",
    "copy_holders",
    "followed_model",
    "from_checkpoint",
    "layout_labels",
    "load_settings",
    "node_of",
    "node_share",
    "one_copy_per_engine",
    "refusal_in",
    "restore_after",
    "salted",
    "show_tensorhub_logs",
    "sparse_install",
    "stage_share",
    "tied_optional",
    "versions_to_release",
    "worst_outcome",
    "yield_to_engine",
]
