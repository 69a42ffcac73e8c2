"""Content hashing, in one place: screenshots, checkpoints and anything else stored by content."""

from __future__ import annotations

import hashlib


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
