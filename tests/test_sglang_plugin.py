"""The SGLang plugin's naming and status files, without SGLang: what the main process and
its schedulers agree on through the environment, across hosts and launches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorhub.engines.auth import authorized
from tensorhub.engines.settings import EngineSettings
from tensorhub_plugins.sglang import naming
from tensorhub_plugins.sglang.driver import Driver
from tensorhub_plugins.sglang.naming import (
    INSTANCE_ENV,
    STATUS_DIR_ENV,
    instance_name,
    native_worker_name,
    start_instance,
    status_path,
    worker_name,
    write_json,
)
from tensorhub_plugins.sglang.plugin import _before_self_kill, is_server_main
from tensorhub_plugins.sglang.status import Memory, SchedulerStatus
from tensorhub_plugins.sglang.worker import Scheduler

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = EngineSettings(coordinator="tcp://127.0.0.1:1")


@pytest.fixture(autouse=True)
def fresh_env():
    """Each test starts as a fresh launch: no instance inherited; whatever the test's
    `start_instance` exports is undone (its directory is removed at exit, as in SGLang)."""
    saved = {k: os.environ.pop(k, None) for k in (INSTANCE_ENV, STATUS_DIR_ENV)}
    yield
    for key, value in saved.items():
        os.environ.pop(key, None)
        if value is not None:
            os.environ[key] = value


def launch_on(monkeypatch, host: str, port: int = 30000,
              settings: EngineSettings = SETTINGS) -> tuple[str, str]:
    """`start_instance` as the main process of a server on machine `host` does it."""
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    for key in (INSTANCE_ENV, STATUS_DIR_ENV):
        os.environ.pop(key, None)
    return start_instance(settings, port)


def in_scheduler(code: str) -> str:
    """Run `code` in a child process that inherits this one's environment, as SGLang's
    scheduler processes do; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", code], env=env, check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()


def test_two_hosts_with_the_same_host_and_port_flags_get_different_names(monkeypatch):
    a, _ = launch_on(monkeypatch, "node-a")
    b, _ = launch_on(monkeypatch, "node-b")
    assert a.startswith("sglang-node-a:30000-") and b.startswith("sglang-node-b:30000-")
    assert worker_name(a, 0) != worker_name(b, 0)
    assert "0.0.0.0" not in a


def test_two_launches_on_one_host_get_different_names_and_status_dirs(monkeypatch):
    (a, dir_a), (b, dir_b) = launch_on(monkeypatch, "node"), launch_on(monkeypatch, "node")
    assert a != b and a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0] == "sglang-node:30000"
    assert dir_a != dir_b


def test_a_configured_name_is_the_base(monkeypatch):
    name, _ = launch_on(monkeypatch, "node", settings=SETTINGS.model_copy(
        update={"name": "policy-a"}))
    assert name.startswith("policy-a-") and len(name) == len("policy-a-") + 4
    assert native_worker_name(name, 1) == f"{name}-tp1-native"


def test_schedulers_agree_with_the_main_process_without_talking(monkeypatch):
    name, status_dir = launch_on(monkeypatch, "node-a")
    # A scheduler process (rank 1 of a TP group): what it reads from the inherited
    # environment, knowing only its settings, its port and its rank.
    out = in_scheduler("from tensorhub.engines.settings import EngineSettings\n"
                       "from tensorhub_plugins.sglang import naming\n"
                       "s = EngineSettings(coordinator='tcp://127.0.0.1:1')\n"
                       "i = naming.instance_name(s, 30000)\n"
                       "print(naming.worker_name(i, 1), naming.status_path(1))")
    assert out.split() == [worker_name(name, 1), os.path.join(status_dir, "tp1.json")]
    assert instance_name(SETTINGS, 30000) == name  # and in the main process itself


def test_a_scheduler_without_a_server_main_names_itself_and_writes_no_status(caplog):
    name = instance_name(SETTINGS, 30000)
    assert name.startswith(f"sglang-{socket.gethostname()}:30000-")
    assert instance_name(SETTINGS, 30000) == name  # stable within the process
    assert status_path(0) is None
    assert "no TENSORHUB_SGLANG_INSTANCE" in caplog.text


def test_the_status_dir_is_private_to_the_instance_and_not_keyed_by_port(monkeypatch):
    _, status_dir = launch_on(monkeypatch, "node")
    assert os.path.basename(status_dir).startswith("tensorhub-sglang-")
    assert "30000" not in status_dir
    assert os.stat(status_dir).st_mode & 0o777 == 0o700  # mkdtemp: only this user
    assert status_path(3) == os.path.join(status_dir, "tp3.json")
    write_json(status_path(0), {"applied": 2})
    assert json.loads(Path(status_path(0)).read_text()) == {"applied": 2}
    assert os.listdir(status_dir) == ["tp0.json"]  # no temporary file left behind


