"""`TENSORHUB_WORKER_SPIN` in vLLM's own ring buffer: run in the vLLM venv against vLLM's
real `SpinCondition`, the class every worker's call queue waits with."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What a worker process does: load the plugin (vLLM calls `register` in every process),
# then make the ring buffer's reader and writer sides, and say how long each spins.
PROBE = """
import json, tempfile, zmq
from tensorhub_plugins.vllm.plugin import register
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
register()
with tempfile.TemporaryDirectory() as folder:  # (its socket goes with it)
    context = zmq.Context()
    address = "ipc://" + folder + "/notify"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    print(json.dumps({"reader": reader.busy_loop_s, "writer": writer.busy_loop_s}))
    context.destroy(linger=0)
"""


def spins(vllm_python: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "TENSORHUB_WORKER_SPIN"}
    environ.update(env, PYTHONPATH=str(REPO))
    done = subprocess.run([vllm_python, "-c", PROBE], env=environ, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_spins_as_long_as_the_setting_says(vllm_python):
    assert spins(vllm_python, TENSORHUB_WORKER_SPIN="0.01") == {"reader": 0.01, "writer": 0}


def test_unset_it_spins_as_vllm_sets(vllm_python):
    assert spins(vllm_python) == {"reader": 1, "writer": 0}
