"""The emulated cluster: hosts reach each other, keep their own hostname and PID namespace,
are shaped to their rates, count what crosses the WAN, die as a whole, and leave nothing
behind. Skipped where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing.cluster import (
    Cluster,
    ClusterError,
    HostSpec,
    Traffic,
    namespaces,
    parse_rate,
    tcp_transfer,
)

needs_cluster = pytest.mark.skipif(namespaces.available() is not None,
                                   reason=str(namespaces.available()))

pytestmark = pytest.mark.slow  # (namespaces: not in the fast loop)

# What a program sees of the host it runs on.
WHOAMI = """
import json, os, socket, time
from tensorhub.core.transport.cma import host_identity

print(json.dumps({"hostname": socket.gethostname(), "pid_ns": os.readlink("/proc/self/ns/pid"),
                  "pid": os.getpid(), "cwd": os.getcwd(), "identity": host_identity(),
                  "links": sorted(os.listdir("/sys/class/net"))}), flush=True)
time.sleep(1000)
"""


def namespaces_of(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def root_veths() -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show", "type", "veth"], capture_output=True,
                         text=True, check=True).stdout
    return sorted(link["ifname"] for link in json.loads(out or "[]"))


def test_rates_parse_like_tc():
    assert parse_rate("800mbit") == 800_000_000
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("10kbit") == 10_000
    assert parse_rate(40e6) == 40_000_000
    assert parse_rate("1234") == 1234
    for bad in ("100mbps", "fast", "0mbit", "-1mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_unavailable_reason_is_none_or_says_why(monkeypatch):
    reason = namespaces.available()
    assert reason is None or (isinstance(reason, str) and reason)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in namespaces.available.__wrapped__()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(namespaces.shutil, "which", lambda name: None if name == "tc" else name)
    assert "tc" in namespaces.available.__wrapped__()


@needs_cluster
def test_hosts_reach_each_other_by_address():
    with Cluster(3, dcs=2) as c:
        assert [h.address for h in c.hosts] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        for src, dst in [(c.hosts[0], c.hosts[1]), (c.hosts[1], c.hosts[0]),
                         (c.hosts[0], c.hosts[2]), (c.hosts[2], c.hosts[1])]:
            result = tcp_transfer(src, dst, 1000)
            assert result["greeting"] == dst.name
            assert result["bytes"] == 1000


@needs_cluster
def test_programs_see_their_host_hostname_pid_namespace_and_cwd(tmp_path):
    with Cluster(2) as c:
        h0, h1 = c.hosts
        env = {"PYTHONPATH": os.getcwd()}
        a = h0.popen([sys.executable, "-c", WHOAMI], env=env, cwd=str(tmp_path))
        b = h0.popen([sys.executable, "-c", WHOAMI], env=env, cwd=str(tmp_path))
        other = h1.popen([sys.executable, "-c", WHOAMI], env=env, cwd=str(tmp_path))
        try:
            seen = {name: p.next_json(timeout=20) for name, p in
                    [("a", a), ("b", b), ("other", other)]}
            for name, proc in [("a", a), ("b", b), ("other", other)]:
                # .pid is the program itself, in the root namespace
                assert os.readlink(f"/proc/{proc.pid}/ns/pid") == seen[name]["pid_ns"]
                assert b"-c" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
                assert seen[name]["cwd"] == str(tmp_path)
                assert seen[name]["links"] == ["eth0", "lo"]
            assert seen["a"]["hostname"] == seen["b"]["hostname"] == "h0"
            assert seen["other"]["hostname"] == "h1"
            assert seen["a"]["pid_ns"] == seen["b"]["pid_ns"] != seen["other"]["pid_ns"]
            assert seen["a"]["pid_ns"] != os.readlink("/proc/self/ns/pid")
            assert seen["a"]["identity"] == seen["b"]["identity"] != seen["other"]["identity"]
            assert {seen["a"]["pid"], seen["b"]["pid"]} <= set(range(2, 100))  # init is 1
        finally:
            for p in (a, b, other):
                assert p.stop(timeout=5) is not None


@needs_cluster
def test_run_returns_output_and_status():
    with Cluster(1) as c:
        result = c.hosts[0].run(["sh", "-c", "hostname; echo oops >&2; exit 3"])
        assert (result.returncode, result.stdout, result.stderr) == (3, "h0\n", "oops\n")
        assert c.hosts[0].run(["cat"], input="through stdin").stdout == "through stdin"
        with pytest.raises(subprocess.CalledProcessError):
            c.hosts[0].run(["false"], check=True)
        with pytest.raises(subprocess.TimeoutExpired):
            c.hosts[0].run(["sh", "-c", "sleep 100 & sleep 100"], timeout=0.5)
        running = c.hosts[0].run(["sh", "-c", "cat /proc/[0-9]*/comm"]).stdout.split()
        assert "sleep" not in running and "sh" in running  # the timed-out group is gone


@needs_cluster
def test_threads_start_programs_on_different_hosts_at_once():
    """Which PID namespace a new process lands in is per thread: no crosstalk."""
    with Cluster(2) as c, ThreadPoolExecutor(4) as pool:
        jobs = [(h, pool.submit(h.run, ["hostname"])) for _ in range(6) for h in c.hosts]
        assert all(job.result().stdout == f"{h.name}\n" for h, job in jobs)
    assert os.readlink("/proc/self/ns/pid_for_children") == os.readlink("/proc/self/ns/pid")


@needs_cluster
@pytest.mark.parametrize("where", ["egress", "ingress", "wan"])
def test_shaped_link_carries_its_rate(where):
    """4 MB at 40 mbit/s: about 0.8 s. Goodput is below the rate by the headers tbf
    counts (66 of every 1514 bytes) and above it by the bucket's first burst."""
    rate = 40_000_000
    with Cluster(3, dcs=2) as c:
        h0, h1, h2 = c.hosts  # h0 and h1 in DC 0, h2 in DC 1
        dst = h1
        if where == "egress":
            h0.set_egress(rate)
        elif where == "ingress":
            h1.set_ingress(rate)
        else:
            c.set_wan(rate)
            dst = h2
        before = h0.traffic()
        result = tcp_transfer(h0, dst, 4_000_000)
        sent = (h0.traffic() - before).sent
        goodput = result["bytes"] * 8 / result["seconds"]
        print(f"{where}: {goodput / 1e6:.1f} mbit/s of {rate / 1e6:.0f} "
              f"({goodput / rate:.3f}); on the wire {sent * 8 / result['seconds'] / 1e6:.1f}")
        assert result["bytes"] == 4_000_000
        assert 0.7 * rate <= goodput <= 1.1 * rate
        assert 4_000_000 < sent < 4_400_000  # headers, and no retransmission to speak of


