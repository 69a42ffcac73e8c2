"""A fresh local stack for one benchmark run, in a temporary directory removed afterwards."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def local_stack() -> Iterator[tuple[object, object, Path]]:
    """(stack, settings with a ledger in the directory and the topics created, the directory)."""
    from pipeline.bus import create_topics
    from pipeline.stack.local import LocalStack

    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"ledger_uri": str(Path(d) / "ledger")})
            create_topics(settings)
            yield stack, settings, Path(d)
        finally:
            stack.down()
