"""vLLM end to end: real `vllm serve` engines with the TensorHub plugin, a real coordinator,
a trainer publishing float32 versions; greedy tokens checked against HF transformers.

The tests run in file order on one fleet, each on the versions the tests before it
published (v1 first, v7 last): one run alone with `-k` finds the fleet at v1."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from integration.faults import freeze_fault_env, load_fault_env
from integration.kept_kv import check_keep_kv, long_prompt, request_cut_by_a_swap
from integration.sharded import publish_in_two_ranks
from integration.stream_client import StreamingClients
from integration.tiny_model import Versions, hf_greedy, pick_stable_prompts
from integration.vllm_server import VLLMServer
from tensorhub import Publisher, Replica
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import GetManifest
from tensorhub_testing.status import coordinator_status
from tensorhub_testing.waits import wait_for

MODEL = "policy"
TOKENS = 16
PLUGIN_ARGS = ["--weight-transfer-config", json.dumps({"backend": "tensorhub"}),
               "--enable-scale-out"]


def plugin_env(coordinator: str) -> dict[str, str]:
    # A source that stops answering is given up after 5 s (default 30 s) so that the
    # failover test below stays short.
    return {"VLLM_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": coordinator,
            "TENSORHUB_MODEL": MODEL, "TENSORHUB_STALL_TIMEOUT": "5"}


def wait_serving(server: VLLMServer, version: int, timeout: float = 120.0) -> dict:
    return server.wait_serving(version, timeout)


def transfers(address: str, version: int, model: str = MODEL) -> list:
    return [t for t in coordinator_status(address).transfers
            if t.model == model and t.version == version and t.ok and t.nbytes > 0]


def sparse_step(state: dict[str, torch.Tensor], density: float = 0.01,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """The next version as an RL step leaves it: `density` of each tensor's elements move
    (by enough to change greedy tokens on a tiny model), the rest keep their exact bits."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        flat = t.view(-1)
        moved = torch.rand(flat.shape, generator=g) < density
        flat[moved] += torch.randn(int(moved.sum()), generator=g) * 3 * float(t.std())
        out[name] = t
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("vllm")
    versions = Versions(root, count=7)
    prompts, expected = pick_stable_prompts(versions.dir, 6, 12, TOKENS,
                                            state_dicts=versions.states)
    for v in range(1, 7):
        assert expected[v] != expected[v - 1], "versions must change the greedy tokens"
    address = coordinator_process.address
    pub = Publisher(address, MODEL, name="trainer")
    pub.publish(versions.state(1))  # version 1: the weights in the model folder
    # (a test freezes a request for a swap to cut; vLLM's dev routes: `/resume`)
    env = {**plugin_env(address), **load_fault_env(root / "fault-version"),
           "VLLM_SERVER_DEV_MODE": "1"}
    engines = [VLLMServer(vllm_python, versions.dir, extra_args=PLUGIN_ARGS,
                          env={**env, **freeze_fault_env(root / f"freeze-{i}")},
                          log_path=root / f"engine-{i}.log").launch()
               for i in range(2)]
    try:
        for e in engines:
            e.wait_healthy(300)
        yield SimpleNamespace(versions=versions, prompts=prompts, expected=expected, pub=pub,
                              engines=engines, address=address, root=root)
    finally:
        for e in engines:
            e.stop()
        pub.close()


def test_engines_start_by_joining_the_published_version(fleet):
    for e in fleet.engines:
        status = wait_serving(e, 1)
        assert status["vllm_weight_version"] == "1"
        assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[0]


@pytest.mark.parametrize("version", [2, 3])
def test_both_engines_switch_to_a_new_version_and_match_hf(fleet, version):
    assert fleet.pub.publish(fleet.versions.state(version)) == version
    for e in fleet.engines:
        status = wait_serving(e, version)
        assert status["vllm_weight_version"] == str(version)
        got = e.greedy(fleet.prompts, TOKENS)
        assert got == fleet.expected[version - 1], f"{e.url} differs from HF at v{version}"
        assert got != fleet.expected[version - 2]
    pulls = transfers(fleet.address, version)
    engine_to_engine = [t for t in pulls if t.source.startswith("vllm-")]
    assert len(pulls) == 2 and engine_to_engine, \
        f"v{version}: expected one engine to read from the other, got {pulls}"


