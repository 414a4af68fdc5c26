"""What the TP=2 engine tests (`test_vllm_tp.py`, `test_sglang_tp.py`) share: a tiny model
whose heads split over two ranks, a trainer at v1, one engine, and the scenario of a
version one rank refuses."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from integration.engine_server import EngineServer
from integration.sharded import publish_in_two_ranks
from integration.tiny_model import Versions, pick_stable_prompts
from tensorhub import Publisher

MODEL = "policy"
TOKENS = 16
REFUSED = 3  # the version one rank refuses (`faults.refuse_fault_env`), as a failed copy would
# Heads split over 2 ranks; head_dim 32 (vLLM's CPU attention kernels take no 16).
TP_SHAPE = {"hidden": 128, "heads": 4, "kv_heads": 2}


@contextmanager
def tp_fleet(root: Path, address: str, launch: Callable[[Path], EngineServer],
             healthy_timeout: float) -> Iterator[SimpleNamespace]:
    """Versions 1-4 of the model, a trainer that published v1, and the engine `launch`
    starts from the model's folder (stopped at the end)."""
    versions = Versions(root, count=4, **TP_SHAPE)
    prompts, expected = pick_stable_prompts(versions.dir, 6, 12, TOKENS,
                                            state_dicts=versions.states)
    pub = Publisher(address, MODEL, name="trainer")
    pub.publish(versions.state(1))
    engine = launch(versions.dir)
    try:
        engine.wait_healthy(healthy_timeout)
        yield SimpleNamespace(versions=versions, prompts=prompts, expected=expected, pub=pub,
                              engine=engine, address=address)
    finally:
        engine.stop()
        pub.close()


def refused_then_next(fleet: SimpleNamespace, serving: Callable[[], int],
                      wait_serving: Callable[[int], object]) -> None:
    """The engine serves v2. v3 is refused by one rank: the engine must serve v2 whole on
    both ranks (tokens equal HF), then take v4."""
    engine = fleet.engine
    assert fleet.pub.publish(fleet.versions.state(REFUSED)) == REFUSED
    deadline = time.monotonic() + 120
    while f"refusing v{REFUSED}" not in engine.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the engine never tried to apply v{REFUSED}"
        time.sleep(0.5)
    assert serving() == REFUSED - 1
    assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[REFUSED - 2]
    assert fleet.pub.publish(fleet.versions.state(REFUSED + 1)) == REFUSED + 1
    wait_serving(REFUSED + 1)
    assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[REFUSED]


def two_rank_version_pulled_once(fleet: SimpleNamespace, wait_serving: Callable[[int], object],
                                 reader_prefix: Callable[[], str]) -> None:
    """v2, published by two trainer ranks together, is served with tokens equal HF, and the
    engine's workers (names starting `reader_prefix()`) pulled one model's bytes in all: one
    copy for the engine, not one per rank."""
    from integration.test_vllm import coordinator_status

    state = fleet.versions.state(2)
    publish_in_two_ranks(fleet.address, MODEL, state, 2, owners=fleet.pub.owners)
    wait_serving(2)
    assert fleet.engine.greedy(fleet.prompts, TOKENS) == fleet.expected[1]
    prefix = reader_prefix()
    pulled = sum(t.nbytes for t in coordinator_status(fleet.address).transfers
                 if t.version == 2 and t.ok and t.reader.startswith(prefix))
    model = sum(t.numel() * t.element_size() for t in state.values())
    assert model <= pulled < 1.01 * model


def bad_versions_refused_then_next(fleet: SimpleNamespace,
                                   wait_serving: Callable[[int], object]) -> None:
    """Versions the model cannot load (an unknown tensor mid-order, a wrong shape, a wrong
    dtype: `test_vllm._bad_versions`) are refused by the TP=2 engine before either rank
    touches its weights, with the tensor named in `/tensorhub/status`; it keeps answering
    as HF does on the version it serves, and takes the next good one."""
    from integration.test_vllm import _bad_versions
    from tensorhub_testing.waits import wait_for

    engine = fleet.engine
    served = fleet.pub.publish(fleet.versions.state(2))
    wait_serving(served)
    for what, state, tensor in _bad_versions(fleet.versions.state(2)):
        bad = fleet.pub.publish(state)
        wait_for(lambda bad=bad: (engine.request("/tensorhub/status")["unloadable"] or {}
                                  ).get("version") == bad, timeout=60,
                 what=f"refusing v{bad} ({what})")
        status = engine.request("/tensorhub/status")
        assert tensor in status["unloadable"]["reason"], status["unloadable"]
        assert status["serving_version"] == served
        assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[1]
    good = fleet.pub.publish(fleet.versions.state(3))
    wait_serving(good)
    assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[2]
