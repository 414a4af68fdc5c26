"""What the cross-host engine tests (`test_vllm_nodes.py`, `test_sglang_nodes.py`) share: one
TP=2 engine whose two ranks run on two emulated hosts (node 0 serves HTTP, node 1 runs the
other rank), a coordinator and a trainer on a third host, and the checks every version gets.

Each emulated host has a network, PID, UTS and mount namespace of its own
(`tensorhub_testing.cluster`), joined by a bridge with shaped links; each engine host also
gets a private `/dev/shm` (a tmpfs mounted in its mount namespace): SGLang decides that two
ranks share a node by a shared-memory segment, so hosts that share the real `/dev/shm` look
like one node to it and hang at start-up. The engine is started after the trainer published
v1, so it joins late (from the trainer, across hosts) and then follows v2 and v3.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from integration.engine_server import EngineServer
from integration.tiny_model import Versions, pick_stable_prompts, save_version
from integration.tp_fleet import TOKENS, TP_SHAPE
from tensorhub_testing.cluster import Cluster, Host
from tensorhub_testing.fleet import Fleet

VERSIONS = 3
SHM_SIZE = "2g"
# launch(model folder, coordinator address, node 0's host, node 1's host) -> [node 0, node 1]
Launch = Callable[[Path, str, Host, Host], list[EngineServer]]


def private_shm(host: Host) -> None:
    """A `/dev/shm` of the host's own (gone with its mount namespace when the host ends)."""
    host.run(["mount", "-t", "tmpfs", "-o", f"size={SHM_SIZE}", "tmpfs", "/dev/shm"],
             check=True)


@contextmanager
def engine_on_two_hosts(root: Path, launch: Launch, healthy_timeout: float,
                        shape: dict[str, int | str] = TP_SHAPE) -> Iterator[SimpleNamespace]:
    """Versions 1-3 of a tiny float32 model (of `shape`: by default its heads split over
    two ranks), a trainer (on its own host) that published v1, and the engine `launch`
    starts, healthy: its node 0 first in the list. Everything is stopped, and the hosts
    torn down, at the end."""
    versions = Versions(root, count=VERSIONS, **shape)
    prompts, expected = pick_stable_prompts(versions.dir, 4, 12, TOKENS,
                                            state_dicts=versions.states)
    folders = [save_version(versions.dir, versions.state(v), root / f"v{v}")
               for v in range(1, VERSIONS + 1)]
    with Cluster(3, egress="800mbit") as cluster, Fleet(cluster, log_dir=root) as fleet:
        trainer_host, node0, node1 = cluster.hosts
        for host in (node0, node1):
            private_shm(host)
        trainer = trainer_host.popen([sys.executable, "-m", "integration.line_trainer",
                                      fleet.address], stdin=subprocess.PIPE, name="trainer",
                                     log_path=str(root / "trainer.log"))
        engines: list[EngineServer] = []

        def publish(version: int) -> None:
            trainer.send_line(str(folders[version - 1]))
            assert trainer.next_json(120) == {"version": version}

        def publish_state(state: dict) -> int:
            """Publish `state` (any tensors: a version the model may not load); its
            version number."""
            folder = save_version(versions.dir, state,
                                  root / f"extra-{len(list(root.glob('extra-*')))}")
            trainer.send_line(str(folder))
            return int(trainer.next_json(120)["version"])

        def publish_tiled(version: int, tiles: int | None, kind: str = "tiles",
                          experts: str = "", kv_heads: int | None = None) -> int:
            """Publish the state of `version` again, in `tiles` tiles (`experts`: how a
            mixture of experts' are laid out; `kv_heads`: its K/V split by these heads;
            `kind` "blocks": in layer blocks, `tiles` None: at the engines' stage edges),
            as the next version; its number."""
            trainer.send_line(f"{folders[version - 1]} {kind}" + (f" {tiles}" if tiles else "")
                              + (f" {experts}" if experts else "")
                              + (f" kv={kv_heads}" if kv_heads else ""))
            return int(trainer.next_json(120)["version"])

        try:
            publish(1)
            engines = launch(versions.dir, fleet.address, node0, node1)
            engines[0].wait_healthy(healthy_timeout)
            assert all(e.alive() for e in engines), [e.log_tail() for e in engines]
            yield SimpleNamespace(versions=versions, prompts=prompts, expected=expected,
                                  engine=engines[0], other=engines[-1], fleet=fleet,
                                  publish=publish, publish_state=publish_state,
                                  publish_tiled=publish_tiled, root=root)
        finally:
            for engine in reversed(engines):
                engine.stop(timeout=5)  # (a headless vLLM node ignores SIGTERM for long)
            trainer.stop()


