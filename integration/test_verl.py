"""The TensorHub checkpoint engine under verl 0.9.1's own `CheckpointEngineManager`, on CPU
with a local Ray cluster (`integration/verl_manager.py`, run in the verl venv): a trainer
and two rollout replicas receive every step bit-exact, and a third replica that joins later
takes the current weights from the holders (no sync, no group rebuilt), then receives the
next step with the others; a step verl sends twice becomes a new version of it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_verl_syncs_two_replicas_and_a_third_joins_without_a_group(verl_python, tmp_path):
    log = tmp_path / "verl_manager.log"
    with open(log, "w") as err:
        run = subprocess.run([verl_python, "-m", "integration.verl_manager"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=err, text=True, timeout=600,
                             start_new_session=True)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, (events, log.read_text()[-4000:])
    assert [(e["event"], e["step"]) for e in events] == [
        ("sync", 1), ("sync", 2), ("joined", 2), ("sync", 3), ("sync", 3), ("resent", 3)]
    assert all(e["bit_exact"] for e in events), events
    first, second, joined, three_old, three_new, resent = events
    assert len(first["receivers"]) == 2 and len(three_old["receivers"]) == 2
    # the version each sync made, named by the driver and published by the trainer's rank 0
    assert first["metrics"]["tensorhub/version"] == 1.0
    assert three_new["metrics"]["tensorhub/version"] == 3.0
    assert resent["metrics"]["tensorhub/version"] == 4.0  # a step sent twice: a new version
    # trees, not a star: a receiver read from another receiver rather than the trainer
    peers = {r["name"] for r in first["receivers"]}
    assert any(set(r["sources"]) & peers for e in (first, second, three_old)
               for r in e["receivers"]), events
    # the late replica read step 2 from holders of it: the trainer's rank 0 or a receiver
    [late] = joined["receivers"]
    assert late["sources"] and all(s in peers or s.startswith("verl-trainer")
                                   for s in late["sources"]), late
    assert three_new["receivers"][0]["name"] == late["name"]
