"""The command line as a newcomer meets it: the coordinator from the environment, a
version, help on every flag, and messages that name the fix."""

import os
import socket
import subprocess
import sys

import pytest

from tensorhub import AddressError
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.tools.cli import build_parser, main


def test_status_goes_to_the_coordinator_named_by_the_environment(coordinator, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("TENSORHUB_COORDINATOR", coordinator.address)
    assert main(["status"]) == 0
    assert capsys.readouterr().out.startswith(f"coordinator {coordinator.address}: ")


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"tensorhub {version('tensorhub-plugins')}\n"


@pytest.mark.parametrize("command", ["status", "simulate", "demo", "replica", "publish"])
def test_every_flag_has_help(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    flags = [a.option_strings[0] for a in sub.choices[command]._actions
             if a.option_strings and a.help is None]
    assert flags == []


def test_publish_with_nothing_to_publish_says_what_to_give():
    with pytest.raises(SystemExit) as done:
        main(["publish"])
    assert done.value.code == ("tensorhub publish: nothing to publish: give a checkpoint PATH "
                               "(a safetensors file or folder) or --synthetic-mb MIB")


def test_a_closed_pipe_ends_status_without_a_traceback(coordinator):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has read all it wanted
    try:
        done = subprocess.run([sys.executable, "-m", "tensorhub", "status", "--coordinator",
                               coordinator.address], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert "Traceback" not in done.stderr


def test_watch_without_rich_names_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.delitem(sys.modules, "tensorhub.tools.live_view", raising=False)
    monkeypatch.delitem(sys.modules, "rich.console", raising=False)
    with pytest.raises(SystemExit) as done:
        main(["status", "--watch"])
    assert done.value.code == ("tensorhub status --watch needs the rich package: pip install "
                               "rich (or pip install 'tensorhub[watch]')")


def _two_free_ports() -> int:
    """A port whose next one is free too (a coordinator binds both)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


def test_a_taken_request_port_names_both_ports():
    port = _two_free_ports()
    bind = f"tcp://127.0.0.1:{port}"
    first = Coordinator(CoordinatorConfig(bind=bind))
    try:
        with pytest.raises(AddressError) as caught:
            Coordinator(CoordinatorConfig(bind=bind))
    finally:
        first.stop()
    assert str(caught.value) == (
        f"cannot bind {bind} (requests): the address is in use (another coordinator?). A "
        f"coordinator binds {bind} for requests and tcp://127.0.0.1:{port + 1} for "
        f"announcements (the request port + 1 unless --announce is given): pick --bind with "
        f"a port whose next one is free too, or stop the other process")


def test_a_taken_announcement_port_is_named_as_the_request_port_plus_one():
    port = _two_free_ports()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen()
        with pytest.raises(AddressError) as caught:
            Coordinator(CoordinatorConfig(bind=f"tcp://127.0.0.1:{port}"))
    assert str(caught.value).startswith(
        f"cannot bind tcp://127.0.0.1:{port + 1} (announcements): the address is in use")
