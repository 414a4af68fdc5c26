"""Settings: every TENSORHUB_* variable the code reads is declared once, read when used (not
at import), refused by name when it does not parse; README's table is the generated one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorhub import settings
from tensorhub.engines.settings import ENV_PREFIX, EngineSettings

ROOT = Path(__file__).resolve().parents[1]
DECLARED = {s.name for s in settings.SETTINGS}


def variables_named_in(*folders: str) -> set[str]:
    names: set[str] = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"TENSORHUB_[A-Z][A-Z0-9_]*", path.read_text()))
    return {n.rstrip("_") for n in names if not n.startswith("TENSORHUB_TEST_")}


def test_every_variable_the_code_names_is_declared():
    assert variables_named_in("tensorhub", "tensorhub_plugins") <= DECLARED


def test_every_engine_setting_has_its_variable_declared():
    assert {ENV_PREFIX + field.upper() for field in EngineSettings.model_fields} <= DECLARED


def test_each_variable_is_declared_once_with_why():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    assert all(s.why for s in settings.SETTINGS)


def test_unset_or_empty_means_the_default(monkeypatch):
    monkeypatch.delenv("TENSORHUB_STALL_TIMEOUT", raising=False)
    assert settings.STALL_TIMEOUT.get() == 30.0
    monkeypatch.setenv("TENSORHUB_STALL_TIMEOUT", "")
    assert settings.STALL_TIMEOUT.get() == 30.0


def test_values_are_read_when_used(monkeypatch):
    monkeypatch.setenv("TENSORHUB_STALL_TIMEOUT", "5")
    assert settings.STALL_TIMEOUT.get() == 5.0
    monkeypatch.setenv("TENSORHUB_SHARED_MEMORY", "0")
    assert settings.SHARED_MEMORY.get() is False
    monkeypatch.setenv("TENSORHUB_TRANSPORT", "zmq")
    assert settings.TRANSPORT.get() == "zmq"
    monkeypatch.setenv("TENSORHUB_TOKEN_FILE", "/etc/token")
    assert settings.TOKEN_FILE.get() == Path("/etc/token")


@pytest.mark.parametrize("setting, text", [
    (settings.STALL_TIMEOUT, "soon"),
    (settings.STALL_TIMEOUT, "0"),
    (settings.COPY_THREADS, "many"),
    (settings.TRANSPORT, "carrier-pigeon"),
    (settings.MAX_VERSION_GB, "-1"),
])
def test_a_value_that_does_not_parse_is_refused_by_name(monkeypatch, setting, text):
    monkeypatch.setenv(setting.name, text)
    with pytest.raises(settings.SettingError, match=setting.name):
        setting.get()


def test_a_switch_is_turned_off_by_0_only_and_on_by_1_only(monkeypatch):
    for text, on in (("0", False), ("1", True), ("false", True), ("yes", True)):
        monkeypatch.setenv(settings.SHARED_MEMORY.name, text)
        assert settings.SHARED_MEMORY.get() is on
    for text, on in (("1", True), ("0", False), ("true", False), ("on", False)):
        monkeypatch.setenv(settings.CUDA_IPC.name, text)
        assert settings.CUDA_IPC.get() is on


def test_copy_threads_falls_back_to_the_older_name(monkeypatch):
    from tensorhub.core.transport.parallel_copy import CopyPool

    seen = []
    monkeypatch.setattr("tensorhub.core.transport.parallel_copy.split_calls",
                        lambda segments, call_bytes: seen.append(call_bytes) or [])
    monkeypatch.delenv(settings.COPY_THREADS.name, raising=False)
    monkeypatch.setenv(settings.CMA_THREADS.name, "4")
    CopyPool("t").run([(0, 0, 64 << 20)], lambda call: None)
    monkeypatch.setenv(settings.COPY_THREADS.name, "1")
    CopyPool("t").run([(0, 0, 64 << 20)], lambda call: None)
    assert seen == [16 << 20, 64 << 20]  # 64 MiB cut for 4 threads, then for 1


def test_no_module_reads_a_variable_at_import():
    """Every module of the package imports with every number and switch unparseable: a read
    at import would fail here."""
    env = {s.name: "not-a-value" for s in settings.SETTINGS}
    probe = ("import importlib, pkgutil, tensorhub\n"
             "for m in pkgutil.walk_packages(tensorhub.__path__, 'tensorhub.'):\n"
             "    importlib.import_module(m.name)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_readme_carries_the_generated_table():
    readme = (ROOT / "README.md").read_text()
    assert settings.table_in(readme) == settings.markdown_table(), (
        "README.md's settings table is stale: run `python -m tensorhub.settings --write "
        "README.md`")


def test_writing_the_table_replaces_only_what_is_between_the_markers():
    text = f"before\n{settings.BEGIN}\n| old |\n{settings.END}\nafter\n"
    written = settings.with_table(text)
    assert written.startswith("before\n") and written.endswith("\nafter\n")
    assert settings.table_in(written) == settings.markdown_table()


def test_an_engine_setting_its_config_gives_is_not_read_from_the_environment(monkeypatch):
    from tensorhub.engines.settings import load_settings

    monkeypatch.setenv(settings.POLL_INTERVAL.name, "soon")
    got = load_settings({"coordinator": "tcp://127.0.0.1:1", "poll_interval": 1.5})
    assert got is not None and got.poll_interval == 1.5