@needs_cluster
def test_unshaped_links_are_fast():
    with Cluster(2) as c:
        result = tcp_transfer(c.hosts[0], c.hosts[1], 50_000_000)
        assert result["bytes"] * 8 / result["seconds"] > 1e9


@needs_cluster
def test_wan_counters_count_only_what_crosses_between_dcs():
    with Cluster(4, dcs=2, wan="800mbit") as c:
        h0, h1, h2, _ = c.hosts
        assert [h.dc for h in c.hosts] == [0, 0, 1, 1]
        start = c.wan_traffic()
        tcp_transfer(h0, h1, 1_000_000)  # within DC 0
        assert c.wan_traffic() == start  # not one byte: no ARP, no flooding, no IPv6
        before_h0, before_h2 = h0.traffic(), h2.traffic()
        tcp_transfer(h0, h2, 1_000_000)  # DC 0 -> DC 1
        wan = c.wan_traffic() - start
        assert 1_000_000 < wan.received < 1_100_000  # into DC 1: data and headers
        assert 0 < wan.sent < 100_000  # out of DC 1: the greeting and acks
        assert wan.received == (h2.traffic() - before_h2).received
        assert wan.sent == (h0.traffic() - before_h0).received


@needs_cluster
def test_three_dcs_reach_each_other_through_dc0():
    with Cluster([HostSpec("a", 0), HostSpec("b", 1), HostSpec("c", 2)]) as c:
        assert c.dcs == 3
        result = tcp_transfer(c.host("b"), c.host("c"), 100_000)
        assert result["greeting"] == "c"
        assert c.wan_traffic(1).sent > 100_000  # out of DC 1 into DC 0 ...
        assert c.wan_traffic(2).received > 100_000  # ... and on into DC 2


@needs_cluster
def test_killing_a_host_ends_every_process_on_it():
    with Cluster(2) as c:
        h0, h1 = c.hosts
        # a program that starts a grandchild (which the host's init inherits when it exits)
        parent = h0.popen(["sh", "-c", "sleep 1000 & echo $!; exec sleep 1000"])
        other = h0.popen(["sleep", "1000"])
        survivor = h1.popen(["sleep", "1000"])
        assert parent.next_line(timeout=10).isdigit()
        children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        assert len(children) == 1
        grandchild = int(children[0])
        assert os.path.exists(f"/proc/{grandchild}")
        init = h0.init_pid
        h0.kill()
        assert parent.wait(timeout=5) == -signal.SIGKILL
        assert other.wait(timeout=5) == -signal.SIGKILL
        for pid in (grandchild, init):
            assert not os.path.exists(f"/proc/{pid}")
        assert not h0.alive and h1.alive
        assert survivor.proc.poll() is None
        with pytest.raises(ClusterError):
            h0.popen(["true"])
        assert isinstance(h0.traffic(), Traffic)  # its network stays
        assert survivor.stop(timeout=5) == -signal.SIGTERM


