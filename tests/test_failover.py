"""A source that dies mid-pull: the reader re-plans only the missing ranges elsewhere."""

from __future__ import annotations

import pytest

from tensorhub import Publisher, Replica
from tensorhub.core import puller
from tensorhub.core.checksum import checksum
from tensorhub.demo import synthetic_state_dict
from tensorhub.processes import ChildProcess


@pytest.mark.parametrize("streams", [1, 2])
def test_kill_9_of_the_source_mid_pull_completes_bit_exact_from_another_holder(
        coordinator, transport, streams, monkeypatch):
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
                         name="reader", streams=streams) as reader:
                monkeypatch.setattr(puller, "BATCH_BYTES", 8 << 20)
                real_read = reader.session.transport.read
                from_doomed = []  # reads from it that ended (one stream per holder: in turn)

                def read_then_kill(peer, ops, timeout):
                    doomed = peer.worker_id.startswith("doomed")
                    if doomed and len(from_doomed) == 2:
                        holder.kill()  # SIGKILL, mid-pull: two of its batches are in
                    real_read(peer, ops, min(timeout, 10.0))
                    if doomed:
                        from_doomed.append(peer.worker_id)

                monkeypatch.setattr(reader.session.transport, "read", read_then_kill)
                assert reader.pull(timeout=120) == 1
                assert {n: checksum(t) for n, t in reader.tensors.items()} == \
                       {n: checksum(t) for n, t in state.items()}
                # (a second stream reads from the trainer meanwhile: one per holder)
                assert reader.last_pull.sources[0] == "doomed" or streams > 1
                assert {"doomed", "trainer"} <= set(reader.last_pull.sources)
                total = sum(t.numel() * t.element_size() for t in state.values())
                assert reader.last_pull.nbytes < total + (8 << 20)  # no range read twice
                records = [t for t in coordinator.table.transfers if t.reader == "reader"]
                # one failed lease, of the killed source; every plan after it read its part
                # (chunked plans cover a few chunks each, so there are several)
                failed = [i for i, r in enumerate(records) if not r.ok]
                assert len(failed) == 1 and records[failed[0]].source.startswith("doomed")
                assert all(r.ok for r in records[failed[0] + 1:])
                assert len(records) > failed[0] + 1 or streams > 1
    finally:
        holder.stop()
