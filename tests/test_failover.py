"""A parent that dies mid-pull: the reader asks for another for that stripe, and reads
only what it had not read yet."""

from __future__ import annotations

import pytest

from tensorhub import Publisher, Replica
from tensorhub.core.checksum import checksum
from tensorhub.tools.child_process import ChildProcess
from tensorhub.tools.synthetic_weights import synthetic_state_dict

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)


def test_kill_9_of_a_parent_mid_pull_completes_bit_exact_from_another_holder(
        coordinator, transport, monkeypatch):
    state = synthetic_state_dict(256, n_tiny=100, seed=11)
    holder = ChildProcess.tensorhub(
        "--log-level", "WARNING", "replica", "--coordinator", coordinator.address,
        "--name", "doomed", "--transport", transport, "--json", "--versions", "1", "--linger",
        "--timeout", "120", name="doomed")
    try:
        with Publisher(coordinator.address, "policy", transport=transport) as pub:
            pub.publish(state)
            assert holder.next_json(timeout=120)["event"] == "pulled"
            with Replica(coordinator.address, "policy", transport=transport,
                         name="reader") as reader:
                real_read = reader.session.transport.read
                from_doomed = []  # reads from it that ended

                def read_then_kill(peer, ops, timeout):
                    doomed = peer.worker_id.startswith("doomed")
                    if doomed and not from_doomed:
                        # SIGKILL mid-read, whatever a read's size: after its first op
                        from_doomed.append(peer.worker_id)
                        real_read(peer, ops[:1], min(timeout, 10.0))
                        holder.kill()
                        ops = ops[1:]
                    real_read(peer, ops, min(timeout, 10.0))
                    if doomed:
                        from_doomed.append(peer.worker_id)

                monkeypatch.setattr(reader.session.transport, "read", read_then_kill)
                assert reader.pull(timeout=120) == 1
                assert {n: checksum(t) for n, t in reader.tensors.items()} == \
                       {n: checksum(t) for n, t in state.items()}
                # from the replica that held it (not the trainer again) until it died; its
                # stripes went to the one holder left
                assert "trainer" in reader.last_pull.sources
                assert set(reader.last_pull.sources) <= {"doomed", "trainer"}
                total = sum(t.numel() * t.element_size() for t in state.values())
                chunk = 8 << 20  # (a 256 MiB version is cut into chunks of 8 MiB)
                assert reader.last_pull.nbytes < total + chunk  # only the torn chunk twice
                assert reader.last_pull.by_source.get("doomed", 0) < total // 2
                # the reader named it when it asked for another parent: it avoids it now
                assert from_doomed[0] in coordinator.trust.avoided(reader.session.worker_id)
                # ... and its failed reads are on record, one per stripe it served (each
                # stripe's other bytes from it are on record as read, by the lease's end)
                failed = [t for t in coordinator.table.transfers if not t.ok]
                assert 1 <= len(failed) <= 2 and {t.reader for t in failed} == {"reader"}
                # (its name, or its id once gone)
                assert all(t.source.startswith("doomed") for t in failed)
    finally:
        holder.stop()
