"""vLLM across emulated hosts: an engine on one host joins from an engine on another, with no
transport settings, and answers as HF transformers does on the same float32 weights."""

from __future__ import annotations

import json
import re

import pytest

from integration.tiny_model import Versions, pick_stable_prompts, save_version
from integration.vllm_server import VLLMServer
from tensorhub_testing.cluster import Cluster, available
from tensorhub_testing.fleet import Fleet

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
TOKENS = 12
# This test asks an engine on another host for its status: its routes need a token then.
ROUTE_TOKEN = {"TENSORHUB_HTTP_TOKEN": "vllm-hosts-test"}
PLUGIN_ARGS = ["--weight-transfer-config", json.dumps({"backend": "tensorhub"})]


@pytest.mark.timeout(600)  # two engine start-ups
def test_a_vllm_engine_joins_from_an_engine_on_another_host(tmp_path, vllm_python):
    versions = Versions(tmp_path, count=2)
    published = save_version(versions.dir, versions.state(2), tmp_path / "v2")  # not on disk
    prompts, expected = pick_stable_prompts(versions.dir, 4, 12, TOKENS,
                                            state_dicts=[versions.state(1), versions.state(2)])
    assert expected[0] != expected[1], "the published weights must change the answers"
    with Cluster(3, egress="800mbit") as cluster, Fleet(cluster, log_dir=tmp_path) as fleet:
        h0, h1, h2 = cluster.hosts
        env = {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": fleet.address,
               "TENSORHUB_MODEL": "policy", **ROUTE_TOKEN}
        # the trainer publishes, waits until one engine holds the version, and leaves
        trainer = h0.tensorhub("--log-level", "INFO", "publish", str(published),
                               "--coordinator", fleet.address, "--wait-replicas", "1",
                               "--json", name="trainer",
                               log_path=str(tmp_path / "trainer.log"))
        assert trainer.next_json(120)["event"] == "published"
        first = VLLMServer(vllm_python, versions.dir, extra_args=PLUGIN_ARGS, env=env,
                           log_path=tmp_path / "vllm-h1.log").on(h1)
        late = VLLMServer(vllm_python, versions.weightless_dir(tmp_path),
                          extra_args=[*PLUGIN_ARGS, "--load-format", "dummy"], env=env,
                          log_path=tmp_path / "vllm-h2.log").on(h2)
        try:
            first.start(300)
            first.wait_serving(1)
            assert trainer.next_json(120)["event"] == "held"
            assert trainer.wait(60) == 0  # gone: the engine on h1 is the only holder left
            assert first.greedy(prompts, TOKENS) == expected[1]
            late.start(300)  # healthy only once it joined at v1, from h1 across the network
            assert late.tensorhub_status()["serving_version"] == 1
            assert late.greedy(prompts, TOKENS) == expected[1]
            # it read from the engine on h1, across the network (the trainer had left)
            assert re.search(r"vllm-h2\S* pulled policy v1 from vllm-h1",
                             late.log_path.read_text()), late.log_tail()
        finally:
            late.stop()
            first.stop()


QUIET_REQUESTS = 5
STOPPED_FOR = 60.0
ON_TIME = 2.0  # seconds over the engine's quiet latency (the bound)


def test_an_engine_answers_on_time_while_the_source_it_reads_from_is_stopped(
        tmp_path, vllm_python):
    """The engine's request loop shares no fate with a peer: while the only source of a
    version it is pulling is stopped for a minute (on another host), a greedy request a
    second is answered as fast as when nothing moves, and as HF answers on the version the
    engine reports."""
    import statistics
    import sys
    import time

    versions = Versions(tmp_path, count=2)
    published = save_version(versions.dir, versions.state(2), tmp_path / "v2")
    prompts, expected = pick_stable_prompts(versions.dir, 2, 12, TOKENS,
                                            state_dicts=[versions.state(1)])
    with Cluster(2, egress="800mbit") as cluster, Fleet(cluster, log_dir=tmp_path) as fleet:
        h0, h1 = cluster.hosts
        env = {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": fleet.address,
               "TENSORHUB_MODEL": "policy", **ROUTE_TOKEN}
        engine = VLLMServer(vllm_python, versions.dir, extra_args=PLUGIN_ARGS, env=env,
                            log_path=tmp_path / "vllm-h1.log").on(h1)
        trainer = None
        try:
            engine.start(300)

            def timed() -> float:
                started = time.monotonic()
                assert engine.greedy(prompts[:1], TOKENS) == expected[0][:1]
                return time.monotonic() - started

            quiet = statistics.median(timed() for _ in range(QUIET_REQUESTS))
            trainer = h0.popen([sys.executable, "-m", "integration.stopping_trainer",
                                fleet.address, str(published)], name="stopping-trainer",
                               log_path=str(tmp_path / "trainer.log"))
            assert trainer.next_json(120) == {"version": 1}
            stopped_at, latencies = time.monotonic(), []
            while time.monotonic() - stopped_at < STOPPED_FOR:
                latencies.append(timed())
                time.sleep(max(0.0, 1.0 - latencies[-1]))
            assert max(latencies) < quiet + ON_TIME, \
                f"quiet {quiet:.2f} s, while the source was stopped up to {max(latencies):.2f} s"
            status = engine.tensorhub_status()
            assert status["serving_version"] is None  # the disk weights: v1 never came whole
            assert engine.greedy(prompts, TOKENS) == expected[0]
        finally:
            if trainer is not None:
                trainer.kill()
                trainer.stop()
            engine.stop()
