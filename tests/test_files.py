"""The one atomic write (`pipeline.files.write_atomic`)."""

from __future__ import annotations

import stat

import pytest

from pipeline.files import write_atomic


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "deep" / "state.json"
    write_atomic(path, "old", mode=0o600)
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_credentials_file_is_private_from_its_first_byte(tmp_path):
    path = tmp_path / "stack.env"
    write_atomic(path, "SECRET=1", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f"
    write_atomic(path, b"old")
    with pytest.raises(TypeError):
        write_atomic(path, 42)  # not bytes: fails after the temporary was created
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]