def test_the_status_dir_is_removed_when_the_main_process_exits():
    status_dir = in_scheduler(
        "from tensorhub.engines.settings import EngineSettings\n"
        "from tensorhub_plugins.sglang import naming\n"
        "_, d = naming.start_instance(EngineSettings(coordinator='tcp://127.0.0.1:1'), 1)\n"
        "naming.write_json(naming.status_path(0), {})\n"
        "print(d)")
    assert status_dir.startswith(os.path.join(naming.tempfile.gettempdir(), "tensorhub-"))
    assert not os.path.exists(status_dir)


def test_the_driver_reports_its_ranks_from_the_private_dir(monkeypatch):
    name, _ = launch_on(monkeypatch, "node")
    driver = Driver(SETTINGS, "0.0.0.0", 30000, 2, name)
    try:
        assert driver.url == "http://127.0.0.1:30000"
        assert driver.names == [f"{name}-tp0", f"{name}-tp1"]
        SchedulerStatus(applied=3, memory=Memory(compact_bytes=10)).write(0)
        SchedulerStatus(applied=3, memory=Memory(compact_bytes=5), params_moved=False).write(1)
        status = driver.status()
        # Manual mode (no follow thread): the version every rank applied.
        assert status["serving_version"] == 3 and status["name"] == name
        assert status["native_workers"] == [f"{name}-tp0-native", f"{name}-tp1-native"]
        assert status["memory"] == {"compact_bytes": 15, "checkpoint_copy_bytes": 0}
        driver.following = True  # following: only what the driver itself swapped to
        assert driver.status()["serving_version"] is None
    finally:
        driver.fleet.close()


def test_across_nodes_the_ranks_report_to_node_0s_driver_through_the_engine_store(
        monkeypatch):
    """An engine on several nodes: a rank on another node has no directory the driver reads.
    Every rank reports through the engine's store (hosted by global rank 0, whose address
    rank 0 leaves in node 0's status directory), and the driver on node 0 reads them there;
    before rank 0 has said where the store is, every rank reads as "no status yet"."""
    import torch.distributed as dist

    from tensorhub.core.net import free_port
    from tensorhub_plugins.sglang.reports import StoreReports, publish_store_address

    name, _ = launch_on(monkeypatch, "node0")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    driver = Driver(SETTINGS, "0.0.0.0", 30000, 2, name, nodes=2)
    try:
        assert [s.error for s in driver.applied()] == ["no status yet"] * 2
        for rank in (0, 1):  # (rank 1 on node 1: its own directory, nobody reads it)
            scheduler = Scheduler(SETTINGS, rank, False, name,
                                  reports=StoreReports(store, name))
            scheduler.applied = 5
            scheduler.record()
        assert not os.path.exists(status_path(1))  # nothing in a local directory
        publish_store_address(store)  # rank 0, beside the driver
        states = driver.applied()
        assert [(s.applied, s.name) for s in states] == [(5, f"{name}-tp0"),
                                                          (5, f"{name}-tp1")]
        assert driver.status()["serving_version"] == 5
        # another instance (a restart) reads none of these reports
        other = Driver(SETTINGS, "0.0.0.0", 30000, 2, name + "x", nodes=2)
        try:
            assert [s.error for s in other.applied()] == ["no status yet"] * 2
        finally:
            other.fleet.close()
    finally:
        driver.fleet.close()
        del store


def test_a_scheduler_and_the_driver_share_one_typed_status(monkeypatch):
    """The scheduler writes its `SchedulerStatus`; the driver reads the same model back,
    and a file it cannot read as one counts as no status."""
    name, _ = launch_on(monkeypatch, "node")
    scheduler = Scheduler(SETTINGS, 1, False, name)
    scheduler.applied, scheduler.last = 4, {"path": "checkpoint", "sources": ["peer"],
                                            "apply_ms": 2.5}
    scheduler.record("a reason")
    Path(status_path(0)).write_text("{not json")
    driver = Driver(SETTINGS, "0.0.0.0", 30000, 2, name)
    try:
        unread, status = driver.applied()
        assert unread == SchedulerStatus(error="no status yet")
        assert (status.applied, status.error, status.name, status.native_name) == (
            4, "a reason", f"{name}-tp1", f"{name}-tp1-native")
        assert (status.path, status.sources, status.torn) == ("checkpoint", ["peer"], False)
    finally:
        driver.fleet.close()


