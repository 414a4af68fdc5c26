"""A trainer on an emulated host that publishes a version each time it is told to.

    python -m integration.line_trainer COORDINATOR   # then one model folder per stdin line

For each line (a folder of safetensors files) it publishes the folder's tensors as the next
version of `policy` and prints `{"version": N}`; a line `FOLDER tiles T` publishes it in T
tiles (`tensorhub/tiles.py`; `FOLDER tiles T placed`: a mixture of experts' experts placed
for expert-parallel engines; `FOLDER tiles T kv=H`: the K/V projections by H heads in parts
of their own), `FOLDER blocks` in layer blocks at the engines' stage edges
(`tensorhub/stages.py`; `FOLDER blocks B`: in B equal ones).
It keeps serving what it published until
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
from tensorhub.stages import LayeredPublisher
from tensorhub.tiles import TiledPublisher


def main() -> None:
    pub = Publisher(sys.argv[1], "policy", name="trainer")
    split: tuple[str, TiledPublisher] | None = None  # ("tiles 2", its publisher), say
    try:
        for line in sys.stdin:
            folder, *how = line.split()
            state = {}
            for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                state.update(load_file(path))
            said = " ".join(how)
            if how and (split is None or split[0] != said):
                if split is not None:  # (its parts' bindings lapse as its workers leave)
                    split[1].close()
                kind, n = how[0], int(how[1]) if len(how) > 1 else None
                make = TiledPublisher if kind == "tiles" else LayeredPublisher
                extra = {}
                for word in how[2:]:  # (`split`/`placed`, `kv=N`)
                    if word.startswith("kv="):
                        extra["kv_heads"] = int(word.removeprefix("kv="))
                    else:
                        extra["experts"] = word
                split = (said, make(sys.argv[1], "policy", n,
                                    name=f"trainer-{kind[0]}{n or ''}"
                                         f"{''.join(how[2:]).replace('=', '')}",
                                    owners=pub.owners, **extra))
            version = split[1].publish(state) if how else pub.publish(state)
            print(json.dumps({"version": version}), flush=True)
    finally:
        if split is not None:
            split[1].close()
        pub.close()


if __name__ == "__main__":
    main()
