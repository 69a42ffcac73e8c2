"""A readers-writer gate for a policy whose weights change under it: actions are the readers, a
refresh the writer (`vllm_client.VLLMPolicy`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class Gate:
    """Readers-writer gate between actions (many at once) and a refresh (alone, once the actions in
    flight have returned; new ones wait for it). It polls instead of blocking a thread (a pool's
    threads also carry its uploads) and holds no asyncio object (callers may run different loops)."""

    POLL_S = 0.01

    def __init__(self):
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False

    async def enter(self, read: Callable[[], int]) -> int:
        while True:
            with self._lock:
                if not self._closed:
                    self._in_flight += 1
                    return read()
            await asyncio.sleep(self.POLL_S)

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    async def close(self) -> None:
        while not self._claim():
            await asyncio.sleep(self.POLL_S)
        try:
            while self._in_flight:
                await asyncio.sleep(self.POLL_S)
        except BaseException:  # cancelled while draining: leave it open
            self.open()
            raise

    def open(self) -> None:
        with self._lock:
            self._closed = False

    def _claim(self) -> bool:
        with self._lock:
            if self._closed:  # another refresh holds it
                return False
            self._closed = True
            return True