@pytest.mark.parametrize(("argv", "process", "main"), [
    (["/v/lib/python3.11/site-packages/sglang/launch_server.py", "--port", "1"],
     "MainProcess", True),
    (["/v/bin/sglang", "serve", "--model-path", "m"], "MainProcess", True),
    (["/v/bin/sglang", "generate"], "MainProcess", False),
    (["/v/lib/python3.11/site-packages/sglang/launch_server.py"], "SpawnProcess-1", False),
    (["train.py"], "MainProcess", False),  # SGLang embedded as sglang.Engine
])
def test_only_the_server_main_process_starts_the_driver(monkeypatch, argv, process, main):
    monkeypatch.setattr("multiprocessing.current_process",
                        lambda: type("P", (), {"name": process})())
    assert is_server_main(argv) is main


def test_routes_take_the_tensorhub_token_as_a_bearer_token(monkeypatch, tmp_path):
    for key in ("TENSORHUB_TOKEN", "TENSORHUB_TOKEN_FILE", "TENSORHUB_HTTP_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TENSORHUB_TOKEN", "s3cret")
    for host in ("10.0.0.7", "127.0.0.1"):
        assert authorized("Bearer s3cret", host)
        assert not authorized(None, host) and not authorized("Bearer wrong", host)
    monkeypatch.delenv("TENSORHUB_TOKEN")
    monkeypatch.setenv("TENSORHUB_TOKEN_FILE", str(tmp_path / "missing"))
    assert not authorized("Bearer anything", "127.0.0.1")  # unreadable: fails closed


def test_with_no_token_set_the_routes_answer_this_host_only(monkeypatch):
    for key in ("TENSORHUB_TOKEN", "TENSORHUB_TOKEN_FILE", "TENSORHUB_HTTP_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for host in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1", "localhost"):
        assert authorized(None, host), host
    for host in ("10.0.0.7", "192.168.1.2", "::ffff:10.0.0.7", "2001:db8::1", "", None):
        assert not authorized(None, host), host
        assert not authorized("Bearer anything", host), host


def test_the_driver_shows_sglangs_api_key_on_every_call(monkeypatch):
    seen = []

    class Reply:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return b"{}"

    def urlopen(req, timeout):
        seen.append(req.headers.get("Authorization"))
        return Reply()

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    driver = Driver(SETTINGS, "127.0.0.1", 30000, 1, "i", api_key="sk-engine")
    driver._post("/pause_generation", {})
    driver._get("/get_model_info")
    assert seen == ["Bearer sk-engine", "Bearer sk-engine"]


def test_the_status_dir_goes_before_sglang_sigkills_its_own_main_process(monkeypatch):
    _, status_dir = launch_on(monkeypatch, "node")
    _before_self_kill(os.getpid() + 1, True)  # another process's tree: not ours to remove
    _before_self_kill(os.getpid(), False)  # children only: this process lives on (atexit)
    assert os.path.isdir(status_dir)
    _before_self_kill(os.getpid(), include_parent=True)
    assert not os.path.exists(status_dir)


def test_an_engine_no_other_shares_a_layout_with_updates_at_once(monkeypatch, coordinator):
    """No worker holds our native layout: waiting for a native peer would only delay the
    first version (by `NATIVE_WAIT`), so the checkpoint path is taken at once. Once another
    engine holds any version in that layout, a new version waits for it."""
    from tensorhub import Publisher, Replica

    state = {"w": torch.arange(4.0)}
    name, _ = launch_on(monkeypatch, "node")
    settings = EngineSettings(coordinator=coordinator.address, model="policy")
    driver = Driver(settings, "0.0.0.0", 30000, 1, name)
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(state)
        peer_layout = "fedcba9876543210fedcba98"
        SchedulerStatus(native_name=f"{name}-tp0-native", native_layout=peer_layout).write(0)
        try:
            assert driver.next_update() == (1, "checkpoint")
            with Replica(coordinator.address, "policy", transport="zmq",
                         name="other-engine-tp0-native",
                         labels={"layout": peer_layout}) as other:
                # Another engine's native worker of our layout, holding nothing yet (it
                # may be applying a version): worth waiting for.
                assert driver.next_update() is None
                other.pull(timeout=10)  # holds v1 in the layout we now claim as ours
                SchedulerStatus(native_name=f"{name}-tp0-native",
                                native_layout=other.layout.layout_id).write(0)
                # v2 in another layout: nobody holds it in ours yet, but the other engine
                # may soon (its own native path): wait for it
                pub.publish({"w": torch.arange(4.0) + 1, "b": torch.zeros(2)})
                assert driver.next_update() is None
        finally:
            driver.fleet.close()


