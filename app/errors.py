"""User mistakes, told in one line: which exceptions are the user's to fix, and what to say.

The exception classes live in the layers that raise them (a missing setting in `pipeline.settings`, an
unknown run in `analysis.runs`, ...). They are looked up in `sys.modules` rather than imported: an
exception whose module was never loaded cannot have been raised, and `awrl --help` stays instant.
"""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    """A config file or flag the verb cannot use; the message names the file and the field."""


MISTAKES: dict[tuple[str, str], int] = {
    ("app.errors", "ConfigError"): 2,
    ("pipeline.settings", "MissingSettings"): 2,
    ("analysis.runs", "UnknownRun"): 2,
    ("kafka.errors", "NoBrokersAvailable"): 2,
    ("pipeline.stack.process", "StackError"): 1,
    ("app.learning", "RLStarved"): 1,
}
"""(module, exception class) -> exit code: 2 for what the user typed or configured, 1 for a stack that
would not start (its message says why)."""


def user_error(exc: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit code) if `exc` is a user's mistake; None for a bug (keep its traceback)."""
    if _no_broker(exc):
        return _message(exc), 2
    for (module, name), code in MISTAKES.items():
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return _message(exc), code
    return None


def _no_broker(exc: BaseException) -> bool:
    """kafka-python 3 says it with a timeout, not `NoBrokersAvailable`; other timeouts stay bugs."""
    timeout = getattr(sys.modules.get("kafka.errors"), "KafkaTimeoutError", None)
    return timeout is not None and isinstance(exc, timeout) and "Unable to bootstrap" in str(exc)


def _message(exc: BaseException) -> str:
    if type(exc).__name__ == "NoBrokersAvailable" or _no_broker(exc):
        from pipeline.settings import StackSettings

        return (
            f"no Kafka broker answers at {StackSettings().kafka_bootstrap}: start the local stack "
            "(`awrl stack up`) or fix AWRL_KAFKA_BOOTSTRAP (environment or .env)"
        )
    text = str(exc.args[0]) if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    return " ".join(text.split())
