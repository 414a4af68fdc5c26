"""Writes a line whenever this process, which only sleeps 50 ms at a time, wakes up more
than half a second late: the machine (not one of our processes) was not running it.

Integration failures that look like a silent peer show this file's lines, so a paused
machine can be told apart from a bug of ours (CI keeps no files).

    python -m integration.stall_monitor OUT_FILE
"""

from __future__ import annotations

import sys
import time

TICK = 0.05
LATE = 0.5


def pressure() -> str:
    """The kernel's pressure-stall figures (avg10, %), where it keeps them."""
    out = []
    for kind in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{kind}") as f:
                out.append(f"{kind} {f.readline().split()[1]}")
        except (OSError, IndexError):
            pass
    return ", ".join(out)


def main(path: str) -> None:
    with open(path, "a", buffering=1) as out:
        last = time.monotonic()
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            if now - last > LATE:
                out.write(f"{time.strftime('%H:%M:%S')} woke {now - last - TICK:.2f} s late "
                          f"({pressure()})\n")
            last = now


if __name__ == "__main__":
    main(sys.argv[1])
