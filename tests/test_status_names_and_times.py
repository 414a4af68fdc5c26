"""What `tensorhub status` shows a newcomer: workers given no name told apart, and when
each recent pull ended."""

import os
import re
import socket
import time

import torch

from tensorhub import Publisher, Replica
from tensorhub.tools.cli import main


def test_replicas_given_no_name_have_distinct_names_of_host_and_process(coordinator):
    prefix = f"replica-{socket.gethostname()}-{os.getpid()}"
    with Replica(coordinator.address, "lm", transport="zmq") as a, \
            Replica(coordinator.address, "lm", transport="zmq") as b:
        names = [a.session.name, b.session.name]
    assert names[0] != names[1]
    assert all(re.fullmatch(re.escape(prefix) + r"(-\d+)?", n) for n in names), names


def test_recent_pulls_show_the_time_they_ended(coordinator, capsys):
    with Publisher(coordinator.address, "lm", transport="zmq") as pub, \
            Replica(coordinator.address, "lm", name="reader", transport="zmq",
                    whole_items=True) as rep:
        pub.publish({"w": torch.ones(8)})
        rep.pull(timeout=10)
        capsys.readouterr()
        assert main(["status", "--coordinator", coordinator.address]) == 0
        out = capsys.readouterr().out
    assert re.search(r"^  \d\d:\d\d:\d\d reader <- trainer: lm v1 ", out, re.MULTILINE), out


def test_a_transfer_recorded_without_a_time_is_stamped_as_it_is_recorded():
    from tensorhub.coordinator.table import Table
    from tensorhub.core.data_types import TransferRecord

    table = Table()
    before = time.time()
    table.record(TransferRecord(reader="r", source="s", model="m", version=1, nbytes=1,
                                seconds=0.1, ok=True))
    assert before <= table.transfers[0].ended_at <= time.time()
