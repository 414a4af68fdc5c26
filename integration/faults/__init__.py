"""Test-only faults for real engines (`sitecustomize.py` here), injected into an engine's
processes through its environment by the tests alone: no product code reads them.

`load_fault_env(file)`: the engine's load of the version written in `file` fails half-way.
`refuse_fault_env(version, suffix)`: the checkpoint copy of the worker whose name ends with
`suffix` refuses `version`, as a copy that failed verification would.
`freeze_fault_env(file)`: once `file` exists, a vLLM engine freezes the requests in flight
(its own `keep` pause) right after one of them produced a token, and removes `file`.
`skew_share_env(file)`: while `file` exists, a copy pulling its node's share of a version in
tiles pulls the other tiles.
`checkpoint_layout_env()`: a vLLM engine on CPU keeps its live weights in the checkpoint's
layout, as on a GPU (not a fault: the CPU twin of a GPU engine's weights)."""

from __future__ import annotations

from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent


def load_fault_env(fault_file: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR), "TENSORHUB_TEST_FAULT_LOAD": str(fault_file)}


def refuse_fault_env(version: int, suffix: str) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR),
            "TENSORHUB_TEST_FAULT_REFUSE": f"{version}@{suffix}"}


def freeze_fault_env(freeze_file: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR), "TENSORHUB_TEST_FREEZE": str(freeze_file)}


def skew_share_env(skew_file: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR), "TENSORHUB_TEST_SKEW_SHARE": str(skew_file)}


def checkpoint_layout_env() -> dict[str, str]:
    return {"PYTHONPATH": str(FAULTS_DIR), "TENSORHUB_TEST_CHECKPOINT_LAYOUT": "1"}
