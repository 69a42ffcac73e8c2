"""MiniWoB++ as a `Suite`: the `miniwob` package's HTML tasks served on 127.0.0.1, BrowserGym-style.

An episode starts the way `miniwob.selenium_instance` and BrowserGym start one: load
`/miniwob/<task>.html`, wait for the sync cover, then `Math.seedrandom(seed)`, raise
`core.EPISODE_MAX_TIME` (the page's own 10-30 s timer would end a slow VLM policy's episodes early)
and `core.startEpisodeReal()`. The instruction is `core.getUtterance()` (the `#query` text).
The page judges itself: `core.endEpisode(reward)` sets `WOB_DONE_GLOBAL` and
`WOB_RAW_REWARD_GLOBAL`, which `judge` reads after every step (success iff the raw reward is > 0).

Viewport: 160x210 CSS px at device scale 1, exactly MiniWoB's task area (the 50 px yellow query
box on top, the 160x160 task below), so a screenshot shows the whole task and nothing else, and
screenshot pixels are click coordinates.
"""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import miniwob
from playwright.async_api import Error as PlaywrightError

from rollout.suites.miniwob.oracle import oracle_plan_step
from rollout.suites.serving import QuietHTTPServer
from rollout.suites.tasks_io import TaskFileError
from rollout.suites.tasks_io import load_tasks as _load_tasks
from rollout.types import Verdict
from schemas.observation import Observation, Task

HTML_DIR = Path(miniwob.__file__).parent / "html"
TASKS_FILE = Path(__file__).with_name("tasks.jsonl")
VIEWPORT = (160, 210)
EPISODE_MAX_TIME_MS = 10_000_000
"""BrowserGym sets 1e6 ms; ~2.8 h here, well under setTimeout's 2^31-1 ms cap."""
READY_WAIT_MS = 10_000

# One round trip per reset (the pool runs many episodes on few cores). `window.onload` ->
# core.startEpisode() puts up the sync cover; only then is the task's genProblem ready. The cover's
# click handler would start a fresh *unseeded* episode and clear WOB_DONE_GLOBAL, so a click after
# the end could erase the verdict: it is disabled. The reward HUD and click canvas sit right of the
# task area; they are hidden anyway in case a wider viewport is used. Tasks with delayed widgets
# flip WOB_TASK_READY once built, as miniwob's own reset waits for.
_START_JS = """async ([seed, maxTime, waitMs]) => {
  const until = async (what, cond) => {
    for (const t0 = Date.now(); !cond(); await new Promise(r => setTimeout(r, 10)))
      if (Date.now() - t0 > waitMs) throw new Error('miniwob: timed out waiting for ' + what);
  };
  await until('the sync cover', () => document.getElementById('sync-task-cover') !== null);
  Math.seedrandom(seed);
  core.EPISODE_MAX_TIME = maxTime;
  core.startEpisodeReal();
  core.cover_div.onclick = null;
  for (const id of ['reward-display', 'click-canvas']) {
    const el = document.getElementById(id);
    if (el) el.style.display = 'none';
  }
  await until('WOB_TASK_READY', () => WOB_TASK_READY === true);
  // Inline links are bare <span class="alink"> with listeners: give them the role they render as,
  // so Set-of-Mark extractors (rollout.som) mark them. The tasks never read the attribute.
  document.querySelectorAll('#area .alink').forEach(el => el.setAttribute('role', 'link'));
  return core.getUtterance();
}"""

_STATE_JS = """() => (typeof WOB_DONE_GLOBAL === 'undefined') ? null : {
  done: WOB_DONE_GLOBAL, raw: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON
}"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Static files without a log line per request."""

    # The task files are UTF-8 without a <meta charset>; without this, unicode-test's labels
    # arrive as windows-1252 mojibake ("CancÃ©l").
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".html": "text/html; charset=utf-8",
        ".js": "text/javascript; charset=utf-8",
        ".css": "text/css; charset=utf-8",
    }

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass


class MiniWobSuite:
    """The MiniWoB++ tasks listed in `tasks.jsonl`, served from a local stdlib HTTP server."""

    name = "miniwob"
    needs_browser = True
    viewport = VIEWPORT

    def __init__(self, tasks_file: Path | str = TASKS_FILE, html_dir: Path | str = HTML_DIR):
        self.tasks_file = Path(tasks_file)
        self.html_dir = Path(html_dir)
        self.base_url = ""
        self._server: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[Task] | None = None

    # --- server -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._server is not None:
            return
        handler = functools.partial(_QuietHandler, directory=str(self.html_dir))
        # Port 0: the OS picks a free port, so several suites (or test runs) never collide.
        self._server = QuietHTTPServer(("127.0.0.1", 0), handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="miniwob-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        self._thread = None
        self.base_url = ""

    # --- tasks --------------------------------------------------------------------------------

    def tasks(self, split: str | None = None) -> list[Task]:
        if self._tasks is None:
            self._tasks = _load_tasks(self.tasks_file)
            bad = [t.task_id for t in self._tasks if t.suite != "miniwob"]
            if bad:
                raise TaskFileError(f"{self.tasks_file}: field 'suite' must be 'miniwob' for {bad}")
        return [t for t in self._tasks if split is None or t.split == split]

    # --- episodes -----------------------------------------------------------------------------

    async def reset(self, page, task: Task) -> str:
        if not self.base_url:
            self.start()
        await page.set_viewport_size({"width": VIEWPORT[0], "height": VIEWPORT[1]})
        await page.goto(self.base_url + task.start_path, wait_until="load")
        return await page.evaluate(_START_JS, [task.seed, EPISODE_MAX_TIME_MS, READY_WAIT_MS])

    async def judge(self, page, task: Task, answer: str | None, final: bool) -> Verdict | None:
        try:
            state = await page.evaluate(_STATE_JS)
        except PlaywrightError as e:
            # A navigation mid-evaluate destroys the context; ask again next step unless final.
            if not final:
                return None
            return Verdict(False, f"miniwob {task.site}: could not read the page's reward ({e})")
        if state is None:
            # Navigated off the task page: no MiniWoB core, so the episode can never end well.
            return Verdict(False, f"miniwob {task.site}: left the task page ({page.url})")
        if state["done"]:
            raw = float(state["raw"])
            why = f"; {state['reason']}" if state["reason"] else ""
            return Verdict(raw > 0, f"miniwob {task.site}: raw_reward={raw:g}{why}")
        if final:
            # MiniWoB takes no answers: only the page's own end counts.
            said = {None: "episode over", "": "agent stopped"}.get(answer, f"agent answered {answer!r}")
            return Verdict(False, f"miniwob {task.site}: {said} before the task ended (raw_reward=0)")
        return None

    def oracle_step(self, obs: Observation) -> dict:
        if obs.task is None:
            return {"op": "stop"}
        return oracle_plan_step(obs.task.site, obs.instruction, obs.marks, obs.step)
