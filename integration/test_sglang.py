"""SGLang end to end, in one fleet with vLLM: real servers, a real coordinator, a trainer
publishing float32 versions; greedy tokens checked against HF transformers.

The first SGLang engine takes the checkpoint path (it keeps a checkpoint copy and bridges
to vLLM); a second one of the same layout joins and then updates natively from it, straight
into its live parameters, spending the compact region only."""

from __future__ import annotations

import base64
import itertools
import pickle
import socket
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from integration.faults import checkpoint_layout_env, load_fault_env
from integration.sglang_server import SGLangServer
from integration.test_vllm import (
    PLUGIN_ARGS,
    plugin_env,
    sparse_step,
    transfers,
    wait_serving,
)
from integration.tiny_model import Versions, pick_stable_prompts
from integration.vllm_server import VLLMServer
from tensorhub import Publisher

MODEL = "policy"
TOKENS = 16
LOADER = "tensorhub_plugins.sglang.loader.apply"


def sglang_env(coordinator: str) -> dict[str, str]:
    return {"SGLANG_PLUGINS": "tensorhub", "TENSORHUB_COORDINATOR": coordinator,
            "TENSORHUB_MODEL": MODEL}


def sglang_version(server: SGLangServer) -> str:
    return server.request("/get_model_info")["weight_version"]


