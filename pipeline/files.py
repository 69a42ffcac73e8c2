"""The one atomic file write: readers see the old file or the new one, never a part of either."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

TMP_SUFFIX = ".tmp"
"""Temporary files end with this (`<path>.<random>.tmp`); a crash may leave one behind."""


def write_atomic(path: str | Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write `data` to `path`: a private temporary beside it (created with `mode`, e.g. 0o600 for
    credentials), fsynced, renamed over `path`, then the directory fsynced so the rename survives a
    power cut. Concurrent writers of one path never share a temporary: the last rename wins whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
