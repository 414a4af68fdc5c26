"""A trainer on an emulated host that publishes a version each time it is told to.

    python -m integration.line_trainer COORDINATOR   # then one model folder per stdin line

For each line (a folder of safetensors files) it publishes the folder's tensors as the next
version of `policy` and prints `{"version": N}`; a line `FOLDER tiles T` publishes it in T
tiles (`tensorhub/tiles.py`). It keeps serving what it published until
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
from tensorhub.tiles import TiledPublisher


def main() -> None:
    pub = Publisher(sys.argv[1], "policy", name="trainer")
    tiled: TiledPublisher | None = None
    try:
        for line in sys.stdin:
            folder, _, tiles = line.strip().partition(" tiles ")
            state = {}
            for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                state.update(load_file(path))
            if tiles and (tiled is None or tiled.tiles != int(tiles)):
                if tiled is not None:  # (its parts' bindings lapse as its workers leave)
                    tiled.close()
                tiled = TiledPublisher(sys.argv[1], "policy", int(tiles),
                                       name=f"trainer-t{tiles}", owners=pub.owners)
            version = tiled.publish(state) if tiles else pub.publish(state)
            print(json.dumps({"version": version}), flush=True)
    finally:
        if tiled is not None:
            tiled.close()
        pub.close()


if __name__ == "__main__":
    main()
