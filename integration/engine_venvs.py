"""Where each engine's python lives: its own venv, built by the project's setup script.

Kept free of pytest: the benchmarks and the demo run inside engine venvs that have none.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def engine_python(target: str) -> str:
    """The python of an engine venv, built by the project's setup script if needed.

    The script's progress (and pip's errors) go straight to this process's stderr, so a
    first run that builds a venv says what it is doing instead of going quiet for minutes.
    """
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), target],
                         stdout=subprocess.PIPE, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/setup.sh {target} failed (its error is printed above)")
    return str(Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python")
