"""Integration fixtures: engine venvs, tiny float32 models, a real coordinator process.

Engines are expensive (30-45 s to start, ~1.5 GB each), so fixtures are module- or
session-scoped and every process is stopped by PID at teardown.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from integration.engine_server import free_port
from integration.tiny_model import build_tiny_model, load_state_dict, perturb_state_dict
from tensorhub.processes import ChildProcess

REPO = Path(__file__).resolve().parent.parent


def engine_python(target: str) -> str:
    """The python of an engine venv, built by the project's setup script if needed."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), target],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/setup.sh {target} failed:\n{out.stderr[-3000:]}")
    return str(Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return engine_python("vllm")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return engine_python("sglang")


class Versions:
    """A tiny model on disk (version 1) and perturbed next versions, all float32."""

    def __init__(self, root: Path, arch: str = "qwen2", tied: bool = False, count: int = 4):
        self.dir = build_tiny_model(root / "model", arch=arch, tie_word_embeddings=tied)
        self.states = [load_state_dict(self.dir)]
        for k in range(1, count):
            self.states.append(perturb_state_dict(self.states[-1], seed=k, scale=0.3))

    def state(self, version: int) -> dict:
        return self.states[version - 1]

    def weightless_dir(self, root: Path) -> Path:
        """The model directory without its weights: config and tokenizer only. An engine
        started from it (`--load-format dummy`) can only serve what it pulls from peers."""
        import shutil

        out = root / "weightless"
        out.mkdir(parents=True, exist_ok=True)
        for f in self.dir.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(f, out / f.name)
        return out


@pytest.fixture(scope="module")
def coordinator_process():
    """A real `tensorhub coordinator` process; one reader per holder at a time, so that a
    second engine is made to read from the first rather than from the trainer."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = ChildProcess([sys.executable, "-m", "tensorhub.cli", "coordinator", "--bind",
                         address, "--announce", f"tcp://127.0.0.1:{free_port()}",
                         "--max-readers-per-holder", "1"], name="coordinator")
    proc.next_line(timeout=60)
    proc.address = address
    yield proc
    proc.stop()