def test_an_engine_started_later_serves_the_newest_version_without_its_weights_on_disk(
        fleet, vllm_python):
    weightless = fleet.versions.weightless_dir(fleet.root)
    late = VLLMServer(vllm_python, weightless, extra_args=[*PLUGIN_ARGS, "--load-format", "dummy"],
                      env=plugin_env(fleet.address), log_path=fleet.root / "late.log")
    with late:
        assert late.request("/tensorhub/status")["serving_version"] == 3  # before any request
        assert late.greedy(fleet.prompts, TOKENS) == fleet.expected[2]
    assert "joined at policy v3 from peers" in late.log_path.read_text()


def test_an_engine_up_before_a_declared_first_version_stands_by_and_pulls_it_unplanned(
        fleet, vllm_python):
    """A trainer that declares its first version's layout at start: an engine already
    serving (the weights from disk) allocates its copy from the declaration, is placed
    ahead of the version, and pulls it with no plan request when it comes."""
    model = "declared"
    engine = VLLMServer(vllm_python, fleet.versions.dir, extra_args=PLUGIN_ARGS,
                        env={**plugin_env(fleet.address), "TENSORHUB_MODEL": model},
                        log_path=fleet.root / "declared.log")
    with engine, Publisher(fleet.address, model, name="declaring-trainer") as pub:
        assert pub.declare(fleet.versions.state(2))
        wait_for(lambda: f"on standby for {model}'s first version" in
                 engine.log_path.read_text(), timeout=60, what="the engine on standby")
        assert pub.publish(fleet.versions.state(2)) == 1
        wait_serving(engine, 1)
        assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[1]
    assert f"pulling {model} v1 from the parents of its standby" in \
        engine.log_path.read_text()


def check_answers_by_their_versions(answers, model_dir, state_of: dict[int, dict]) -> dict:
    """Every answer's tokens against HF float32, span by span: tokens a version produced
    equal HF's greedy tokens under that version, continuing from the prompt and the tokens
    before them (a request kept through a swap goes on from where it was, on the new
    weights). Returns how many answers had one span and how many two or more."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    counts = {"one version": 0, "several versions": 0, "near-ties skipped": 0}
    for a in answers:
        assert a.ok, f"a request failed: {a.error}"
        spans = a.spans
        assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == len(a.token_ids), spans
        counts["one version" if len(spans) == 1 else "several versions"] += 1
        for span in spans:
            start, end = span["start"], span["end"]
            [want] = hf_greedy(hf, [a.prompt + a.token_ids[:start]], end - start,
                               state_dict=state_of[int(span["version"])], skip_ties=True)
            if want is None:  # a near-tie under HF: no verdict either way
                counts["near-ties skipped"] += 1
                continue
            assert a.token_ids[start:end] == want, \
                f"tokens {start}-{end} from v{span['version']} differ from HF: {spans}"
    return counts


def test_requests_in_flight_through_an_update_go_on_with_the_new_weights(fleet):
    """The default pause mode (`keep`): no request fails or is aborted; an answer the swap
    cut in two says which tokens each version produced, and both parts equal HF's."""
    engine = fleet.engines[0]
    client = StreamingClients(engine.url, fleet.prompts, TOKENS, model=engine.model).start()
    try:
        time.sleep(1.0)
        fleet.pub.publish(fleet.versions.state(4))
        wait_serving(engine, 4)
        time.sleep(1.0)
    finally:
        answers = client.stop()
    counts = check_answers_by_their_versions(
        answers, fleet.versions.dir, {3: fleet.versions.state(3), 4: fleet.versions.state(4)})
    seen = {int(s["version"]) for a in answers for s in a.spans}
    assert seen == {3, 4}, f"expected tokens from v3 and v4, saw {seen} ({counts})"


def test_a_manual_update_to_an_unknown_version_is_refused_and_the_engine_serves_on(fleet):
    import urllib.error

    engine = fleet.engines[1]
    with pytest.raises(urllib.error.HTTPError) as err:
        engine.request("/tensorhub/update", {"version": 99, "timeout": 5})
    assert err.value.code == 404
    assert "no version 99 (latest is 4)" in err.value.read().decode()
    status = wait_serving(engine, 4)
    assert status["vllm_weight_version"] == "4"
    assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[3]


def test_a_manual_update_to_the_current_version_changes_nothing(fleet):
    reply = fleet.engines[1].request("/tensorhub/update", {})
    assert reply == {"version": 4, "stall_ms": 0.0, "changed": False}


