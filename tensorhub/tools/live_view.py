"""`tensorhub status --watch`: the fleet redrawn every second, with `rich`.

What an operator watches while a version spreads: which versions exist and who holds them,
each pull in flight with its progress and rate (as its reader's last heartbeat reported it),
and the pulls that just ended. Everything comes from one `StatusRequest` a redraw, so the
view costs the coordinator what `tensorhub status` does.
"""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusReply, StatusRequest
from tensorhub.core.errors import TensorHubError

RECENT_PULLS = 8  # ended pulls shown under the ones in flight
SHOWN_PULLS = 20  # pulls in flight drawn one a row (a fleet of thousands: the slowest first)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def versions_table(reply: StatusReply) -> Table:
    table = Table(title="versions", title_justify="left", expand=True)
    for column in ("model", "version", "size", "holders"):
        table.add_column(column, no_wrap=column != "holders")
    for m in reply.models:
        for v in reversed(m.versions):
            holders = ", ".join(
                f"{h.name}{' (withdrawn)' if h.withdrawn else ''}"
                + (f" [{h.active_reads} reads]" if h.active_reads else "")
                for h in v.holders) or "[red]no holder[/red]"
            part = "" if v.part is None else f" part {v.part}"
            label = f"v{v.version}{part}" + (" (latest)" if v.version == m.latest else "")
            table.add_row(m.model, label, _mib(v.nbytes), holders)
    return table


def pulls_table(reply: StatusReply) -> Table:
    table = Table(title=f"pulls in flight ({reply.reads_in_flight} read leases)",
                  title_justify="left", expand=True)
    for column in ("reader", "version", "progress", "bytes", "rate", "for"):
        table.add_column(column, no_wrap=True)
    slowest = sorted(reply.pulls, key=lambda p: (p.done / max(p.total, 1), p.reader))
    if len(slowest) > SHOWN_PULLS:
        table.caption = f"the {SHOWN_PULLS} least advanced of {len(slowest)} pulls"
    for p in slowest[:SHOWN_PULLS]:
        table.add_row(p.reader, f"{p.model} v{p.version}",
                      ProgressBar(total=max(p.total, 1), completed=p.done, width=24),
                      f"{_mib(p.done)} / {_mib(p.total)}", _gbps(p.done, p.seconds),
                      f"{p.seconds:.0f} s")
    return table


def recent_table(reply: StatusReply) -> Table:
    table = Table(title="recent pulls (reader <- source)", title_justify="left", expand=True)
    for column in ("reader", "source", "version", "size", "rate", "result"):
        table.add_column(column, no_wrap=column != "result")
    for t in reply.transfers[-RECENT_PULLS:]:
        table.add_row(t.reader, t.source, f"{t.model} v{t.version}", _mib(t.nbytes),
                      _gbps(t.nbytes, t.seconds),
                      "[green]ok[/green]" if t.ok else f"[red]{t.error}[/red]")
    return table


def render(reply: StatusReply, address: str) -> Group:
    """One frame of the live view."""
    roles: dict[str, int] = {}
    for w in reply.workers:
        roles[str(w["role"])] = roles.get(str(w["role"]), 0) + 1
    header = Text(f"coordinator {address}: " + ", ".join(
        f"{n} {role}{'s' if n != 1 else ''}" for role, n in sorted(roles.items()))
        + f"   {time.strftime('%H:%M:%S')}", style="bold")
    parts = [header, versions_table(reply), pulls_table(reply), recent_table(reply)]
    if reply.suspect_readers:
        parts.append(Text("readers failing on every holder they try (check their transport "
                          f"settings): {', '.join(reply.suspect_readers)}", style="red"))
    return Group(*parts)


def watch(address: str, interval: float = 1.0, timeout: float = 5.0,
          console: Console | None = None, frames: int | None = None) -> None:
    """Redraw the fleet every `interval` seconds until interrupted (or `frames` redraws).
    A coordinator that does not answer is shown as such, and the view keeps trying."""
    client = CoordinatorClient(address, timeout=timeout)
    drawn = 0
    try:
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            while frames is None or drawn < frames:
                try:
                    live.update(render(client.call(StatusRequest()), address))
                except TensorHubError as exc:
                    live.update(Text(f"coordinator {address}: {exc} (trying again)",
                                     style="red"))
                drawn += 1
                if frames is None or drawn < frames:
                    time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
