"""MiniWoB++ suite against real Chromium: every task loads, the oracle solves its subset, a random
policy is judged by the page's own reward, and a bad task line is rejected naming the field.

The marks extractor and plan-step resolver here are deliberately minimal stand-ins for the real
ones (`rollout.som`, `rollout.policy.scripted`), so these tests pin the suite and its oracle plans
alone; they are just enough to carry out the oracle's plan vocabulary.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import random
import re

import pytest
from playwright.async_api import async_playwright

from rollout.suites.miniwob import ORACLE_TASKS, MiniWobSuite, oracle_plan_step
from rollout.suites.miniwob.suite import _load_tasks
from rollout.suites.tasks_io import TaskFileError
from rollout.types import Verdict
from schemas.observation import Mark, Observation, Task

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGES = 2
"""Episodes run concurrently on this many pages of one browser (more gains nothing on 2 cores)."""

# Visible interactive elements -> marks. Each gets data-awrl-mark so the resolver can find it again.
_MARKS_JS = """() => {
  const q = 'button, a, input, select, textarea, .alink, [role=tab], [role=button]';
  const text = el => (el.innerText || '').replace(/\\s+/g, ' ').trim();
  const out = [];
  for (const el of document.querySelectorAll(q)) {
    if (el.closest('#sync-task-cover, #reward-display, #query')) continue;
    const r = el.getBoundingClientRect();
    const st = getComputedStyle(el);
    if (!r.width || !r.height || st.visibility === 'hidden') continue;
    const tag = el.tagName.toLowerCase(), type = (el.type || '').toLowerCase();
    let role, name;
    if (type === 'checkbox' || type === 'radio') {
      role = type; name = el.labels && el.labels[0] ? text(el.labels[0]) : el.id;
    } else if (tag === 'input' || tag === 'textarea') {
      role = 'input';
      const label = el.labels && el.labels[0] ? text(el.labels[0]) : '';
      name = label || el.placeholder || el.getAttribute('aria-label') || el.id || el.name || '';
    } else if (tag === 'select') {
      role = 'select'; name = el.id || el.name || '';
    } else if (tag === 'a' || el.classList.contains('alink')) {
      role = 'link'; name = text(el);
    } else {
      role = el.getAttribute('role') || 'button';
      name = text(el) || el.title || el.value || '';
    }
    el.dataset.awrlMark = String(out.length);
    out.push({id: out.length, role, name, x: Math.round(r.x), y: Math.round(r.y),
              width: Math.round(r.width), height: Math.round(r.height),
              selector: `[data-awrl-mark="${out.length}"]`});
  }
  return out;
}"""


# --- helpers ------------------------------------------------------------------------------------


async def extract_marks(page) -> list[Mark]:
    return [Mark(**m) for m in await page.evaluate(_MARKS_JS)]


def _find(marks: list[Mark], step: dict) -> Mark:
    """Exact name first, then case-insensitive (MiniWoB compares link/button text exactly)."""
    for key in (lambda s: " ".join(s.split()), lambda s: " ".join(s.split()).casefold()):
        same = [m for m in marks if key(m.name) == key(step["name"])]
        if step["op"] in ("type", "select"):
            same = [m for m in same if m.role in ("input", "select")]
        if same:
            return next((m for m in same if m.role == step.get("role")), same[0])
    raise AssertionError(f"no mark for {step} in {[m.describe() for m in marks]}")


async def execute(page, step: dict, marks: list[Mark]) -> None:
    """Carry out one oracle plan step the way a vision agent would: coordinates and keys."""
    op = step["op"]
    if op == "press":
        await page.keyboard.press(step["key"])
        return
    mark = _find(marks, step)
    if op == "select":
        await page.select_option(mark.selector, label=step["text"])
        return
    await page.mouse.click(*mark.center)
    if op == "type":
        await page.keyboard.type(step["text"])


async def run_episode(suite: MiniWobSuite, page, task: Task, policy) -> tuple[Verdict, int]:
    """reset -> (policy step, judge) until the page ends the episode or the horizon runs out."""
    instruction = await suite.reset(page, task)
    for step in range(task.horizon):
        action = await policy(page, instruction, step)
        if action["op"] == "stop":
            return await suite.judge(page, task, "", final=True), step
        verdict = await suite.judge(page, task, None, final=False)
        if verdict is not None:
            return verdict, step + 1
    return await suite.judge(page, task, None, final=True), task.horizon


def oracle_policy(task: Task):
    async def act(page, instruction: str, step: int) -> dict:
        marks = await extract_marks(page)
        plan_step = oracle_plan_step(task.site, instruction, marks, step)
        if plan_step["op"] != "stop":
            await execute(page, plan_step, marks)
        return plan_step

    return act


def random_policy(rng: random.Random):
    async def act(page, instruction: str, step: int) -> dict:
        await page.mouse.click(rng.randrange(160), rng.randrange(210))
        return {"op": "click"}

    return act


async def _with_pages(n: int, jobs: list, work):
    """Run `work(suite, page, job)` for every job on `n` pages of one browser; results in order."""
    suite = MiniWobSuite()
    suite.start()
    results: list = [None] * len(jobs)
    queue: asyncio.Queue = asyncio.Queue()
    for i, job in enumerate(jobs):
        queue.put_nowait((i, job))
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)

            async def worker():
                page = await browser.new_page()
                while not queue.empty():
                    i, job = queue.get_nowait()
                    results[i] = await work(suite, page, job)

            await asyncio.gather(*(worker() for _ in range(n)))
            await browser.close()
    finally:
        suite.stop()
    return results


def _first_seed_per_task(tasks: list[Task]) -> list[Task]:
    seen: dict[str, Task] = {}
    for t in tasks:
        seen.setdefault(t.site, t)
    return list(seen.values())


# --- tests --------------------------------------------------------------------------------------


def test_task_file_is_well_formed():
    tasks = MiniWobSuite().tasks()
    names = {t.site for t in tasks}
    assert len(names) >= 20
    assert all(t.suite == "miniwob" and t.instruction == "" for t in tasks)
    assert all(t.start_path == f"/miniwob/{t.site}.html" and t.template == t.site for t in tasks)
    assert ORACLE_TASKS <= names and len(ORACLE_TASKS) >= 8
    held = {t.site for t in MiniWobSuite().tasks("heldout")}
    assert held and held.isdisjoint({t.site for t in MiniWobSuite().tasks("train")})
    assert all(sum(t.site == n for t in tasks) >= 3 for n in names), "several seeds per task"


def test_bad_task_line_names_the_field(tmp_path):
    good = MiniWobSuite().tasks()[0].model_dump()
    for field, value in [("difficulty", "trivial"), ("start_path", "miniwob/x.html"), ("sead", 3)]:
        bad = tmp_path / f"{field}.jsonl"
        bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, field: value}) + "\n")
        with pytest.raises(TaskFileError, match=rf":2: field '{field}'"):
            _load_tasks(bad)
    with pytest.raises(TaskFileError, match="suite"):
        f = tmp_path / "suite.jsonl"
        f.write_text(json.dumps({**good, "suite": "sites"}) + "\n")
        MiniWobSuite(tasks_file=f).tasks()


def test_oracle_plan_step_is_pure():
    marks = [
        Mark(0, "input", "username", 7, 78, 128, 21),
        Mark(1, "input", "password", 7, 130, 108, 21),
        Mark(2, "button", "Login", 2, 166, 87, 31),
    ]
    u = 'Enter the username "vina" and the password "US" into the text fields and press login.'
    steps = [oracle_plan_step("login-user", u, marks, s) for s in range(4)]
    assert steps == [
        {"op": "type", "name": "username", "text": "vina"},
        {"op": "type", "name": "password", "text": "US"},
        {"op": "click", "name": "Login", "role": "button"},
        {"op": "stop"},
    ]
    assert oracle_plan_step("drag-box", "Drag the box.", marks, 0) == {"op": "stop"}
    task = MiniWobSuite().tasks()[0].model_copy(update={"site": "login-user"})
    obs = Observation(u, [], [], "", "", [], {}, marks, True, 0, 10, task=task)
    assert MiniWobSuite().oracle_step(obs) == steps[0]


def test_every_task_loads_with_an_instruction_and_seeds_are_deterministic():
    tasks = _first_seed_per_task(MiniWobSuite().tasks())
    rechecked = {t.site for t in tasks[::4]}  # a second reset costs time; a sample suffices
    area_js = "() => document.getElementById('area').innerHTML"

    async def load(suite, page, task):
        first = await suite.reset(page, task)
        png = await page.screenshot() if task is tasks[0] else None
        if task.site not in rechecked:
            return first, first, True, page.viewport_size, png
        area = await page.evaluate(area_js)
        again = await suite.reset(page, task)  # same seed -> same problem
        return first, again, area == await page.evaluate(area_js), page.viewport_size, png

    results = asyncio.run(_with_pages(PAGES, tasks, load))
    for task, (first, again, same_area, viewport, _) in zip(tasks, results):
        assert first.strip(), f"{task.site}: empty instruction"
        assert first == again and same_area, f"{task.site}: seed {task.seed} not deterministic"
        assert viewport == {"width": 160, "height": 210}
    png = results[0][4]  # the screenshot is exactly the task area: PNG IHDR width, height
    assert png[16:24] == (160).to_bytes(4, "big") + (210).to_bytes(4, "big")


def test_oracle_solves_its_subset():
    tasks = [t for t in MiniWobSuite().tasks() if t.site in ORACLE_TASKS]
    by_site: dict[str, list[Task]] = {}
    for t in tasks:
        by_site.setdefault(t.site, []).append(t)
    jobs = [t for site in sorted(by_site) for t in by_site[site][:2]]

    async def solve(suite, page, task):
        return await run_episode(suite, page, task, oracle_policy(task))

    results = asyncio.run(_with_pages(PAGES, jobs, solve))
    failed = [(t.task_id, v.reason) for t, (v, _) in zip(jobs, results) if not v.success]
    assert not failed, failed
    assert all("raw_reward=1" in v.reason for v, _ in results)


def test_random_policy_gets_the_pages_own_reward():
    tasks = _first_seed_per_task(MiniWobSuite().tasks())[::4]

    async def play(suite, page, task):
        verdict, steps = await run_episode(suite, page, task, random_policy(random.Random(7)))
        page_state = await page.evaluate("() => [WOB_DONE_GLOBAL, WOB_RAW_REWARD_GLOBAL]")
        return verdict, steps, page_state

    results = asyncio.run(_with_pages(PAGES, tasks, play))
    for task, (verdict, steps, (done, raw)) in zip(tasks, results):
        assert isinstance(verdict, Verdict), task.site
        if done:  # ended by the page: the verdict is exactly the page's raw reward
            assert f"raw_reward={float(raw):g}" in verdict.reason
            assert verdict.success == (raw > 0) and steps <= task.horizon
        else:  # ran out of steps: a failure from the final judge call
            assert not verdict.success and steps == task.horizon
            assert re.search(r"before the task ended", verdict.reason)


def test_client_disconnects_are_not_printed_as_tracebacks_but_other_errors_are(capsys):
    from rollout.suites.serving import QuietHTTPServer

    server = QuietHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    try:
        for exc in (BrokenPipeError(32, "Broken pipe"), ValueError("a bug")):
            try:
                raise exc
            except Exception:
                server.handle_error(None, ("127.0.0.1", 1))
    finally:
        server.server_close()
    err = capsys.readouterr().err
    assert "BrokenPipeError" not in err and "ValueError: a bug" in err