@needs_cluster
def test_a_host_shrugs_off_sigint_and_sigterm_and_a_prefix_is_never_shared():
    with Cluster(1) as c:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(c.hosts[0].init_pid, sig)  # a Ctrl-C reaches the init's process group
        time.sleep(0.2)
        assert c.hosts[0].alive
        assert c.hosts[0].run(["hostname"]).stdout == "h0\n"
        with pytest.raises(ClusterError, match="in use"):
            Cluster(1, prefix=c.prefix)
        assert len(namespaces_of(c.prefix)) == 2  # the refused one touched nothing


@needs_cluster
def test_close_leaves_nothing_even_after_an_exception():
    veths = root_veths()
    with pytest.raises(RuntimeError, match="boom"), Cluster(3, dcs=2) as c:
        prefix, inits = c.prefix, [h.init_pid for h in c.hosts]
        program = c.hosts[0].popen(["sleep", "1000"])
        assert len(namespaces_of(prefix)) == 4  # three hosts and the switch
        assert (namespaces.RECORDS / prefix).exists()
        raise RuntimeError("boom")
    assert namespaces_of(prefix) == []
    assert root_veths() == veths
    assert program.proc.poll() == -signal.SIGKILL
    assert not any(os.path.exists(f"/proc/{pid}") for pid in inits)
    assert not (namespaces.RECORDS / prefix).exists()
    c.close()  # idempotent


@needs_cluster
def test_failed_bring_up_removes_what_it_made(monkeypatch):
    def fail(self):
        assert len(namespaces_of(self.prefix)) == 3  # made, before failing
        raise ClusterError("halfway")

    monkeypatch.setattr(Cluster, "_pin_addresses", fail)
    prefix = f"thtest{os.getpid() % 10000}"
    with pytest.raises(ClusterError, match="halfway"):
        Cluster(2, prefix=prefix)
    assert namespaces_of(prefix) == []
    assert not (namespaces.RECORDS / prefix).exists()


@needs_cluster
def test_cleanup_stale_removes_a_killed_runs_cluster_and_spares_live_ones():
    creator = ChildProcess([sys.executable, "-c", "from tensorhub_testing.cluster import "
                            "Cluster; import time; c = Cluster(2); print(c.prefix, flush=True); "
                            "time.sleep(1000)"],
                           env={"PYTHONPATH": os.getcwd()}, name="creator")
    try:
        prefix = creator.next_line(timeout=30)
        assert len(namespaces_of(prefix)) == 3
        with Cluster(1) as live:
            assert namespaces.cleanup_stale(prefix) == []  # its creator still runs
            # SIGKILL to the creator alone: no teardown, its hosts' inits live on (a kill of
            # its whole process group would take them too)
            os.kill(creator.pid, signal.SIGKILL)
            creator.wait(timeout=10)
            assert len(namespaces_of(prefix)) == 3
            assert namespaces.clusters()[prefix] is False
            assert namespaces.cleanup_stale() == [prefix]  # the live one is spared
            assert namespaces_of(prefix) == []
            assert len(namespaces_of(live.prefix)) == 2
            assert live.hosts[0].run(["true"]).returncode == 0
    finally:
        creator.kill()


@needs_cluster
def test_cli_brings_a_cluster_up_and_down_on_sigterm():
    proc = ChildProcess([sys.executable, "-m", "tensorhub_testing.cluster", "up", "--hosts",
                         "2", "--dcs", "2", "--egress", "800mbit", "--wan", "80mbit"],
                        env={"PYTHONPATH": os.getcwd()}, name="cluster up")
    try:
        lines = []
        while not lines or not lines[-1].startswith("Ctrl-C"):
            lines.append(proc.next_line(timeout=30))
        prefix = lines[0].split()[1].rstrip(":")
        assert "WAN 80mbit" in lines[0]
        assert any("h1" in line and "dc1" in line and "10.213.0.2" in line and "800mbit" in
                   line for line in lines)
        assert any(line.strip().startswith("nsenter --target=") for line in lines)
        assert len(namespaces_of(prefix)) == 3
    finally:
        assert proc.stop(timeout=20) == 0
    assert namespaces_of(prefix) == []
    assert proc.next_line(timeout=5).endswith("torn down")


def test_cli_help_describes_up_and_down():
    out = subprocess.run([sys.executable, "-m", "tensorhub_testing.cluster", "up", "--help"],
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0
    for option in ("--hosts", "--dcs", "--egress", "--ingress", "--wan", "--subnet"):
        assert option in out.stdout


def test_the_product_imports_no_test_harness():
    """`tensorhub_testing` is not shipped: the package and its CLI must run without it."""
    probe = ("import sys, tensorhub, tensorhub.tools.cli, tensorhub.tools.demo, "
             "tensorhub.tools.child_process, tensorhub.tools.synthetic_weights; "
             "print(sorted(m for m in sys.modules if m.startswith('tensorhub_testing')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    commands = subprocess.run([sys.executable, "-m", "tensorhub.tools.cli", "--help"],
                              capture_output=True, text=True, check=True).stdout
    assert "cluster" not in commands
