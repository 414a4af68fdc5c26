"""The commands that build and shape an emulated cluster's links: `ip` and `tc` run in a
namespace, rates as tc reads them, tbf shaping, and the byte counters of a link end.

Shaping is `tc` tbf, the token bucket. The bucket holds ``max(64 KiB, 10 ms at the rate)``:
veth hands tbf TCP segmentation (GSO) packets of up to 64 KiB, and a bucket smaller than a
packet makes tbf split it in software first; the queue behind it holds 50 ms at the rate
(like a switch buffer: deeper queues only add delay). tbf counts whole Ethernet frames, so
TCP's goodput is 1448/1514 = 95.6% of the rate (plus one bucket's worth at the start); the
counters count frames too.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

Rate = int | float | str | None
"""Bits per second: a number, or a string as `tc` writes it ("800mbit", "2.5gbit");
None is unshaped."""

MIN_BURST = 64 * 1024  # bytes: the largest GSO packet veth hands a qdisc
BURST_SECONDS = 0.010  # the bucket beyond MIN_BURST: this long at the rate
QUEUE_SECONDS = 0.050  # the queue behind the bucket: this long at the rate (a switch buffer)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class ClusterError(RuntimeError):
    """A command that builds, shapes or reads the cluster failed."""


def parse_rate(rate: int | float | str) -> int:
    """Bits per second from a number or a `tc`-style string ("800mbit", "2.5gbit", "10kbit";
    SI units, like tc). Bytes-per-second units ("mbps") are refused: tc reads them as
    bytes, most people as bits."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(rate).lower())
        if not match or match.group(2) not in {"", *_UNITS}:
            raise ValueError(f"rate {rate!r}: give bits per second, e.g. 800mbit, 2.5gbit, "
                             f"10kbit or a number")
        value = float(match.group(1)) * _UNITS.get(match.group(2) or "bit", 1)
    if not value >= 1:
        raise ValueError(f"rate {rate!r}: must be at least 1 bit per second")
    return int(value)


def bits(rate: Rate) -> int | None:
    """`parse_rate`, with None (unshaped) passed through."""
    return None if rate is None else parse_rate(rate)


@dataclass(frozen=True)
class Traffic:
    """Bytes a link end sent and received (Ethernet frames: headers included)."""

    sent: int
    received: int

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent - other.sent, self.received - other.received)


@dataclass(frozen=True)
class HostSpec:
    """One host to build: its name (also its hostname), its datacenter and its shaping."""

    name: str
    dc: int = 0
    egress: Rate = None
    ingress: Rate = None


def run(argv: Sequence[str], input: str | None = None, check: bool = True) -> str:
    """Run a command to completion; its stdout. A failure (when `check`) raises
    `ClusterError` with its stderr."""
    result = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                            timeout=60)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def ip(namespace: str, *commands: str) -> None:
    """Run `ip` commands in one namespace, as one batch (one process, not one each)."""
    run(["ip", "-n", namespace, "-batch", "-"], input="\n".join(commands) + "\n")


def link_stats(namespace: str) -> dict[str, Traffic]:
    """Every link of a namespace: what it has sent and received."""
    out = run(["ip", "-n", namespace, "-j", "-s", "link", "show"])
    return {link["ifname"]: Traffic(link["stats64"]["tx"]["bytes"],
                                    link["stats64"]["rx"]["bytes"])
            for link in json.loads(out)}


def shape(namespace: str, device: str, rate: Rate) -> None:
    """tbf on a device's egress at `rate`, or the device's default qdisc back if None."""
    rate_bits = bits(rate)
    if rate_bits is None:
        run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
        return
    burst = max(MIN_BURST, int(rate_bits / 8 * BURST_SECONDS))
    limit = burst + int(rate_bits / 8 * QUEUE_SECONDS)
    run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
         "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)])
