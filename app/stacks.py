"""Which stack a verb that starts work uses (`awrl run`, `awrl demo`), found in one order.

The stack named by the user comes first: `AWRL_KAFKA_BOOTSTRAP` in the environment (docker compose
sets it in every container), or in a `.env` the user wrote (not the one `awrl stack up` writes). Else
the embedded local stack in `--data-dir`, started if it is not running, and its settings handed on as
`awrl stack up` hands them: `./.env` (unless the user's own) and the environment of child processes.
Every other verb only reads settings (`pipeline.settings`: environment, `./.env`, the stack's
`stack.env`), so what one command starts, the next one finds.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

from dotenv import dotenv_values

from pipeline.settings import DOTENV, StackSettings
from pipeline.stack.local import DOTENV_MARKER, LocalStack


def named_by_user() -> bool:
    """Whether the environment or a hand-written `.env` names a broker."""
    if os.environ.get("AWRL_KAFKA_BOOTSTRAP"):
        return True
    if not DOTENV.is_file() or DOTENV.read_text().startswith(DOTENV_MARKER):
        return False
    return bool(dotenv_values(DOTENV).get("AWRL_KAFKA_BOOTSTRAP"))


def find_or_start(data_dir: Path, status=None) -> tuple[StackSettings, LocalStack | None, bool]:
    """(settings, the local stack or None, whether this call started it). `status(text)` is a context
    manager showing progress while the local stack starts (a rich status)."""
    if named_by_user():
        settings = StackSettings()
        settings.s3_credentials()  # fail now, in one line, rather than deep inside a worker
        return settings, None, False
    running = LocalStack.load(data_dir)
    if running is not None and running.healthy():
        stack, started = running, False
    else:
        with status("starting the local stack (Kafka-protocol broker + S3) ...") if status else nullcontext():
            stack, started = LocalStack.up(data_dir), True
    stack.write_dotenv(DOTENV)
    os.environ.update(stack.settings().environ())  # this process's later reads and its children's
    return stack.settings(), stack, started
