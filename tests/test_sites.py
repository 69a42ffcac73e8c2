"""The sites suite end to end: oracle plans driven through real Chromium must be judged successes.

A tiny resolver stands in for the oracle policy: it finds each plan step's element by role and
exact visible name (or label), insists the name is unique and the element is inside the 1280x720
viewport (Set-of-Mark only lists visible elements), and acts. Also: failures are judged failures,
`/__state` is closed to agents, sessions are per browser context, task files validate, and the
generator is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from playwright.async_api import async_playwright

from rollout.suites.sites import SitesSuite
from rollout.suites.sites.generate import TASKS_DIR, write_all
from rollout.suites.sites.judge import judge_answer
from rollout.suites.tasks_io import TaskFileError, load_tasks
from schemas.observation import HORIZONS, Observation, Task

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 720}
OPS = {"click", "type", "select", "press", "goto", "answer", "stop"}
SITES = ("shop", "wiki", "forms")


async def _browser():
    pw = await async_playwright().start()
    browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
    return pw, browser


async def _visible(page, loc, what: str):
    assert await loc.count() == 1, f"{what}: {await loc.count()} matches"
    box = await loc.bounding_box()
    assert box and box["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT["height"], f"{what} is off-screen: {box}"
    return loc


async def _element(page, step: dict):
    name = step["name"]
    if step["op"] == "click":
        roles = [step["role"]] if "role" in step else ["link", "button"]
        hits = [page.get_by_role(r, name=name, exact=True) for r in roles]
        counts = [await h.count() for h in hits]
        assert sum(counts) == 1, f"click {name!r} on {page.url}: {sum(counts)} matches"
        return await _visible(page, hits[counts.index(1)], f"click {name!r}")
    loc = page.get_by_label(name, exact=True)
    if await loc.count() == 0:
        loc = page.get_by_placeholder(name, exact=True)
    return await _visible(page, loc, f"{step['op']} {name!r} on {page.url}")


async def run_plan(page, base_url: str, plan: list[dict]) -> str:
    """Execute an oracle plan; the answer text ("" for stop)."""
    for step in plan:
        op = step["op"]
        if op in ("answer", "stop"):
            return step.get("text", "")
        if op == "press":
            async with page.expect_navigation():
                await page.keyboard.press(step["key"])
        elif op == "goto":
            await page.goto(base_url + step["path"])
        else:
            loc = await _element(page, step)
            if op == "select":
                await loc.select_option(label=step["text"])
            elif op == "type":
                # The real oracle clicks and types: that is only right into an empty field.
                assert await loc.input_value() == "", f"type {step['name']!r}: field is not empty"
                await loc.fill(step["text"])
            else:
                await loc.click()
        await page.wait_for_load_state("load")
    raise AssertionError("plan does not end with answer or stop")


def _sample(suite: SitesSuite, site: str) -> list[Task]:
    """One task per template, at a different seed for each template (every seed < 6 exists)."""
    templates = list(dict.fromkeys(t.template for t in suite.tasks() if t.site == site))
    return [t for t in suite.tasks() if t.site == site and t.seed == (3 * templates.index(t.template) + 1) % 6]


async def _worker(browser, suite: SitesSuite, queue: list[Task], out: dict) -> None:
    """Runs episodes one after another in one context; clearing cookies starts a fresh session
    (cheaper than a context per episode, which costs a renderer process each)."""
    ctx = await browser.new_context(viewport=VIEWPORT)
    page = await ctx.new_page()
    try:
        while queue:
            task = queue.pop()
            await ctx.clear_cookies()
            assert await suite.reset(page, task) == task.instruction
            ans = await run_plan(page, suite.base_url, task.oracle)
            assert await suite.judge(page, task, ans, final=False) is None
            out[task.task_id] = await suite.judge(page, task, ans, final=True)
    finally:
        await ctx.close()


async def _failure(browser, suite: SitesSuite, site: str):
    """A medium task where the agent does nothing and then answers nonsense."""
    task = next(t for t in suite.tasks() if t.site == site and t.difficulty == "medium")
    ctx = await browser.new_context(viewport=VIEWPORT)
    page = await ctx.new_page()
    await suite.reset(page, task)
    verdict = await suite.judge(page, task, "Atlantis", final=True)
    await ctx.close()
    return verdict


async def _two_sessions(browser, suite: SitesSuite):
    a, b = await browser.new_context(), await browser.new_context()
    pa, pb = await a.new_page(), await b.new_page()
    await pa.goto(suite.base_url + "/shop/product/sku-1")
    await pa.get_by_role("button", name="Add to cart").click()
    await pb.goto(suite.base_url + "/shop/")
    badge = await pa.locator(".badge").inner_text()
    agent_view = await pa.goto(suite.base_url + "/__state")
    states = await suite.state(pa), await suite.state(pb)
    await a.close()
    await b.close()
    return {"badge": badge, "states": states, "agent_status": agent_view.status}


async def _browser_runs(suite: SitesSuite) -> dict:
    """Everything that needs Chromium, in one browser launch (the costly part of these tests)."""
    pw, browser = await _browser()
    try:
        tasks = [t for site in SITES for t in _sample(suite, site)]
        queue, verdicts = list(tasks), {}
        await asyncio.gather(*(_worker(browser, suite, queue, verdicts) for _ in range(3)))
        return {
            "oracle": [(t, verdicts[t.task_id]) for t in tasks],
            "failures": {site: await _failure(browser, suite, site) for site in SITES},
            "sessions": await _two_sessions(browser, suite),
        }
    finally:
        await browser.close()
        await pw.stop()


@pytest.fixture(scope="module")
def runs(sites) -> dict:
    return asyncio.run(_browser_runs(sites))


@pytest.mark.parametrize("site", SITES)
def test_oracle_plans_succeed(sites, runs, site):
    done = [(t, v) for t, v in runs["oracle"] if t.site == site]
    assert {(t.difficulty, t.split) for t, _ in done} == {(d, s) for d in HORIZONS for s in ("train", "heldout")}
    assert len(done) == 6
    for task, verdict in done:
        assert verdict.success, f"{task.task_id}: {verdict.reason}"


def test_task_set_shape(sites):
    tasks = sites.tasks()
    assert len(tasks) == 180 and len({t.task_id for t in tasks}) == 180
    assert len(sites.tasks("heldout")) == 54
    train = {(t.site, t.template) for t in sites.tasks("train")}
    assert not train & {(t.site, t.template) for t in sites.tasks("heldout")}, "split must be by template"
    for t in tasks:
        assert {s["op"] for s in t.oracle} <= OPS and t.oracle[-1]["op"] in ("answer", "stop")
        assert len(t.oracle) <= t.horizon, t.task_id


def test_failures_are_judged_failures(runs):
    verdicts = runs["failures"]
    assert not verdicts["shop"].success and "expected" in verdicts["shop"].reason
    assert not verdicts["wiki"].success and "does not match" in verdicts["wiki"].reason
    assert not verdicts["forms"].success and "not submitted" in verdicts["forms"].reason


def test_sessions_are_per_context_and_state_is_judge_only(sites, runs):
    seen = runs["sessions"]
    assert seen["badge"] == "1 item"
    assert seen["states"][0]["cart"] == {"sku-1": 1} and seen["states"][1]["cart"] == {}
    assert seen["agent_status"] == 403
    for headers in ({}, {"X-Judge-Token": "guess"}):
        req = urllib.request.Request(sites.base_url + "/__state", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 403


def test_answer_judge_rules():
    assert judge_answer("$1,250.00", "1250.00", []).success
    assert judge_answer("70 years", "70", []).success
    assert not judge_answer("70 or 71", "70", []).success
    assert judge_answer("The capital is Dor City.", "Dor City", ["Velport"]).success
    assert not judge_answer("Dor City or Velport", "Dor City", ["Velport"]).success
    assert not judge_answer("", "Dor City", []).success


def test_bad_task_file_names_line_and_field(tmp_path):
    good = next(iter(load_tasks(TASKS_DIR / "shop.jsonl"))).model_dump()
    bad = dict(good, task_id="x2", difficulty="extreme")
    path = tmp_path / "shop.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TaskFileError, match=r"shop\.jsonl:2: field 'difficulty': Input should be"):
        load_tasks(path)
    path.write_text(json.dumps(dict(good, judge={"kind": {"nested": 1}})) + "\n")
    with pytest.raises(TaskFileError, match=r"shop\.jsonl:1: field 'judge\.kind"):
        load_tasks(path)
    path.write_text("{not json\n")
    with pytest.raises(TaskFileError, match=r"shop\.jsonl:1: not valid JSON"):
        load_tasks(path)


def test_generator_is_deterministic_and_files_are_current(tmp_path):
    write_all(tmp_path / "a")
    write_all(tmp_path / "b")
    for site in ("shop", "wiki", "forms"):
        fresh = (tmp_path / "a" / f"{site}.jsonl").read_bytes()
        assert fresh == (tmp_path / "b" / f"{site}.jsonl").read_bytes()
        assert fresh == (TASKS_DIR / f"{site}.jsonl").read_bytes(), f"rerun the generator: {site}"


def test_oracle_step_follows_plan(sites):
    task = sites.tasks()[0]
    obs = Observation(
        instruction="",
        screenshots=[],
        screenshot_sha256=[],
        url="",
        feedback="",
        history=[],
        memory={},
        marks=[],
        som=True,
        step=0,
        horizon=task.horizon,
        task=task,
    )
    assert sites.oracle_step(obs) == task.oracle[0]
    assert sites.oracle_step(Observation(**{**obs.__dict__, "step": 99})) == {"op": "stop"}
