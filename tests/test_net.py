"""Defaults that reach other hosts: UCX settings by what the host has, addresses peers can
connect to, topology labels from where a worker runs."""

from __future__ import annotations

import pytest

from tensorhub.core import net as net_mod
from tensorhub.core import topology
from tensorhub.core.net import local_address_towards, reachable_announce, ucx_defaults


def _sysfs(tmp_path, nets: dict[str, str], rdma: list[str] = ()):
    net, ib = tmp_path / "net", tmp_path / "ib"
    for name, state in nets.items():
        (net / name).mkdir(parents=True)
        (net / name / "operstate").write_text(state + "\n")
    for name in rdma:
        (ib / name).mkdir(parents=True)
    return net, ib


def test_a_fleet_on_one_host_uses_loopback(tmp_path):
    net, ib = _sysfs(tmp_path, {"lo": "unknown", "eth0": "up"})
    assert ucx_defaults(host="127.0.0.1", sys_net=net, sys_ib=ib, dev=tmp_path) == \
        {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,cma", "UCX_TCP_CONN_NB": "y"}


def test_a_gpu_host_gets_a_transport_that_reaches_gpu_memory(tmp_path):
    """NIXL refuses to create its UCX backend on a host with NVIDIA GPUs when UCX_TLS has no
    CUDA transport (seen on an H200: "Invalid UCX_TLS=tcp,cma ... Add cuda_copy")."""
    net, ib = _sysfs(tmp_path, {"lo": "unknown"})
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    assert ucx_defaults(host="127.0.0.1", sys_net=net, sys_ib=ib, dev=tmp_path)["UCX_TLS"] \
        == "tcp,cma,cuda_copy"
    assert ucx_defaults(True, host="127.0.0.1", sys_net=net, sys_ib=ib, dev=tmp_path)[
        "UCX_TLS"] == "tcp,cma,cuda_copy,cuda_ipc"


def test_across_hosts_ucx_uses_the_interface_towards_the_coordinator(tmp_path, monkeypatch):
    monkeypatch.setattr(net_mod, "interface_of", lambda address: {"10.0.0.5": "ens5"}.get(address))
    net, ib = _sysfs(tmp_path, {"lo": "unknown", "eth0": "up", "ens5": "up"})
    assert ucx_defaults(host="10.0.0.5", sys_net=net, sys_ib=ib)["UCX_NET_DEVICES"] == "ens5"
    # an address no interface holds (NAT, an override): every interface that is up
    assert ucx_defaults(host="203.0.113.9", sys_net=net, sys_ib=ib)["UCX_NET_DEVICES"] == \
        "ens5,eth0"


def test_rdma_hosts_keep_ucx_s_own_transport_choice(tmp_path):
    net, ib = _sysfs(tmp_path, {"lo": "unknown", "ib0": "up"}, rdma=["mlx5_0"])
    assert ucx_defaults(host="10.0.0.5", sys_net=net, sys_ib=ib) == {"UCX_TCP_CONN_NB": "y"}


def test_the_loopback_interface_holds_127_0_0_1():
    assert net_mod.interface_of("127.0.0.1") == "lo"


def test_a_wildcard_announcement_becomes_the_address_the_client_used():
    assert reachable_announce("tcp://0.0.0.0:5556", "tcp://10.1.2.3:5555") == \
        "tcp://10.1.2.3:5556"
    assert reachable_announce("tcp://*:5556", "tcp://coord.local:5555") == \
        "tcp://coord.local:5556"
    assert reachable_announce("tcp://10.9.9.9:7", "tcp://10.1.2.3:5555") == "tcp://10.9.9.9:7"


def test_the_advertised_address_is_loopback_for_a_loopback_coordinator(monkeypatch):
    monkeypatch.delenv("TENSORHUB_HOST_ADDRESS", raising=False)
    assert local_address_towards("tcp://127.0.0.1:5555") == "127.0.0.1"
    monkeypatch.setenv("TENSORHUB_HOST_ADDRESS", "10.0.0.7")
    assert local_address_towards("tcp://10.0.0.1:5555") == "10.0.0.7"


def test_labels_default_to_the_host_and_the_environment_and_code_override(monkeypatch):
    monkeypatch.setattr(topology.socket, "gethostname", lambda: "node-17")
    monkeypatch.setenv("TENSORHUB_LABELS", "dc=us-east, rack=r3")
    assert topology.worker_labels() == {"node": "node-17", "dc": "us-east", "rack": "r3"}
    assert topology.worker_labels({"dc": "eu"})["dc"] == "eu"
    monkeypatch.setenv("TENSORHUB_LABELS", "dc")
    with pytest.raises(ValueError, match="not key=value"):
        topology.worker_labels()