def wait_sglang(server: SGLangServer, version: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while sglang_version(server) != str(version):
        if time.monotonic() > deadline:
            raise AssertionError(f"SGLang serves {sglang_version(server)}, not v{version}\n"
                                 f"{server.log_tail()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, sglang_python, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("sglang")
    versions = Versions(root, count=4)
    prompts, expected = pick_stable_prompts(versions.dir, 6, 12, TOKENS,
                                            state_dicts=versions.states, seed=3)
    address = coordinator_process.address
    pub = Publisher(address, MODEL, name="trainer")
    pub.publish(versions.state(1))
    sgl = SGLangServer(sglang_python, versions.dir,
                       env={**sglang_env(address), **load_fault_env(root / "fault-version")},
                       extra_args=["--custom-weight-loader", LOADER, "--enable-metrics",
                                   # (the test tokenizer has none: for /v1/chat/completions)
                                   "--chat-template", "chatml"],
                       log_path=root / "sglang.log").launch()
    # (its live weights in the checkpoint's layout, as on a GPU: a sparse step is written
    # into them word by word, and they can be read)
    vllm = VLLMServer(vllm_python, versions.dir, extra_args=PLUGIN_ARGS,
                      env={**plugin_env(address), **checkpoint_layout_env()},
                      live_weights=True, log_path=root / "vllm.log").launch()
    try:
        sgl.wait_healthy(300)
        vllm.wait_healthy(300)
        yield SimpleNamespace(versions=versions, prompts=prompts, expected=expected, pub=pub,
                              sgl=sgl, vllm=vllm, address=address, root=root)
    finally:
        sgl.stop()
        vllm.stop()
        pub.close()


def test_sglang_joins_the_published_version_at_start(fleet):
    wait_sglang(fleet.sgl, 1)
    assert fleet.sgl.greedy(fleet.prompts, TOKENS) == fleet.expected[0]
    assert "joined at policy v1 from peers" in fleet.sgl.log_path.read_text()
    # The plugin's route on SGLang's own port reports the version SGLang labels as served.
    status = fleet.sgl.wait_serving(1, timeout=30)
    assert status["serving_version"] == 1 and status["ranks"][0]["applied"] == 1
    assert status["workers"] == [status["name"] + "-tp0"]
    assert status["name"].startswith(f"sglang-{socket.gethostname()}:{fleet.sgl.port}-")


def test_sglangs_own_metrics_endpoint_shows_its_version_switches_and_pulls(fleet):
    """SGLang's `/metrics` (`--enable-metrics`; no new scrape target) carries the plugin's
    series, its scheduler's pulls included."""
    from prometheus_client.parser import text_string_to_metric_families

    wait_sglang(fleet.sgl, 1)
    with urllib.request.urlopen(f"{fleet.sgl.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = {(s.name, s.labels.get("model")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    ours = [line for line in text.splitlines() if line.startswith("tensorhub_")]
    assert ("tensorhub_engine_serving_version", MODEL) in samples, ours
    assert samples[("tensorhub_engine_serving_version", MODEL)] == 1
    assert samples[("tensorhub_version_held", MODEL)] == 1
    version_bytes = sum(t.numel() * t.element_size() for t in fleet.versions.state(1).values())
    assert samples[("tensorhub_pull_seconds_count", MODEL)] == 1
    assert samples[("tensorhub_pull_bytes_total", MODEL)] == pytest.approx(version_bytes,
                                                                          rel=0.01)


@pytest.mark.parametrize("version", [2, 3])
def test_sglang_and_vllm_switch_together_and_pull_from_each_other(fleet, version):
    fleet.pub.publish(fleet.versions.state(version))
    wait_sglang(fleet.sgl, version)
    wait_serving(fleet.vllm, version)
    assert fleet.sgl.greedy(fleet.prompts, TOKENS) == fleet.expected[version - 1]
    assert fleet.vllm.greedy(fleet.prompts, TOKENS) == fleet.expected[version - 1]
    pulls = transfers(fleet.address, version)
    kinds = {(t.reader.split("-")[0], t.source.split("-")[0]) for t in pulls}
    assert ("sglang", "vllm") in kinds or ("vllm", "sglang") in kinds, pulls


def _update_through_our_loader(server: SGLangServer, names: list[str]) -> None:
    payload = base64.b64encode(pickle.dumps([(n, torch.empty(0)) for n in names])).decode()
    server.request("/begin_weight_update", {})
    try:
        server.request("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload], "load_format": LOADER})
    finally:
        server.request("/end_weight_update", {})


@pytest.mark.parametrize("names", [
    ['tensorhub:{"version": 99}'],          # a version nobody holds
    ["tensorhub:{not json"],                # malformed descriptor
    ["model.embed_tokens.weight"],          # no descriptor at all
])
def test_a_malformed_update_through_our_loader_leaves_the_server_serving(fleet, names):
    _update_through_our_loader(fleet.sgl, names)
    assert fleet.sgl.healthy()
    assert fleet.sgl.greedy(fleet.prompts, TOKENS) == fleet.expected[2]
    assert "TensorHub update refused, weights unchanged" in fleet.sgl.log_path.read_text()


def native_name(server: SGLangServer) -> str:
    return server.tensorhub_status()["native_workers"][0]


def scheduler_status(server: SGLangServer) -> dict:
    return server.tensorhub_status()["ranks"][0]


@pytest.fixture(scope="module")
def late(fleet, sglang_python):
    """A second SGLang engine, same layout, started after v3 with no weights on disk."""
    weightless = fleet.versions.weightless_dir(fleet.root)
    server = SGLangServer(sglang_python, weightless, env=sglang_env(fleet.address),
                          extra_args=["--custom-weight-loader", LOADER,
                                      "--load-format", "dummy"],
                          log_path=fleet.root / "late.log")
    with server:
        yield server


def test_a_second_sglang_joins_natively_from_the_first_without_weights_on_disk(fleet, late):
    assert late.greedy(fleet.prompts, TOKENS) == fleet.expected[2]
    assert "joined at policy v3 from peers" in late.log_path.read_text()
    joined = scheduler_status(late)
    assert (joined["applied"], joined["path"]) == (3, "native")
    assert joined["sources"] == [native_name(fleet.sgl)]
    assert joined["memory"]["checkpoint_copy_bytes"] == 0


def test_the_second_sglang_pulls_the_next_version_natively_into_its_live_parameters(
        fleet, late):
    fleet.pub.publish(fleet.versions.state(4))
    for server in (fleet.sgl, late):
        wait_sglang(server, 4)
    wait_serving(fleet.vllm, 4)
    for server in (fleet.sgl, late, fleet.vllm):
        assert server.greedy(fleet.prompts, TOKENS) == fleet.expected[3]
    bridge, native = fleet.sgl.wait_serving(4), late.wait_serving(4)
    assert bridge["last_update"]["path"] == "checkpoint"
    assert native["last_update"]["path"] == "native"
    assert native["last_update"]["sources"] == [native_name(fleet.sgl)]
    assert (native_name(late), native_name(fleet.sgl)) in {
        (t.reader, t.source) for t in transfers(fleet.address, 4)}
    assert native["params_moved"] is False  # the pull wrote into SGLang's own storages
    # Extra memory: the native engine spends the compact region (norms, biases) only; the
    # bridge also keeps a full checkpoint-layout copy for vLLM.
    assert native["memory"]["checkpoint_copy_bytes"] == 0
    assert 0 < native["memory"]["compact_bytes"] == bridge["memory"]["compact_bytes"]
    assert bridge["memory"]["checkpoint_copy_bytes"] > 10 * native["memory"]["compact_bytes"]


def test_a_version_the_model_cannot_load_is_refused_and_sglang_serves_on(fleet, late):
    """SGLang (the checkpoint path, and one that joined natively with no weights on disk)
    and vLLM side by side: each refuses a version its model cannot load before the model
    is touched, says which tensor in `/tensorhub/status`, keeps answering as HF does on its
    version, and takes the next good one."""
    from integration.test_vllm import _bad_versions
    from tensorhub_testing.waits import wait_for

    serving = fleet.sgl.request("/tensorhub/status")["serving_version"]
    for what, state, tensor in _bad_versions(fleet.versions.state(serving)):
        bad = fleet.pub.publish(state)
        for server in (fleet.sgl, late, fleet.vllm):
            wait_for(lambda s=server, bad=bad: (s.request("/tensorhub/status")["unloadable"]
                                                or {}).get("version") == bad,
                     timeout=60, what=f"{server.url} refusing v{bad} ({what})")
            status = server.request("/tensorhub/status")
            assert tensor in status["unloadable"]["reason"], status["unloadable"]
            assert status["serving_version"] == serving
            assert server.greedy(fleet.prompts, TOKENS) == fleet.expected[serving - 1]
    good = fleet.pub.publish(fleet.versions.state(3))
    wait_sglang(fleet.sgl, good)
    wait_sglang(late, good)
    wait_serving(fleet.vllm, good)
    for server in (fleet.sgl, late, fleet.vllm):
        assert server.greedy(fleet.prompts, TOKENS) == fleet.expected[2]


def test_a_load_that_fails_half_way_is_undone_before_sglang_answers_again(fleet, late):
    """A bug in the model's loader (a test fault, `integration/faults`) fails SGLang's load
    of a version half-way. It loads the version it served before again, from a peer that
    still holds it in checkpoint layout, before generation resumes: its tokens equal HF's
    on that version. It never tries the failed version again, and takes the next.

    The second SGLang engine is stopped first: it has no fault, so it would load the bad
    version and the first engine could take it natively from it, never loading it itself."""
    from integration.test_vllm import latest_version
    from tensorhub import Replica
    from tensorhub_testing.waits import wait_for

    late_workers = set(late.tensorhub_status()["workers"])
    late.stop()
    good = fleet.pub.publish(fleet.versions.state(4))
    wait_sglang(fleet.sgl, good)
    wait_serving(fleet.vllm, good)
    with Replica(fleet.address, MODEL, name="lagging-peer") as peer:
        assert peer.pull(good) == good
        before = transfers(fleet.address, good)
        bad = latest_version(fleet.address) + 1
        (fleet.root / "fault-version").write_text(str(bad))
        try:
            assert fleet.pub.publish(fleet.versions.state(3)) == bad
            wait_for(lambda: "restored the version it served before" in str(
                fleet.sgl.request("/tensorhub/status")["ranks"][0].get("error")),
                timeout=120, what="SGLang restoring the version it served before")
            # the scheduler reported it; the driver then puts SGLang's label back
            wait_for(lambda: sglang_version(fleet.sgl) == str(good), timeout=30,
                     what="SGLang's weight_version back on the version it serves")
            status = fleet.sgl.request("/tensorhub/status")
            assert status["serving_version"] == good and status["torn"] is None
            assert fleet.sgl.greedy(fleet.prompts, TOKENS) == fleet.expected[3]
            [worker] = status["workers"]
            again = [t for t in transfers(fleet.address, good) if t not in before]
            restored_from = {t.source for t in again if t.reader == worker}
            # from a peer that held it and is still there (an engine, the lagging peer)
            peers = ({t.reader for t in before} | {"lagging-peer"}) - {worker} - late_workers
            assert restored_from and restored_from <= peers, (restored_from, before)
        finally:
            (fleet.root / "fault-version").unlink()
    after = fleet.pub.publish(fleet.versions.state(2))
    wait_sglang(fleet.sgl, after)
    assert fleet.sgl.greedy(fleet.prompts, TOKENS) == fleet.expected[1]


def test_a_sparse_step_reaches_sglang_and_vllm_as_a_patch_and_they_match_hf(fleet):
    from integration.tiny_model import hf_greedy
    from tensorhub.core.patch import patch_model

    base = fleet.pub.publish(fleet.versions.state(1))  # a whole version: a dense change
    wait_sglang(fleet.sgl, base)
    wait_serving(fleet.vllm, base)
    step = sparse_step(fleet.versions.state(1), seed=1)
    expected = hf_greedy(fleet.versions.dir, fleet.prompts, TOKENS, state_dict=step)
    version = fleet.pub.publish(step)
    assert fleet.pub.last_patch.version == version
    wait_sglang(fleet.sgl, version)
    wait_serving(fleet.vllm, version)
    assert fleet.sgl.greedy(fleet.prompts, TOKENS) == expected
    assert fleet.vllm.greedy(fleet.prompts, TOKENS) == expected
    patched = transfers(fleet.address, version, model=patch_model(MODEL))
    assert {t.reader.split("-")[0] for t in patched} == {"sglang", "vllm"}, patched
    assert not transfers(fleet.address, version)  # neither pulled the version whole


def _checksums(server: SGLangServer) -> tuple[str, dict[str, str]]:
    """SGLang's checksum of its live parameters: the engine's, and each tensor's."""
    r = server.request("/weights_checker", {"action": "checksum"}, timeout=120)
    [rank] = r["ranks"]  # (one TP rank)
    return r["per_engine_checksum"], rank["checksums"]


def _vllm_live(server: VLLMServer, prefix) -> dict[str, str]:
    """vLLM's live parameters (one rank), each tensor's checksum."""
    from safetensors.torch import load_file

    from tensorhub.core.checksum import checksum

    [rank] = server.dump_live_weights(prefix)
    try:
        return {n: checksum(t) for n, t in load_file(rank["path"]).items()}
    finally:
        Path(rank["path"]).unlink()


def test_a_sparse_step_is_installed_sparse_and_byte_equal_to_a_whole_install(fleet):
    """A 1 %-density step that reaches an engine as a patch is written into its live
    parameters word by word (each compared the new version with them before the pause);
    their checksums then equal those after a whole install of the same bytes: SGLang's
    own, and vLLM's live parameters read back (its CPU twin of a GPU's weights, which keep
    the checkpoint's layout)."""
    base = fleet.pub.publish(fleet.versions.state(2))  # dense: installed whole
    wait_sglang(fleet.sgl, base)
    wait_serving(fleet.vllm, base)
    step = sparse_step(fleet.versions.state(2), seed=5)
    version = fleet.pub.publish(step)
    assert fleet.pub.last_patch.version == version
    wait_sglang(fleet.sgl, version)
    rank = scheduler_status(fleet.sgl)
    assert (rank["applied"], rank["install"]) == (version, "sparse"), rank
    total = sum(t.numel() for t in step.values())
    assert 0 < rank["changed"] < 0.05 * total
    assert wait_serving(fleet.vllm, version)["last_update"]["install"] == "sparse"
    assert f"v{version} installed sparse" in fleet.vllm.log_tail(400)  # (the rank's word)
    sparse_sums = _checksums(fleet.sgl)
    sparse_tokens = fleet.sgl.greedy(fleet.prompts, TOKENS)
    vllm_sums = _vllm_live(fleet.vllm, fleet.root / "live")
    vllm_tokens = fleet.vllm.greedy(fleet.prompts, TOKENS)
    from integration.tiny_model import hf_greedy

    assert vllm_tokens == sparse_tokens == hf_greedy(fleet.versions.dir, fleet.prompts,
                                                     TOKENS, state_dict=step)
    # the same bytes again, installed whole: from a version far from them (dense change)
    dense = fleet.pub.publish(fleet.versions.state(3))
    wait_sglang(fleet.sgl, dense)
    wait_serving(fleet.vllm, dense)
    assert _vllm_live(fleet.vllm, fleet.root / "live") != vllm_sums
    again = fleet.pub.publish(step)
    wait_sglang(fleet.sgl, again)
    rank = scheduler_status(fleet.sgl)
    assert (rank["applied"], rank["install"]) == (again, "whole"), rank
    assert _checksums(fleet.sgl) == sparse_sums
    assert fleet.sgl.greedy(fleet.prompts, TOKENS) == sparse_tokens
    assert wait_serving(fleet.vllm, again)["last_update"]["install"] == "whole"
    assert _vllm_live(fleet.vllm, fleet.root / "live") == vllm_sums
    assert fleet.vllm.greedy(fleet.prompts, TOKENS) == vllm_tokens


def test_a_client_streams_through_twenty_updates_without_a_failed_request(fleet):
    """Requests in flight are kept through every swap (the default pause, `keep`: SGLang's
    `retract`): none fails or is aborted; every answer says which version produced which of
    its tokens (`weight_versions` on its last chunk); the tokens each version produced are
    HF's on that version, the ones after a swap continuing the prefix the old one made
    (their KV recomputed with the new weights)."""
    from integration.stream_client import StreamingClients
    from integration.tiny_model import hf_greedy

    published: dict[int, int] = {}  # version -> which of `fleet.versions` it is
    with StreamingClients(fleet.sgl.url, fleet.prompts, TOKENS, clients=2) as clients:
        for i in range(20):
            k = i % 3 + 2  # versions 2, 3, 4 in turn: every swap changes the tokens
            version = fleet.pub.publish(fleet.versions.state(k))
            published[version] = k
            wait_sglang(fleet.sgl, version)
        answers = clients.stop()
    assert answers and all(a.ok for a in answers), [
        (a.error, a.finish_reason) for a in answers if not a.ok]
    assert fleet.sgl.tensorhub_status()["last_update"]["pause_mode"] == "keep"
    crossed = []
    for a in answers:
        assert a.spans and len(a.token_ids) == TOKENS, a
        assert a.spans[0]["start"] == 0 and a.spans[-1]["end"] == TOKENS, a.spans
        assert all(x["end"] == y["start"] for x, y in itertools.pairwise(a.spans))
        prompt = fleet.prompts.index(a.prompt)
        for span in a.spans:
            if span["version"] not in published:
                continue  # a version served before this test
            k = published[span["version"]]
            if span["start"] == 0:  # from the prompt: HF's greedy tokens on that version
                assert a.token_ids[:span["end"]] == fleet.expected[k - 1][prompt][
                    :span["end"]], (a.spans, k)
            else:
                crossed.append((a, span, k))
    assert crossed, "no answer was in flight through a swap"
    for a, span, k in crossed[:3]:  # after a swap: HF on the new version, from the prefix
        [hf] = hf_greedy(fleet.versions.dir, [a.prompt + a.token_ids[:span["start"]]],
                         span["end"] - span["start"], state_dict=fleet.versions.state(k),
                         skip_ties=True)
        if hf is not None:
            assert a.token_ids[span["start"]:span["end"]] == hf, (a.spans, k)
    wait_serving(fleet.vllm, max(published))


def test_openai_answers_carry_the_version_spans_streaming_and_not(fleet):
    """`/v1/completions` and `/v1/chat/completions`, streaming or not: each choice says
    which version produced its tokens."""
    import json

    serving = fleet.sgl.tensorhub_status()["serving_version"]
    span = [{"version": serving, "start": 0, "end": 8}]
    completion = {"model": "default", "prompt": fleet.prompts[0], "max_tokens": 8,
                  "temperature": 0, "ignore_eos": True, "n": 1}
    chat = {"model": "default", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        answer = fleet.sgl.request(route, body)
        assert [c["weight_versions"] for c in answer["choices"]] == [span], answer
        req = urllib.request.Request(fleet.sgl.url + route,
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        last = None
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        if choice.get("finish_reason"):
                            last = choice
        assert last is not None and last["weight_versions"] == span, last


def test_keep_kv_keeps_requests_through_a_swap_and_never_serves_an_older_cached_prompt(
        fleet, sglang_python):
    """`TENSORHUB_PAUSE=keep_kv` (SGLang's `in_place`, the radix cache not flushed): requests
    in flight keep their KV and none fails; requests are salted by swap epoch, so a prompt
    cached before the swap is computed again after it, with the new weights."""
    from integration.kept_kv import check_keep_kv

    engine = SGLangServer(sglang_python, fleet.versions.dir,
                          env={**sglang_env(fleet.address), "TENSORHUB_MODEL": "kept-kv",
                               "TENSORHUB_PAUSE": "keep_kv"},
                          extra_args=["--custom-weight-loader", LOADER,
                                      "--enable-cache-report"],
                          log_path=fleet.root / "kept-kv.log")
    with engine:
        check_keep_kv(engine, fleet.address, fleet.versions.dir, fleet.versions.state(1),
                      fleet.versions.state(2), lambda v: wait_sglang(engine, v),
                      fleet.prompts, TOKENS)
