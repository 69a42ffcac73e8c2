"""A test's own corner of the session's stack: its topic prefix and its bucket, removed afterwards.

The session's object store is Ceph memstore (4 GiB of memory). A Ceph cluster that fills up holds
every write instead of refusing it, so tests that publish checkpoints (each version of the small model
is ~75 MB with its optimizer state) must not leave them behind for the whole session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.bus import create_topics
from pipeline.s3 import remove_bucket
from pipeline.settings import StackSettings
from pipeline.stack.local import LocalStack
from pipeline.store import ScreenshotStore


@contextmanager
def own_settings(stack: LocalStack) -> Iterator[StackSettings]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = stack.settings().model_copy(update={"topic_prefix": prefix, "s3_bucket": f"awrl-{prefix}"})
    create_topics(settings)
    ScreenshotStore.from_settings(settings).ensure_bucket()
    try:
        yield settings
    finally:
        remove_bucket(settings)
