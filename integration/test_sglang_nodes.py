"""SGLang at TP=2 with one rank on each of two emulated hosts, started as SGLang documents
multi-node serving (`--nnodes 2 --node-rank R --dist-init-addr`), the TensorHub plugin on
both: only node 0 drives, node 1's rank reports to it through the engine's store, and the
engine joins late at v1 and follows v2 and v3 (confirmed by every rank) with greedy tokens
equal to HF's, pulling one copy per node per version, a version its model cannot load is
refused by both nodes before either touches its weights, and a version in tiles is pulled
by each node as its rank's share (and, where a node pulled the wrong share, refused and
pulled whole from then on)."""

from __future__ import annotations

import pytest

from integration.faults import skew_share_env
from integration.sglang_server import SGLangServer
from integration.test_sglang import LOADER, sglang_env, wait_sglang
from integration.tp_fleet import TOKENS
from integration.two_hosts import (
    VERSIONS,
    engine_on_two_hosts,
    holders,
    model_bytes,
    pulled,
    tiles_pulled_as_shares,
    wrong_shape_refused,
)
from tensorhub_testing.cluster import available
from tensorhub_testing.waits import wait_for

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
DIST_INIT_PORT = 5000


def sglang_on_two_hosts(sglang_python: str, root, tp: int):
    """How `engine_on_two_hosts` starts an SGLang engine of `tp` ranks, half on each host
    (each host's ranks bound to cores of their own where the machine has them; the
    share-skewing test fault inert until a test creates its file, `root / "skew"`)."""

    def launch(model_dir, address, node0, node1):
        engines = []
        for rank, host in enumerate((node0, node1)):
            cores = "|".join(str(c) for c in range(tp // 2)) if tp > 2 else str(rank)
            env = {**sglang_env(address), **skew_share_env(root / "skew"),
                   "SGLANG_CPU_OMP_THREADS_BIND": cores,
                   "GLOO_SOCKET_IFNAME": "eth0", "SGLANG_HOST_IP": host.address,
                   "HOST_IP": host.address}
            args = ["--custom-weight-loader", LOADER, "--tp-size", str(tp), "--nnodes", "2",
                    "--node-rank", str(rank),
                    "--dist-init-addr", f"{node0.address}:{DIST_INIT_PORT}"]
            engines.append(SGLangServer(sglang_python, model_dir, extra_args=args, env=env,
                                        log_path=root / f"sglang-node{rank}.log").on(host))
        for engine in engines:
            engine.launch()
        return engines

    return launch


@pytest.fixture(scope="module")
def nodes_engine(tmp_path_factory, sglang_python):
    root = tmp_path_factory.mktemp("sglang-nodes")
    with engine_on_two_hosts(root, sglang_on_two_hosts(sglang_python, root, 2),
                             healthy_timeout=480) as fleet:
        yield fleet


def confirmed(fleet, version: int, ranks: int = 2) -> dict:
    """The engine serves `version` by SGLang's label and by the driver, which saw every
    rank (node 1's too) report it applied."""
    wait_sglang(fleet.engine, version)
    status = fleet.engine.wait_serving(version)
    assert [r["applied"] for r in status["ranks"]] == [version] * ranks, status["ranks"]
    return status


@pytest.mark.timeout(900)  # two engine processes start across hosts
def test_an_sglang_engine_across_two_hosts_joins_late_and_follows_versions(nodes_engine):
    engine = nodes_engine.engine
    confirmed(nodes_engine, 1)
    assert engine.greedy(nodes_engine.prompts, TOKENS) == nodes_engine.expected[0]
    for version in range(2, VERSIONS + 1):
        nodes_engine.publish(version)
        confirmed(nodes_engine, version)
        assert engine.greedy(nodes_engine.prompts, TOKENS) == nodes_engine.expected[version - 1]
    # no swap was refused for want of a rank's report; node 1 serves no HTTP and starts
    # no driver of its own
    assert "no status yet" not in engine.log_path.read_text()
    assert "cannot update this server" not in nodes_engine.other.log_path.read_text()


def test_an_sglang_engine_across_two_hosts_pulls_one_copy_per_node(nodes_engine):
    """One rank per node: each node's rank keeps its own checkpoint copy, so the engine
    pulls at most two models' bytes per version (its nodes), and holds two copies."""
    status = nodes_engine.engine.tensorhub_status()
    assert len(status["workers"]) == 2, status["workers"]
    model = model_bytes(nodes_engine.versions.state(VERSIONS))
    coordinator = nodes_engine.fleet.status()
    for version in range(2, VERSIONS + 1):
        nbytes, readers = pulled(coordinator, version, status["name"])
        print(f"SGLang TP=2 on 2 hosts: v{version}: {nbytes} B pulled by {sorted(readers)} "
              f"({nbytes / model:.2f} x the model)")
        assert model <= nbytes <= 2 * model
    assert holders(coordinator, VERSIONS, status["workers"]) == set(status["workers"])


def test_a_version_the_model_cannot_load_is_refused_across_the_hosts(nodes_engine):
    """A tensor of the wrong shape: each node's copy finds it before the pause, node 1's
    rank says so through the engine's store, and the engine names the tensor, keeps
    serving the version before with HF's tokens, and never tries it again."""
    status = wrong_shape_refused(nodes_engine)
    assert [r["applied"] for r in status["ranks"]] == [VERSIONS] * 2, status["ranks"]


def test_a_version_in_tiles_is_pulled_by_each_node_as_its_share(nodes_engine):
    """The trainer publishes versions in two tiles (`tensorhub/tiles.py`): each node's copy
    pulls its rank's tile and the part every rank loads whole, not the whole model, and
    the engine serves each (confirmed by both ranks) with HF's tokens."""
    tiles_pulled_as_shares(nodes_engine, nodes_engine.engine.tensorhub_status()["name"],
                           lambda v: confirmed(nodes_engine, v), "SGLang TP=2")


def test_a_node_that_loads_outside_its_share_refuses_the_version_and_pulls_whole_after(
        nodes_engine):
    """A test fault makes each node's copy pull the other rank's tiles of a version in a
    tile count it has not loaded before (4): the first load from it finds rows it never
    pulled (NaN) in its live parameters, so the load fails and is undone before the engine
    answers again, with HF's tokens; the copies then pull every part, and the next version
    in tiles is served with HF's tokens. (Nobody holds the version served before any more:
    the trainer that published it stopped for the one publishing in 4 tiles, and each
    copy keeps one version. So the undoing loads the checkpoint the engine started from.)"""
    engine = nodes_engine.engine
    skew = nodes_engine.root / "skew"
    skew.touch()
    try:
        bad = nodes_engine.publish_tiled(2, tiles=4)
        wait_for(lambda: f"v{bad}" in str(engine.tensorhub_status()["last_error"]),
                 timeout=120, what=f"refusing v{bad}")
    finally:
        skew.unlink()
    status = engine.tensorhub_status()
    assert "outside the tiles" in status["last_error"], status["last_error"]
    assert "restored the checkpoint it started from" in status["last_error"]
    assert status["serving_version"] is None and status["torn"] is None, status
    assert engine.greedy(nodes_engine.prompts, TOKENS) == nodes_engine.expected[0]
    version = nodes_engine.publish_tiled(3, tiles=4)
    confirmed(nodes_engine, version)
    assert engine.greedy(nodes_engine.prompts, TOKENS) == nodes_engine.expected[2]
    nbytes, _ = pulled(nodes_engine.fleet.status(), version, status["name"])
    assert nbytes == 2 * model_bytes(nodes_engine.versions.state(3))  # (every part, twice)