# A second trainer process that publishes a version and then hangs (SIGSTOP, right after the
# coordinator accepted it): the engines start reading from it and get no byte. It shows the
# model's credential, as a trainer rank taking over from the first would. It uses plain
# NIXL, whose READs over loopback TCP need the holder's progress thread; a same-host `cma`
# read would copy out of a stopped process regardless (truly one-sided).
HANGING_TRAINER = """
import json, os, signal, sys
from safetensors.torch import load_file
from tensorhub import Publisher, Replica
pub = Publisher(sys.argv[1], "policy", name="doomed-trainer", transport="nixl",
                owners=json.loads(sys.argv[3]))
print('{"version": %d}' % pub.publish(load_file(sys.argv[2])), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_an_engine_whose_source_dies_mid_update_serves_on_and_catches_up(fleet):
    import sys

    from safetensors.torch import save_file

    from tensorhub.tools.child_process import ChildProcess

    v5 = fleet.root / "v5.safetensors"
    save_file({k: t.contiguous() for k, t in fleet.versions.state(5).items()}, str(v5))
    doomed = ChildProcess([sys.executable, "-c", HANGING_TRAINER, fleet.address, str(v5),
                           json.dumps(fleet.pub.owners)], name="doomed-trainer")
    try:
        assert doomed.next_json(timeout=120) == {"version": 5}

        def failed_and_dropped() -> bool:
            status = coordinator_status(fleet.address)
            failed = [t for t in status.transfers if t.version == 5 and not t.ok
                      and t.source.startswith("doomed-trainer")]  # name, or id once gone
            holders = [h for m in status.models for v in m.versions if v.version == 5
                       for h in v.holders]
            return bool(failed) and not holders

        deadline = time.monotonic() + 120
        while not failed_and_dropped():
            assert time.monotonic() < deadline, "the stalled source was never given up"
            time.sleep(0.2)
        for e in fleet.engines:  # still the old version, whole
            assert e.request("/tensorhub/status")["serving_version"] == 4
            assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[3]
    finally:
        doomed.kill()
    assert fleet.pub.publish(fleet.versions.state(6)) == 6  # the trainer goes on
    for e in fleet.engines:
        wait_serving(e, 6)
        assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[5]


def test_engines_follow_a_version_published_in_two_parts_by_two_trainer_ranks(fleet):
    """Two ranks publish v7 together: each a share of the tensors, and the largest tensor
    split by rows between them. The engines serve it only whole, equal to HF."""
    publish_in_two_ranks(fleet.address, MODEL, fleet.versions.state(7), 7,
                         owners=fleet.pub.owners)
    for e in fleet.engines:
        assert wait_serving(e, 7)["vllm_weight_version"] == "7"
        assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[6]


def test_an_engines_own_metrics_endpoint_shows_its_version_and_switches(fleet):
    """vLLM's `/metrics` (no new scrape target) carries the plugin's series."""
    from prometheus_client.parser import text_string_to_metric_families

    for e in fleet.engines:
        serving = e.request("/tensorhub/status")["serving_version"]
        samples = {(s.name, s.labels.get("model")): s.value
                   for f in text_string_to_metric_families(e.request("/metrics"))
                   for s in f.samples}
        assert samples[("tensorhub_engine_serving_version", MODEL)] == serving == 7
        # It joined at v1 or later, then switched once per version since (v5 was lost).
        assert samples[("tensorhub_engine_updates_total", MODEL)] >= 3
        assert samples[("tensorhub_engine_stall_seconds_count", MODEL)] == \
            samples[("tensorhub_engine_updates_total", MODEL)]
        # its worker's pulls, which happen in another process: every byte the coordinator
        # saw it pull (a pull that resumed a version it partly held reads only the rest)
        [worker] = e.request("/tensorhub/status")["workers"]
        pulled = [t for t in coordinator_status(fleet.address).transfers
                  if t.reader == worker and t.ok and t.nbytes > 0]
        assert samples[("tensorhub_version_held", MODEL)] == 7
        assert samples[("tensorhub_pull_seconds_count", MODEL)] == len({t.version
                                                                        for t in pulled})
        assert samples[("tensorhub_pull_bytes_total", MODEL)] == sum(t.nbytes for t in pulled)


def _bad_versions(state: dict) -> list[tuple[str, dict, str]]:
    """(what is wrong, the state dict, the tensor the refusal names): a value head placed
    after the first layer's tensors, a tensor of the wrong shape, one of the wrong dtype."""
    names = list(state)
    first_layer_end = max(i for i, n in enumerate(names) if n.startswith("model.layers.0."))
    head = [*names[:first_layer_end + 1], "model.layers.1.value_head.weight",
            *names[first_layer_end + 1:]]
    value_head = torch.randn(1, state[names[0]].shape[-1])
    extra = {n: state.get(n, value_head) for n in head}
    target = names[first_layer_end + 2]
    shape = dict(state)
    shape[target] = state[target][:-1].clone()
    dtype = dict(state)
    dtype[target] = state[target].to(torch.float16)
    return [("an unknown tensor", extra, "model.layers.1.value_head.weight"),
            ("a wrong shape", shape, target), ("a wrong dtype", dtype, target)]


