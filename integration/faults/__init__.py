"""Test-only faults for real engines (`sitecustomize.py` here), injected into an engine's
processes through its environment by the tests alone: no product code reads them.

`load_fault_env(file)`: the engine's load of the version written in `file` fails half-way.
`refuse_fault_env(version, suffix)`: the checkpoint copy of the worker whose name ends with
`suffix` refuses `version`, as a copy that failed verification would."""

from __future__ import annotations

from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent


def load_fault_env(fault_file: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR), "TENSORHUB_TEST_FAULT_LOAD": str(fault_file)}


def refuse_fault_env(version: int, suffix: str) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR),
            "TENSORHUB_TEST_FAULT_REFUSE": f"{version}@{suffix}"}
