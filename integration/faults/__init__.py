"""A test-only fault for real engines (`sitecustomize.py` here): `load_fault_env(file)` is
the environment that makes an engine's load of the version written in `file` fail half-way."""

from __future__ import annotations

from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent


def load_fault_env(fault_file: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR), "TENSORHUB_TEST_FAULT_LOAD": str(fault_file)}