def pulled(status: dict, version: int, reader_prefix: str) -> tuple[int, set[str]]:
    """Bytes of `version` the engine's workers (names starting `reader_prefix`) pulled, and
    the workers that read them, as the coordinator's `status` (`Fleet.status`) records."""
    records = [t for t in status["transfers"]
               if t["version"] == version and t["ok"] and t["reader"].startswith(reader_prefix)]
    return sum(t["nbytes"] for t in records), {t["reader"] for t in records}


def holders(status: dict, version: int, names: list[str]) -> set[str]:
    """Which of the workers `names` hold `version` (their checkpoint copies), as the
    coordinator's `status` says."""
    return {h["name"] for model in status["models"] for v in model["versions"]
            if v["version"] == version for h in v["holders"]
            if h["name"] in names and not h["withdrawn"]}


def model_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def a_copy_per_node_pulled(fleet: SimpleNamespace, what: str) -> None:
    """One rank per node: each keeps a copy of its own, so the engine pulled at most two
    models' bytes of each version published whole (its nodes), and holds two copies."""
    workers = fleet.engine.tensorhub_status()["workers"]
    assert len(workers) == 2, workers
    prefix = workers[0].rsplit("-rank", 1)[0]
    model = model_bytes(fleet.versions.state(VERSIONS))
    coordinator = fleet.fleet.status()
    for version in range(2, VERSIONS + 1):
        nbytes, readers = pulled(coordinator, version, prefix)
        print(f"{what} on 2 hosts: v{version}: {nbytes} B pulled by {sorted(readers)} "
              f"({nbytes / model:.2f} x the model)")
        assert model <= nbytes <= 2 * model
    assert holders(coordinator, VERSIONS, workers) == set(workers)


def wrong_shape_refused(fleet: SimpleNamespace) -> dict:
    """Publish a version with a tensor of the wrong shape and wait until the engine refused
    it, naming the tensor and still serving the version before with HF's tokens; its
    status then."""
    from integration.test_vllm import _bad_versions
    from tensorhub_testing.waits import wait_for

    engine, state = fleet.engine, fleet.versions.state(VERSIONS)
    [(_, wrong_shape, tensor)] = [b for b in _bad_versions(state) if b[0] == "a wrong shape"]
    bad = fleet.publish_state(wrong_shape)
    wait_for(lambda: (engine.tensorhub_status()["unloadable"] or {}).get("version") == bad,
             timeout=120, what=f"refusing v{bad}")
    status = engine.tensorhub_status()
    assert tensor in status["unloadable"]["reason"], status["unloadable"]
    assert status["serving_version"] == VERSIONS
    assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[VERSIONS - 1]
    return status


def tiles_pulled_as_shares(fleet: SimpleNamespace, reader_prefix: str,
                           serving: Callable[[int], object], what: str) -> None:
    """Versions 2 and 3 published again in two tiles: each is served (`serving(version)`
    returns once it is) with HF's tokens, and each node's copy pulled its rank's tile and
    the part every rank loads whole, as the coordinator saw it."""
    from tensorhub.tiles import tile

    for state_of in (2, 3):
        state = fleet.versions.state(state_of)
        parts = [model_bytes(dict(p.tensors)) for p in tile(state.items(), 2)]
        version = fleet.publish_tiled(state_of, tiles=2)
        serving(version)
        assert fleet.engine.greedy(fleet.prompts, TOKENS) == fleet.expected[state_of - 1]
        nbytes, readers = pulled(fleet.fleet.status(), version, reader_prefix)
        print(f"{what} on 2 hosts, 2 tiles: v{version}: {nbytes} B pulled by "
              f"{sorted(readers)} ({nbytes / model_bytes(state):.2f} x the model)")
        assert nbytes == parts[0] + parts[1] + 2 * parts[2]  # (each node: its tile, the rest)
