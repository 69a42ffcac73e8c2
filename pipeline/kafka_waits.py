"""Bounded cross-thread waits in kafka-python's IO loop.

kafka-python 3.0.12 (the newest on PyPI) blocks a caller thread on `event.wait()` with no timeout
while its IO thread runs the request (dpkp/kafka-python#3121; the fix, #3123/#3124, is merged but not
released). A fresh clone's `make test` hung there for 180 s in `KafkaConsumer.poll`, after a broker
restart, while the IO thread sat idle in `select()`: the waiting task was never run. This wait wakes
the IO loop again every second (a lost wake-up costs a second, not forever) and gives up after
`BOUND_S` with `KafkaTimeoutError`, which the callers already handle as a broker that did not answer.

Remove it once a kafka-python release bounds `NetworkSelector.run` itself.
"""

from __future__ import annotations

import threading
import time

from kafka.errors import KafkaTimeoutError
from kafka.net.selector import NetworkSelector

BOUND_S = 120.0
"""Longest a caller waits for one IO-loop call; every call this project makes answers within its
request timeout (30-40 s) when the loop is healthy."""
_SLICE_S = 1.0

_library_run = NetworkSelector.run


def _bounded_run(self: NetworkSelector, coro, *args):
    # Only the cross-thread branch can block forever; the others are the library's.
    if self._closed or self._io_thread is None or threading.current_thread() is self._io_thread or self._exception:
        return _library_run(self, coro, *args)
    event = threading.Event()
    state = {"value": None, "exception": None}

    async def waiter():
        try:
            state["value"] = await self._invoke(coro, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the library does
            if state["exception"] is None:
                state["exception"] = exc
        finally:
            with self._pending_waiters_lock:
                self._pending_waiters.pop(event, None)
            event.set()

    with self._pending_waiters_lock:
        self._pending_waiters[event] = state
    self.call_soon_threadsafe(waiter)
    deadline = time.monotonic() + BOUND_S
    while not event.wait(_SLICE_S):
        if time.monotonic() > deadline:
            with self._pending_waiters_lock:
                self._pending_waiters.pop(event, None)
            raise KafkaTimeoutError(f"kafka-python's IO loop did not run a request within {BOUND_S:.0f} s")
        self.wakeup()
    if state["exception"] is not None:
        raise state["exception"]
    return state["value"]


def install() -> None:
    """Bound every cross-thread wait of kafka-python's IO loop (idempotent)."""
    NetworkSelector.run = _bounded_run
