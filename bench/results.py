"""Writing benchmark figures: one JSON line per figure under bench/results/, each beside the
baseline measured in the same run, plus a Markdown table the README quotes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

# Where figures go; `python -m bench --quick` points this elsewhere so that a smoke run never
# overwrites the figures the README quotes.
RESULTS = Path(os.environ.get("TENSORHUB_BENCH_RESULTS") or Path(__file__).parent / "results")


def machine_notes() -> dict:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_1min": round(load, 2) if load is not None else None,
        "ucx_tls": os.environ.get("UCX_TLS"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": False,
    }


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class Report:
    """Collects figures of one benchmark run and writes them out together."""

    def __init__(self, bench: str):
        self.bench = bench
        self.rows: list[dict] = []
        self.notes = machine_notes()

    def add(self, name: str, value: float, unit: str, baseline: str | None = None,
            baseline_value: float | None = None, higher_is_better: bool = True) -> None:
        ratio = None
        if baseline_value:
            ratio = value / baseline_value if higher_is_better else baseline_value / value
        row = {"bench": self.bench, "name": name, "value": round(value, 4), "unit": unit,
               "baseline": baseline, "baseline_value": None if baseline_value is None
               else round(baseline_value, 4), "ratio": None if ratio is None
               else round(ratio, 3), "machine": self.notes}
        self.rows.append(row)
        base = f"  vs {baseline} {baseline_value:.3f} {unit} -> ratio {ratio:.3f}" \
            if baseline_value else ""
        print(f"{name:<48} {value:10.3f} {unit}{base}", flush=True)

    def write(self, keep_earlier: bool = False) -> Path:
        """Append this run's figures to the JSON lines and write the Markdown table of
        them; `keep_earlier` (a run of some of the benchmark's parts): the table also
        lists, apart and dated, the latest figure of each name this run did not measure."""
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{self.bench}.jsonl"
        earlier: dict[str, dict] = {}
        if keep_earlier and path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                earlier[row["name"]] = row
        with path.open("a") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
        md = RESULTS / f"{self.bench}.md"
        lines = [f"# {self.bench} ({self.notes['date']}, load {self.notes['load_1min']})", "",
                 *_table(self.rows)]
        measured = {r["name"] for r in self.rows}
        if rest := [r for name, r in earlier.items() if name not in measured]:
            lines += ["", "Not measured in this run: the latest figures of earlier runs.", "",
                      *_table(rest, dated=True)]
        md.write_text("\n".join(lines) + "\n")
        print(f"wrote {path} and {md}")
        return path


def _table(rows: list[dict], dated: bool = False) -> list[str]:
    lines = ["| figure | value | baseline | baseline value | ratio |"
             + (" date |" if dated else ""), "|---|---|---|---|---|" + ("---|" if dated else "")]
    for r in rows:
        lines.append(f"| {r['name']} | {r['value']} {r['unit']} | {r['baseline'] or ''} | "
                     f"{'' if r['baseline_value'] is None else r['baseline_value']} | "
                     f"{'' if r['ratio'] is None else r['ratio']} |"
                     + (f" {r['machine']['date'][:10]} |" if dated else ""))
    return lines
