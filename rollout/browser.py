"""One long-lived Chromium per worker: started once, a fresh context per episode, restarted on crash.

This is the "everlasting" half of the pool: a browser launch costs ~0.5 s and ~0.5 GB, so it is paid
once per worker, not once per iteration as in the synchronous WebGym pipeline. Each browser carries a
unique marker switch on its command line so we can find its PID and kill exactly it when it hangs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
from playwright.async_api import Browser, BrowserContext, Playwright

CHROMIUM = os.environ.get("AWRL_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
]


@dataclass(frozen=True)
class BrowserConfig:
    executable: str = CHROMIUM
    """Chromium binary (Debian's package; a downloaded Playwright browser is never used)."""
    viewport: tuple[int, int] = (1280, 720)
    """CSS pixels of each page; screenshots have this size."""
    launch_timeout_s: float = 30.0


class BrowserWorker:
    def __init__(self, playwright: Playwright, worker_id: str, config: BrowserConfig = BrowserConfig()):
        if not Path(config.executable).is_file():
            raise FileNotFoundError(f"Chromium not found at {config.executable} (apt-get install chromium)")
        self.pw = playwright
        self.worker_id = worker_id
        self.config = config
        self.browser: Browser | None = None
        self.pid: int | None = None
        self.launches = 0

    async def ensure(self) -> Browser:
        if self.browser is None or not self.browser.is_connected():
            await self.restart()
        return self.browser

    async def restart(self) -> None:
        self.kill()
        marker = f"--awrl-browser={self.worker_id}-{uuid.uuid4().hex[:8]}"
        self.browser = await self.pw.chromium.launch(
            executable_path=self.config.executable,
            args=[*FLAGS, marker],
            timeout=self.config.launch_timeout_s * 1000,
        )
        self.pid = _find_pid(marker)
        self.launches += 1

    async def new_context(self) -> BrowserContext:
        browser = await self.ensure()
        w, h = self.config.viewport
        return await browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)

    def kill(self) -> None:
        """SIGKILL our browser by PID (a hung browser does not answer a polite close)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pid = None
        self.browser = None

    async def close(self) -> None:
        if self.browser is not None and self.browser.is_connected():
            try:
                await asyncio.wait_for(self.browser.close(), timeout=10)
            except Exception:
                pass
        self.kill()

    def memory_mb(self) -> float:
        """Proportional set size of this browser and its child processes (shared pages counted once)."""
        return sum(_pss_kb(p) for p in _family(self.pid)) / 1024 if self.pid else 0.0


def _find_pid(marker: str) -> int | None:
    """The browser's main process: the one whose command line has our marker and no --type=."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        args = proc.info["cmdline"] or []
        if marker in args and not any(a.startswith("--type=") for a in args):
            return proc.info["pid"]
    return None


def _family(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (those still alive)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _pss_kb(proc: psutil.Process) -> int:
    try:
        return proc.memory_full_info().pss // 1024
    except psutil.Error:
        return 0
