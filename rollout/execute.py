"""Carry out one Action on a Playwright page and say, in words, what it did.

The feedback text is part of the next observation (OpenWebRL: removing it cost 5-8 points), so it
names the element acted on and what changed: "clicked button 'Add to cart'", "navigated to /cart",
"no element at (412, 96)", "typed 12 characters into input 'q'".
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from rollout.som import MARK_ATTR, collect_marks, draw_marks
from schemas import Action
from schemas.observation import Mark

ACTION_TIMEOUT_MS = 3000
SETTLE_TIMEOUT_MS = 2000
NAVIGATION_GRACE_MS = 100

_DESCRIBE_AT_JS = """
([x, y]) => {
  const el = document.elementFromPoint(x, y);
  if (!el || el === document.body || el === document.documentElement) return null;
  const t = el.closest('a,button,input,select,textarea,label,[role]') || el;
  const role = t.getAttribute('role') || ({a: 'link', textarea: 'input'}[t.tagName.toLowerCase()]
               || t.tagName.toLowerCase());
  const name = (t.getAttribute('aria-label') || t.getAttribute('placeholder') || t.innerText || t.value
                || t.getAttribute('name') || '').replace(/\\s+/g, ' ').trim().slice(0, 40);
  return role + " '" + name + "'";
}
"""
_FOCUSED_JS = """
() => { const el = document.activeElement;
  if (!el || el === document.body) return null;
  const editable = ['INPUT', 'TEXTAREA', 'SELECT'].includes(el.tagName) || el.isContentEditable;
  const name = el.getAttribute('name') || el.getAttribute('aria-label') || el.getAttribute('placeholder')
               || el.id || '';
  return editable ? "input '" + name + "'" : null; }
"""


@dataclass(frozen=True)
class Executed:
    feedback: str
    error_class: str | None
    browser_s: float
    wait_s: float


class BrowserScreen:
    """A Playwright page in a fresh browser context, as the episode loop sees it (`rollout.types.Screen`)."""

    def __init__(self, worker, context, page):
        self.worker, self.context, self.page = worker, context, page

    @classmethod
    async def open(cls, worker) -> BrowserScreen:
        context = await worker.new_context()
        return cls(worker, context, await context.new_page())

    @property
    def url(self) -> str:
        return self.page.url

    @property
    def viewport(self) -> tuple[int, int]:
        size = self.page.viewport_size or {"width": 1280, "height": 720}
        return size["width"], size["height"]

    async def settle(self) -> None:
        await settle(self.page)

    async def observe(self, som: bool, attempts: int = 4) -> tuple[bytes, list[Mark]]:
        """Marks + screenshot of a settled page. A navigation that starts late (a form submit after the
        click returned) destroys the JS context mid-read: wait for the new page and read again."""
        for attempt in range(attempts):
            try:
                marks = await collect_marks(self.page)
                png = await self.page.screenshot(type="png")
                return (draw_marks(png, marks) if som else png), marks
            except Exception as exc:
                if attempt == attempts - 1 or "context was destroyed" not in str(exc):
                    raise
                await settle(self.page)
        raise AssertionError("unreachable")

    async def execute(self, action: Action, marks: list[Mark]) -> Executed:
        return await execute(self.page, action, marks)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.context.close(), 5)
        except Exception:
            self.worker.kill()


async def execute(page, action: Action, marks: list[Mark]) -> Executed:
    t0 = time.perf_counter()
    before = page.url
    try:
        feedback, error = await _do(page, action, {m.id: m for m in marks})
    except Exception as exc:  # playwright raises its own TimeoutError/Error for page-level failures
        if "Target" in type(exc).__name__ or "closed" in str(exc).lower():
            raise  # the browser is gone: the episode loop treats it as an environment error
        feedback, error = f"{action.kind} failed: {str(exc).splitlines()[0][:200]}", "action_failed"
    t1 = time.perf_counter()
    await settle(page)
    t2 = time.perf_counter()
    if page.url != before:
        feedback += f"; navigated to {urlparse(page.url).path or '/'}"
    return Executed(feedback, error, t1 - t0, t2 - t1)


async def settle(page) -> None:
    """Wait until the page stops loading (bounded: a busy page must not stall the episode).

    A raw mouse click or an Enter key returns before any navigation it causes has begun, so first
    give it a moment to start; otherwise the next screenshot can show the page being left.
    """
    try:
        await page.wait_for_timeout(NAVIGATION_GRACE_MS)
        await page.wait_for_load_state("load", timeout=SETTLE_TIMEOUT_MS)
        await page.wait_for_load_state("networkidle", timeout=500)
    except Exception:
        pass


async def _do(page, a: Action, marks: dict[int, Mark]) -> tuple[str, str | None]:
    if a.kind == "invalid":
        return f"invalid action: {a.reason}", "invalid_action"
    if a.kind in ("answer", "stop"):
        return (f"answered: {a.text}" if a.kind == "answer" else "stopped"), None
    if a.kind == "click":
        return await _click(page, a, marks)
    if a.kind == "type":
        if a.mark is not None or a.x is not None:
            feedback, error = await _click(page, a, marks)
            if error:
                return feedback, error
        target = await page.evaluate(_FOCUSED_JS)
        await page.keyboard.type(a.text, delay=0)
        if target is None:
            return f"typed {len(a.text)} characters but no input has focus", "no_focus"
        return f"typed {len(a.text)} characters into {target}", None
    if a.kind == "press":
        await page.keyboard.press(a.key)
        return f"pressed {a.key}", None
    if a.kind == "scroll":
        await page.mouse.wheel(a.dx, a.dy)
        y = await page.evaluate("() => Math.round(window.scrollY)")
        return f"scrolled by ({a.dx}, {a.dy}); page now at y={y}", None
    if a.kind == "goto":
        await page.goto(a.url, timeout=ACTION_TIMEOUT_MS * 3)
        return f"opened {a.url}", None
    raise AssertionError(a.kind)


async def _click(page, a: Action, marks: dict[int, Mark]) -> tuple[str, str | None]:
    if a.mark is not None:
        m = marks.get(a.mark)
        if m is None:
            return f"no element with mark {a.mark}", "no_such_mark"
        await page.locator(f'[{MARK_ATTR}="{a.mark}"]').first.click(timeout=ACTION_TIMEOUT_MS)
        return f"clicked {m.role} '{m.name}'", None
    what = await page.evaluate(_DESCRIBE_AT_JS, [a.x, a.y])
    await page.mouse.click(a.x, a.y)
    if what is None:
        return f"no element at ({a.x}, {a.y})", "no_element"
    return f"clicked {what}", None
