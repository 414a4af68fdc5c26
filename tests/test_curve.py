"""ZeroMQ CURVE on the control plane with a keypair from `tensorhub keygen`: clients that
know the coordinator's public key and the token work end to end (requests and
announcements); a client missing either is refused in the handshake, with a clear error."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import zmq

from tensorhub import CoordinatorError, Publisher, Replica, settings
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core import curve
from tensorhub.core.announcements import VersionWatcher
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub.core.wire import decode_announcement
from tensorhub.tools.cli import main

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

TOKEN = "curve-test-token"
STATE = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(3)}


@pytest.fixture
def keys(tmp_path):
    public_path, secret_path = curve.write_keypair(tmp_path)
    return curve.read_key(public_path), curve.read_key(secret_path)


@pytest.fixture
def secured(keys, monkeypatch):
    """A coordinator with CURVE and a token; the environment of a well-configured client."""
    for var in (settings.CURVE_SERVER_KEY.name, settings.CURVE_SERVER_KEY_FILE.name,
                "TENSORHUB_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TENSORHUB_TOKEN", TOKEN)
    c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token=TOKEN,
                                      curve_secret=keys[1], heartbeat_interval=0.2,
                                      worker_ttl=5.0)).start()
    yield c
    c.stop()


def test_keygen_writes_a_private_secret_and_its_public_key(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path), "--name", "coord"]) == 0
    public = curve.read_key(tmp_path / "coord.key")
    secret = curve.read_key(tmp_path / "coord.key_secret")
    assert curve.public_key_of(secret) == public and public != secret
    assert stat.S_IMODE(os.stat(tmp_path / "coord.key_secret").st_mode) == 0o600
    out = capsys.readouterr().out
    assert "--curve-secret-file" in out
    assert f"{settings.CURVE_SERVER_KEY.name}='{public}'" in out  # quoted: Z85 has shell characters
    assert main(["keygen", "--out", str(tmp_path), "--name", "coord"]) == 2  # no overwrite
    assert curve.read_key(tmp_path / "coord.key_secret") == secret
    assert main(["keygen", "--out", str(tmp_path), "--name", "coord", "--force"]) == 0
    assert curve.read_key(tmp_path / "coord.key_secret") != secret


def test_a_malformed_key_is_refused_with_a_reason(tmp_path, monkeypatch):
    with pytest.raises(curve.CurveKeyError, match="not a CURVE key"):
        curve.check_key("too-short")
    monkeypatch.setenv(settings.CURVE_SERVER_KEY.name, "x" * 39 + "~")
    with pytest.raises(curve.CurveKeyError, match=settings.CURVE_SERVER_KEY.name):
        curve.server_key_from_env()
    with pytest.raises(curve.CurveKeyError, match="cannot read"):
        curve.read_key(tmp_path / "missing.key")


def test_with_the_server_key_publish_pull_and_announcements_work(secured, keys, monkeypatch):
    monkeypatch.setenv(settings.CURVE_SERVER_KEY.name, keys[0])
    assert secured.curve_public_key == keys[0]
    with Publisher(secured.address, "policy", transport="zmq") as pub, \
            Replica(secured.address, "policy", transport="zmq", name="eng") as rep:
        assert rep.session.client.curve_server_key == keys[0]
        watcher = VersionWatcher(rep.session, "policy")
        try:
            announced = None
            for version in range(1, 51):  # the SUB joins (CURVE handshake) at some point
                pub.publish(STATE, version=version)
                while announced is None and watcher._sub.poll(200):
                    heard = decode_announcement(watcher._sub.recv_multipart()[1])
                    if heard.model == "policy":  # (not its patch, announced before it)
                        announced = heard
                if announced is not None:
                    break
            assert announced is not None, "no announcement arrived over CURVE"
            assert announced.model == "policy" and announced.version == version
        finally:
            watcher.close()
        assert rep.pull(timeout=20) == version
        for name, t in STATE.items():
            assert torch.equal(rep.tensors[name], t)


def test_with_the_token_but_not_the_server_key_a_client_is_told_what_to_set(secured):
    client = CoordinatorClient(secured.address, timeout=1.0)
    assert client.token == TOKEN and client.curve_server_key != secured.curve_public_key
    with pytest.raises(CoordinatorError, match=settings.CURVE_SERVER_KEY.name) as err:
        client.call(StatusRequest())
    assert err.value.code == "unauthorized"
    client.close()


def test_a_wrong_server_key_is_refused(secured):
    impostor_key, _ = curve.generate_keypair()
    client = CoordinatorClient(secured.address, timeout=1.0, curve_server_key=impostor_key)
    with pytest.raises(CoordinatorError, match="refused our handshake") as err:
        client.call(StatusRequest())
    assert err.value.code == "unauthorized"
    client.close()


def test_the_server_key_alone_does_not_let_a_client_in_the_token_is_needed(secured, keys):
    """The server key is public (every worker has it): the coordinator admits only the
    keypair derived from the token, so a client with the key and a wrong token (or none)
    never completes a handshake."""
    for token in ("wrong", ""):
        outsider = CoordinatorClient(secured.address, token=token, curve_server_key=keys[0],
                                     timeout=1.0)
        with pytest.raises(CoordinatorError, match="TENSORHUB_TOKEN") as err:
            outsider.call(StatusRequest())
        assert err.value.code == "unauthorized"
        outsider.close()
    right = CoordinatorClient(secured.address, curve_server_key=keys[0], timeout=5.0)
    assert right.token == TOKEN and right.call(StatusRequest()).type == "status_reply"
    right.close()
    assert secured.gate.refused >= 2
