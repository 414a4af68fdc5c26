"""A trainer on an emulated host that publishes a version each time it is told to.

    python -m integration.line_trainer COORDINATOR   # then one model folder per stdin line

For each line (a folder of safetensors files) it publishes the folder's tensors as the next
version of `policy` and prints `{"version": N}`; it keeps serving what it published until
its stdin closes or it is stopped. Tests whose trainer must run on another host than the
test (its network is the host's) drive it through `ChildProcess.send_line`.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from safetensors.torch import load_file

from tensorhub import Publisher


def main() -> None:
    pub = Publisher(sys.argv[1], "policy", name="trainer")
    try:
        for line in sys.stdin:
            state = {}
            for path in sorted(glob.glob(os.path.join(line.strip(), "*.safetensors"))):
                state.update(load_file(path))
            print(json.dumps({"version": pub.publish(state)}), flush=True)
    finally:
        pub.close()


if __name__ == "__main__":
    main()
