"""The tree as a newcomer meets it: no half-resolved merge in any text file, a README that
reads in ten minutes (≤ 300 lines), and no product module over 700 lines."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT = {".py", ".md", ".sh", ".toml", ".txt", ".yml", ".yaml", ".json", ".cfg"}
SKIP = {".git", "__pycache__", ".venv", "node_modules", ".whl"}


def text_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        if path.suffix in TEXT and path.is_file() and \
                not SKIP.intersection(path.relative_to(ROOT).parts):
            out.append(path)
    return out


def test_no_text_file_holds_merge_conflict_markers():
    markers = ("<<<<<<< ", ">>>>>>> ")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in text_files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if line.startswith(markers)]
    assert found == []


def test_the_readme_stays_under_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("package", ["tensorhub", "tensorhub_plugins"])
def test_no_module_is_over_700_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 700}
    assert long == {}


def test_the_repository_root_holds_only_the_readme_and_the_project_files():
    """Command output and logs left by a session (`out.1`, `coord.log`) belong in a temp
    folder, not in a commit."""
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: nothing is committed here")
    tracked = listed.stdout.split()
    at_root = {f for f in tracked if "/" not in f}
    assert at_root <= {".gitignore", "README.md", "pyproject.toml", "LICENSE"}