def test_a_version_the_model_cannot_load_is_refused_and_the_engines_serve_on(fleet):
    """One bad publish must not take the fleet down: each engine refuses it before its
    model is touched (its log, its status and a metric say which tensor and why), keeps
    answering as HF does on the version it reports, and takes the next good version."""
    from prometheus_client.parser import text_string_to_metric_families

    serving = fleet.engines[0].request("/tensorhub/status")["serving_version"]
    for what, state, tensor in _bad_versions(fleet.versions.state(serving)):
        bad = fleet.pub.publish(state)
        for e in fleet.engines:
            wait_for(lambda e=e, bad=bad: (e.request("/tensorhub/status")["unloadable"] or {}
                                           ).get("version") == bad, timeout=60,
                     what=f"{e.url} refusing v{bad} ({what})")
            status = e.request("/tensorhub/status")
            assert tensor in status["unloadable"]["reason"], status["unloadable"]
            assert status["serving_version"] == serving
            assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[serving - 1]
    for e in fleet.engines:
        refused = [s.value for f in text_string_to_metric_families(e.request("/metrics"))
                   for s in f.samples
                   if s.name == "tensorhub_engine_unloadable_versions_total"]
        assert refused == [3]
        assert "does not fit the engine's model" in e.log_path.read_text()
    good = fleet.pub.publish(fleet.versions.state(6))
    for e in fleet.engines:
        assert wait_serving(e, good)["vllm_weight_version"] == str(good)
        assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[5]


def latest_version(address: str) -> int:
    client = CoordinatorClient(address)
    try:
        return client.call(GetManifest(model=MODEL)).version
    finally:
        client.close()


def test_a_load_that_fails_half_way_is_undone_before_the_engines_answer_again(fleet):
    """A bug in the model's loader (a test fault, `integration/faults`) fails the load of a
    version half-way on both engines. Each loads the version it served before again, from
    the one peer that still holds it, before it answers: its tokens equal HF's on that
    version. It never tries the failed version again, and takes the next one."""
    good = fleet.pub.publish(fleet.versions.state(4))
    for e in fleet.engines:
        wait_serving(e, good)
    with Replica(fleet.address, MODEL, name="lagging-peer") as peer:
        assert peer.pull(good) == good  # the only holder of it once the trainer moves on
        before = transfers(fleet.address, good)
        bad = latest_version(fleet.address) + 1
        (fleet.root / "fault-version").write_text(str(bad))
        try:
            assert fleet.pub.publish(fleet.versions.state(5)) == bad
            for e in fleet.engines:
                wait_for(lambda e=e: f"restored the version it served before (v{good})"
                         in e.log_path.read_text(errors="replace"), timeout=120,
                         what=f"{e.url} restoring v{good}")
                status = e.request("/tensorhub/status")
                assert status["serving_version"] == good and status["torn"] is None
                assert status["vllm_weight_version"] == str(good)
                assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[3]
            # Each read it again from a peer: the lagging one, or the engine restored first.
            peers = {"lagging-peer", *(e.request("/tensorhub/status")["workers"][0]
                                       for e in fleet.engines)}
            again = [t for t in transfers(fleet.address, good) if t not in before]
            for e in fleet.engines:
                [worker] = e.request("/tensorhub/status")["workers"]
                assert {t.source for t in again if t.reader == worker} <= peers - {worker}
                assert any(t.reader == worker for t in again)
        finally:
            (fleet.root / "fault-version").unlink()
    after = fleet.pub.publish(fleet.versions.state(6))
    for e in fleet.engines:
        wait_serving(e, after)
        assert e.greedy(fleet.prompts, TOKENS) == fleet.expected[5]
        assert e.log_path.read_text().count(f"swap to v{bad} failed") == 1  # never again