def test_the_default_pause_keeps_requests_and_no_mode_maps_to_a_drain_sglang_lacks():
    from tensorhub_plugins.sglang.driver import PAUSE_MODES

    assert EngineSettings(coordinator="tcp://127.0.0.1:1").pause == "keep"
    assert PAUSE_MODES == {"keep": "retract", "keep_kv": "in_place", "wait": "retract",
                           "abort": "abort"}


def test_version_spans_go_on_the_choice_a_stream_chunk_finishes():
    from tensorhub_plugins.sglang.spans import spans_of, with_spans

    meta = {"weight_versions": [{"version": "3", "start": 0, "end": 5},
                                {"version": "default", "start": 5, "end": 7}]}
    spans = spans_of(meta)
    assert spans == [{"version": 3, "start": 0, "end": 5},
                     {"version": "default", "start": 5, "end": 7}]
    assert spans_of({"weight_version": "3"}) is None
    going = 'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
    assert with_spans(going, {0: spans}) == going
    done = json.loads(with_spans(
        'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n',
        {0: spans})[len("data: "):])
    assert done["choices"][0]["weight_versions"] == spans
    assert with_spans("data: [DONE]\n\n", {0: spans}) == "data: [DONE]\n\n"


def test_keep_kv_is_refused_where_some_requests_could_not_be_salted():
    from tensorhub_plugins.sglang.salt import why_not

    assert "--tokenizer-worker-num 2" in why_not(2)


def test_a_model_sglang_padded_for_its_tp_size_takes_no_tiled_share():
    """On CPU SGLang pads heads (and intermediate sizes) its TP size does not divide and
    keeps the sizes it replaced as `original_*`: its ranks' rows are then not an even
    split, so its copies pull every part of a version in tiles."""
    from types import SimpleNamespace

    from tensorhub_plugins.sglang.worker import tp_reshaped

    assert not tp_reshaped(SimpleNamespace(num_attention_heads=4, num_key_value_heads=4,
                                           original_num_attention_heads=4,
                                           original_total_num_kv_heads=4))
    assert tp_reshaped(SimpleNamespace(num_attention_heads=8, num_key_value_heads=4,
                                       original_num_attention_heads=4,
                                       original_total_num_kv_heads=2))
    assert tp_reshaped(SimpleNamespace(num_attention_heads=4, num_key_value_heads=4,
                                       intermediate_size=256, original_intermediate_size=200))


def test_the_resume_ends_at_the_front_ends_first_output_after_it(monkeypatch):
    """The stall ends where clients get tokens again: the front end's first message from
    the scheduler after `/continue_generation`, not round trips to the scheduler."""
    import asyncio
    import threading
    import time

    driver = Driver(SETTINGS, "127.0.0.1", 30000, 1, "i")
    received = [time.time() - 60.0]  # (the outputs from before the pause)
    calls = []
    monkeypatch.setattr(driver, "_post", lambda path, body, timeout=None: calls.append(path))
    monkeypatch.setattr(driver, "_get", lambda path, timeout=None: calls.append(path))
    monkeypatch.setattr(driver, "in_flight", lambda: 2)
    monkeypatch.setattr(driver, "_front_end_received", lambda: lambda: received[0])
    timer = threading.Timer(0.2, lambda: received.__setitem__(0, time.time()))
    timer.start()
    before = time.time()
    asyncio.run(driver.resume())
    assert received[0] > before  # (it returned once the output came, not before)
    assert calls == ["/continue_generation"]
    timer.join()


def test_the_resume_waits_for_an_output_only_of_a_request_streamed_every_step():
    """SGLang sends a request that is not streamed its tokens every 50 steps or at its end,
    one streamed at an interval of n every n steps: their next output is no sign of the
    next step, and the resume then ends after two round trips to the scheduler."""
    from types import SimpleNamespace as Request

    from tensorhub_plugins.sglang.driver import _streams_every_step

    assert _streams_every_step(Request(stream=True, sampling_params={}), default=1)
    assert not _streams_every_step(Request(stream=False, sampling_params={}), default=1)
    assert not _streams_every_step(Request(stream=True, sampling_params={}), default=4)
    assert not _streams_every_step(
        Request(stream=True, sampling_params={"stream_interval": 8}), default=1)
    driver = Driver(SETTINGS, "127.0.0.1", 30000, 1, "i")
    calls = []
    driver._post = lambda path, body, timeout=None: calls.append(path)
    driver._get = lambda path, timeout=None: calls.append(path)
    driver.in_flight = lambda: 1
    driver._front_end_received = lambda: None
    import asyncio

    asyncio.run(driver.resume())
    assert calls == ["/continue_generation", "/server_info", "/server_info"]


