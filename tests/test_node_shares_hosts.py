"""The node copies of two TP=2 engines that span hosts (each node on an emulated host of its
own, shaped links, real NIXL between them) pulling their shares of a version in tiles: what
an engine's checkpoint copy on each node runs (`PartedReplica(share=node_share(...))`,
`tensorhub_testing/tiled_nodes.py`), without the engine itself."""

from __future__ import annotations

import pytest

from tensorhub_testing.cluster import Cluster, available
from tensorhub_testing.fleet import Fleet
from tensorhub_testing.tiled_nodes import llama_state, share_checksums
from tensorhub_testing.waits import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available() is not None,
                                 reason=f"no emulated hosts here: {available()}")]

TP, TILES = 2, 4
MODEL = {"layers": 6, "hidden": 512, "ffn": 2048}  # 98 MiB fp32; a node's share 56 MiB


def _pulled(proc, retries: int = 0) -> dict:
    """The node's next pull; with `retries`, up to that many failed pulls before it (the
    node pulls again by itself) are tolerated."""
    for _ in range(retries + 1):
        event = proc.next_json(180)
        if event["event"] != "error":
            break
    assert event["event"] == "pulled", event
    return event


def test_a_node_killed_mid_pull_leaves_its_engines_other_node_its_share(tmp_path):
    """Engine A's two nodes hold v1; engine B's two nodes then pull their shares, B1 from
    A1 (peers are read before the trainer). A1's host dies while it serves B1: A0 still
    holds its share for the coordinator, and B1 reads the killed node's share again from
    the trainer, every byte its ranks load equal to the trainer's."""
    with Cluster(5, egress="200mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path, env={"TENSORHUB_STALL_TIMEOUT": "5"}) as fleet:
        h0, *node_hosts = cluster.hosts
        trainer = fleet.python(h0, "trainer", "tensorhub_testing.tiled_nodes", "trainer",
                               fleet.address, "--tiles", str(TILES),
                               *(a for k, v in MODEL.items() for a in (f"--{k}", str(v))),
                               stdin=True)

        def node(name: str, rank: int):
            host = node_hosts[("A0", "A1", "B0", "B1").index(name)]
            return fleet.python(host, name, "tensorhub_testing.tiled_nodes", "node",
                                fleet.address, "--name", name, "--ranks", str(rank),
                                "--tp", str(TP))

        a0, a1 = node("A0", 0), node("A1", 1)
        trainer.send_line("1")
        assert trainer.next_json(120) == {"event": "published", "version": 1}
        state = llama_state(1, **MODEL)
        for rank, proc in enumerate((a0, a1)):
            assert _pulled(proc)["checksums"] == share_checksums(state, [rank], TP)

        a1_host = node_hosts[1]
        sent = a1_host.traffic().sent
        b0, b1 = node("B0", 0), node("B1", 1)
        wait_for(lambda: a1_host.traffic().sent - sent > 8 << 20, timeout=120,
                 what="A1 serving engine B a part of v1")
        a1_host.set_link(False)  # falls silent mid-read, as a host losing power does...
        a1_host.kill()  # ...and every process on it is gone

        for rank, proc in enumerate((b0, b1)):
            assert _pulled(proc, retries=1)["checksums"] == share_checksums(state, [rank], TP)
        status = fleet.status()
        b1_sources = {t["source"] for t in status["transfers"]
                      if t["reader"].startswith("B1") and t["version"] == 1 and t["ok"]}
        failed = [t for t in status["transfers"] if t["reader"].startswith("B1") and not t["ok"]]
        print(f"B1 read v1 from {sorted(b1_sources)} after failed reads from "
              f"{sorted({t['source'] for t in failed})}")
        assert "trainer" in {s.split(".")[0] for s in b1_sources}, b1_sources
        holders = {h["name"] for m in status["models"] for v in m["versions"]
                   if v["version"] == 1 for h in v["holders"] if not h["withdrawn"]}
        assert {"A0", "B0", "B1"} <= {h.split(".")[0] for h in holders}, holders
        assert not {h for h in holders if h.startswith("A1")}, holders