def test_a_sparse_step_reaches_the_engines_as_a_patch_and_they_match_hf(fleet):
    from integration.tiny_model import hf_greedy
    from tensorhub.core.patch import patch_model

    base = fleet.pub.publish(fleet.versions.state(7))  # a whole version: a dense change
    for e in fleet.engines:
        wait_serving(e, base)
    step = sparse_step(fleet.versions.state(7))
    expected = hf_greedy(fleet.versions.dir, fleet.prompts, TOKENS, state_dict=step)
    version = fleet.pub.publish(step)
    assert version == base + 1 and fleet.pub.last_patch.version == version
    assert fleet.pub.last_patch.nbytes < 0.05 * sum(t.numel() * 4 for t in step.values())
    for e in fleet.engines:
        wait_serving(e, version)
        assert e.greedy(fleet.prompts, TOKENS) == expected, f"{e.url} differs from HF"
        # (what the ranks did: on CPU vLLM repacks its linear weights, so none writes sparse)
        assert e.tensorhub_status()["last_update"]["install"] == "whole"
    patched = transfers(fleet.address, version, model=patch_model(MODEL))
    assert {t.reader.split("-")[0] for t in patched} == {"vllm"}, patched
    assert len({t.reader for t in patched}) == len(fleet.engines), patched  # each engine
    assert not transfers(fleet.address, version)  # no engine pulled the version whole


def test_a_client_streams_through_twenty_updates_without_a_failed_request(fleet):
    """Twenty swaps while a client streams back to back: every request answered whole,
    every span named by its version, every token equal to HF's under that version."""
    engine = fleet.engines[1]
    base = fleet.pub.publish(fleet.versions.state(6))
    state_of = {base: fleet.versions.state(6)}
    wait_serving(engine, base)
    client = StreamingClients(engine.url, fleet.prompts, TOKENS, model=engine.model).start()
    try:
        for k in range(20):
            state = fleet.versions.state(7 - k % 2)
            version = fleet.pub.publish(state)
            state_of[version] = state
            wait_serving(engine, version)
            time.sleep(0.2)
    finally:
        answers = client.stop()
    counts = check_answers_by_their_versions(answers, fleet.versions.dir, state_of)
    assert counts["several versions"] >= 1, f"no answer was cut by a swap: {counts}"


def test_keep_kv_keeps_requests_through_a_swap_and_never_serves_an_older_cached_prompt(
        fleet, vllm_python):
    """`TENSORHUB_PAUSE=keep_kv`: requests in flight keep their KV (no recompute) and none
    fails; the prefix cache is not reset but salted by swap epoch, so a prompt cached
    before the swap is computed again after it, with the new weights."""
    engine = VLLMServer(vllm_python, fleet.versions.dir,
                        extra_args=[*PLUGIN_ARGS, "--enable-prompt-tokens-details"],
                        env={**plugin_env(fleet.address), "TENSORHUB_MODEL": "kept-kv",
                             "TENSORHUB_PAUSE": "keep_kv", "VLLM_SERVER_DEV_MODE": "1",
                             **freeze_fault_env(fleet.root / "kept-kv-freeze")},
                        log_path=fleet.root / "kept-kv.log")
    with engine:
        check_keep_kv(engine, fleet.address, fleet.versions.dir, fleet.versions.state(1),
                      fleet.versions.state(2), lambda v: wait_serving(engine, v),
                      fleet.prompts, TOKENS, freeze_file=fleet.root / "kept-kv-freeze",
                      thaw=engine.thaw,
                      preemptions=engine.preemptions)


def test_keep_computes_the_kv_of_a_request_cut_by_a_swap_again(fleet):
    """`keep` (the default): a request cut by a swap has its KV dropped and computed again
    with the new weights, once (in `keep_kv` the same request keeps it: the test above)."""
    engine = fleet.engines[0]
    dropped, answer = request_cut_by_a_swap(
        engine.url, engine.model, long_prompt(fleet.prompts), fleet.root / "freeze-0",
        engine.thaw,
        lambda: wait_serving(engine, fleet.pub.publish(fleet.versions.state(2))),
        engine.preemptions)
    assert dropped == 1, f"the request's KV was dropped {dropped} times ({answer.spans})"
