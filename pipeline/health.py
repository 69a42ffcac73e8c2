"""A liveness heartbeat for long-running services, which a container healthcheck reads.

Every service of the deployment consumes events, so `EventConsumer.poll` beats: a main loop that
stops polling (hung, deadlocked, stuck on a dead dependency) stops the heartbeat, as Kafka's own
`max.poll.interval` would notice. Off unless `AWRL_HEARTBEAT_FILE` names a file (docker-compose sets
it); `awrl health --max-age S` exits 1 once the file is older than S seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "AWRL_HEARTBEAT_FILE"
EVERY_S = 5.0
"""At most one touch per this many seconds: a poll loop runs every few hundred milliseconds."""
_last = [0.0]


def beat() -> None:
    """Touch the heartbeat file (if one is configured and the last touch is older than `EVERY_S`)."""
    path = os.environ.get(ENV)
    now = time.monotonic()
    if not path or now - _last[0] < EVERY_S:
        return
    _last[0] = now
    try:
        Path(path).touch()
    except OSError:  # a full or read-only disk must not stop the service; the check will say so
        pass


def age(path: str | os.PathLike) -> float | None:
    """Seconds since the heartbeat file was touched; None if it does not exist."""
    try:
        return max(0.0, time.time() - Path(path).stat().st_mtime)
    except FileNotFoundError:
        return None