def test_the_pause_opens_the_update_session_as_its_round_trip_to_the_scheduler():
    """SGLang answers `/pause_generation` before its scheduler takes the pause; the
    weight-update session, which the scheduler opens only after the pause, is the proof
    that generation has stopped, so no other round trip is spent in the stall. The install
    then writes and closes it; an install without a pause (torn weights repaired) opens
    its own."""
    import asyncio

    driver = Driver(SETTINGS, "127.0.0.1", 30000, 1, "i")
    calls = []
    driver._post = lambda path, body, timeout=None: calls.append(path) or {}
    driver._get = lambda path, timeout=None: calls.append(path) or {}
    driver.applied = lambda: [SchedulerStatus(applied=3, path="checkpoint")]
    asyncio.run(driver.pause())
    asyncio.run(driver.install(3, "checkpoint", fetch=False))
    assert calls == ["/pause_generation", "/begin_weight_update",
                     "/update_weights_from_tensor", "/end_weight_update"]
    calls.clear()
    asyncio.run(driver.install(3, "checkpoint", fetch=False))
    assert calls == ["/begin_weight_update", "/update_weights_from_tensor",
                     "/end_weight_update"]


def test_what_became_of_a_refused_version_reaches_the_driver_typed(monkeypatch):
    """A scheduler whose loader refused a version reports the install's outcome as a field
    of its status, not as words to parse: the driver refuses that version before the next
    pause when the model cannot load it, and says the weights were restored when a load
    that failed half-way was undone."""
    import asyncio

    from tensorhub.engines import InstallFailed, LoadOutcome

    name, _ = launch_on(monkeypatch, "node")
    scheduler = Scheduler(SETTINGS, 0, False, name)
    driver = Driver(SETTINGS, "127.0.0.1", 30000, 1, name)
    try:
        unloadable = LoadOutcome(kind="unloadable", version=3, reason="v3 has no lm_head")
        scheduler.refused(InstallFailed(unloadable))
        (state,) = driver.applied()
        assert (state.error, state.outcome) == ("v3 has no lm_head", unloadable)
        with pytest.raises(InstallFailed) as caught:
            asyncio.run(driver.check(3))
        assert caught.value.outcome == unloadable
        asyncio.run(driver.check(4))  # (another version: not refused before the pause)

        restored = LoadOutcome(kind="restored", version=4, reason="rank 0 failed half-way")
        scheduler.refused(InstallFailed(restored))
        driver._post = lambda path, body, timeout=None: {}
        with pytest.raises(InstallFailed) as caught:
            asyncio.run(driver.install(4, "checkpoint", fetch=False))
        assert caught.value.outcome == restored
    finally:
        driver.fleet.close()


def test_no_weight_update_session_outlives_a_swap():
    """A session left open (a begin whose answer never came, though the scheduler took it)
    would refuse every later begin: it is closed and opened again; a begin that fails is
    followed by an end; a resume after a pause whose install never ran closes it."""
    import asyncio
    import urllib.error

    driver = Driver(SETTINGS, "127.0.0.1", 30000, 1, "i")
    calls, answers = [], {}

    def post(path, body, timeout=None):
        calls.append(path)
        answer = answers.get(path, [])
        if answer and (error := answer.pop(0)) is not None:
            raise error
        return {}

    driver._post = post
    driver.in_flight = lambda: 0
    open_already = urllib.error.HTTPError("u", 400, "a session is already open", {}, None)
    answers["/begin_weight_update"] = [open_already]
    asyncio.run(driver.pause())
    assert calls == ["/pause_generation", "/begin_weight_update", "/end_weight_update",
                     "/begin_weight_update"]
    asyncio.run(driver.resume())  # (the install never ran)
    assert calls[4:] == ["/end_weight_update", "/continue_generation"]

    calls.clear()
    answers["/begin_weight_update"] = [TimeoutError("timed out")]
    with pytest.raises(TimeoutError):
        asyncio.run(driver.pause())
    assert calls == ["/pause_generation", "/begin_weight_update", "/end_weight_update"]
    assert not driver._session_open
