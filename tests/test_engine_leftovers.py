"""The engine tests' clean-up of /dev/shm (`tensorhub_testing.shared_memory`): an engine's
segment that appeared during the session and no live process uses goes; one that was there
before, is still mapped or open, or is not an engine's, stays."""

from __future__ import annotations

import mmap

from tensorhub_testing import shared_memory


def test_only_new_segments_that_no_process_uses_are_removed(tmp_path):
    (tmp_path / "psm_before").write_bytes(b"x")
    before = shared_memory.names(tmp_path)
    for name in ("psm_left", "sem.mp-open", "sgl_mapped", "not_an_engines"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / "sgl_mapped", "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)  # (mapped only, once the file is closed)
    with open(tmp_path / "sem.mp-open", "rb"):
        try:
            assert shared_memory.remove_unused(before, tmp_path) == ["psm_left"]
        finally:
            mapping.close()
    assert shared_memory.names(tmp_path) == {"psm_before", "sem.mp-open", "sgl_mapped",
                                             "not_an_engines"}
