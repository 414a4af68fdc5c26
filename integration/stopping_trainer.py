"""A trainer that publishes a version and stops (SIGSTOP) right after the coordinator
accepted it: engines start reading the version from it and get no byte.

    python -m integration.stopping_trainer COORDINATOR FOLDER   # safetensors files in FOLDER

Prints `{"version": N}` before it stops; a test or benchmark SIGKILLs it when done.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys

from safetensors.torch import load_file

from tensorhub import Publisher


def main() -> None:
    coordinator, folder = sys.argv[1], sys.argv[2]
    state = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        state.update(load_file(path))
    pub = Publisher(coordinator, "policy", name="stopping-trainer")
    print(json.dumps({"version": pub.publish(state)}), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main()
