"""The engine tests' clean-up of /dev/shm (`tensorhub_testing.shared_memory`): what appeared
during the session and no live process uses goes; what was there before, or is still
mapped or open, stays."""

from __future__ import annotations

import mmap

from tensorhub_testing import shared_memory


def test_only_new_segments_that_no_process_uses_are_removed(tmp_path):
    (tmp_path / "before").write_bytes(b"x")
    before = shared_memory.names(tmp_path)
    for name in ("left", "open", "mapped"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / "mapped", "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)  # (mapped only, once the file is closed)
    with open(tmp_path / "open", "rb"):
        try:
            assert shared_memory.remove_unused(before, tmp_path) == ["left"]
        finally:
            mapping.close()
    assert shared_memory.names(tmp_path) == {"before", "open", "mapped"}
