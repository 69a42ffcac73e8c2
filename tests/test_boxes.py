"""The boxes suite: a synthetic screen with a known optimum, served through the real pool (no browser)."""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from types import SimpleNamespace

from PIL import Image

from pipeline.ledger import LedgerWriter, read_events
from rollout.episode import EpisodeConfig
from rollout.run import RolloutRequest, run_rollout
from rollout.suites.boxes import BoxesSuite, layout, make_task
from rollout.suites.boxes.suite import BOXES, COLOURS, PALETTE, SIZE, thought
from schemas import Action


def test_layouts_are_seeded_and_marks_name_their_colour():
    assert layout(3) == layout(3) and layout(3) != layout(4)
    lay = layout(7)
    assert len(set(lay.colours)) == BOXES
    assert [COLOURS[m.id] for m in lay.marks] == lay.colours  # a colour's mark never changes
    assert {m.name for m in lay.marks} == {"box"}  # the prompt names no colour but the instruction's
    assert all(0 <= m.x and m.x + m.width <= SIZE[0] and m.y + m.height <= SIZE[1] for m in lay.marks)
    assert sorted(m.x for m in lay.marks) == [m.x for m in lay.marks]  # listed left to right


def test_splits_do_not_share_seeds():
    suite = BoxesSuite()
    train, test = suite.tasks("train"), suite.tasks("test")
    colours = {"red", "blue", "green", "black"}
    assert {t.template for t in train} == {"colour", "any", "pick", "named", *colours}
    assert {t.template for t in test} == {"colour", *colours}
    assert not {t.seed for t in train} & {t.seed for t in test}
    task = make_task("colour", 5, "train")
    assert task.instruction == f"Click the {task.judge['target']} box."
    for colour in colours:  # a constant target: the same colour (so the same mark) on every layout
        assert {make_task(colour, s, "test").judge["target"] for s in range(20)} == {colour}


def _episode(task, action: Action, som: bool = False):
    """One episode on a fresh screen: (screenshot, marks, what the action did, the verdict)."""
    suite = BoxesSuite()
    screen = suite.new_screen()

    async def run():
        await suite.reset(screen.page, task)
        png, marks = await screen.observe(som=som)
        done = await screen.execute(action, marks)
        return png, marks, done, await suite.judge(screen.page, task, None, final=False)

    return asyncio.run(run())


def test_the_screen_draws_the_boxes_and_judges_the_first_action():
    task = make_task("colour", 11, "test")
    target = next(m for m in layout(11).marks if COLOURS[m.id] == task.judge["target"])
    png, marks, done, verdict = _episode(task, Action(kind="click", mark=target.id))
    img = Image.open(io.BytesIO(png))
    assert img.size == SIZE and img.getpixel(target.center) == PALETTE[task.judge["target"]]
    assert verdict.success and done.feedback == "clicked button 'box'"
    # a click inside the box by coordinates is the same click
    assert _episode(task, Action(kind="click", x=target.center[0], y=target.center[1]))[3].success
    other = next(m for m in marks if m.id != target.id)
    assert not _episode(task, Action(kind="click", mark=other.id))[3].success
    _, _, done, verdict = _episode(task, Action(kind="invalid", reason="no JSON"))
    assert not verdict.success and done.error_class == "invalid_action"  # bad output ends the episode as a failure


def test_any_box_is_right_for_the_any_template():
    task = make_task("any", 2, "train")
    assert all(_episode(task, Action(kind="click", mark=m.id), som=True)[3].success for m in layout(2).marks)


def test_named_demonstrations_read_the_colour_but_pick_the_box_at_random():
    """The controlled warm start's demonstrations: the instruction names a colour (as `colour`'s does,
    from the same seed), the oracle's thought restates it, and its box is uniform whatever the colour."""
    tasks = [make_task("named", s, "train") for s in range(400)]
    assert all(t.instruction == make_task("colour", t.seed, "train").instruction for t in tasks)
    assert all(thought(t) == f"click the {t.judge['named']} box" for t in tasks)
    assert all(_episode(tasks[0], Action(kind="click", mark=m.id), som=True)[3].success for m in layout(0).marks)
    same = sum(t.judge["target"] == t.judge["named"] for t in tasks) / len(tasks)
    assert 0.17 < same < 0.33, same  # the box the oracle clicks is the named one a quarter of the time
    assert thought(make_task("any", 1, "train")) == "click a box"


def test_pick_demonstrations_click_the_box_their_thought_names():
    """The path from a colour word to its mark, where no instruction names a colour: the thought names
    the box the oracle clicks, drawn uniformly."""
    tasks = [make_task("pick", s, "train") for s in range(400)]
    assert all(t.instruction == "Click any box." and thought(t) == f"click the {t.judge['target']} box" for t in tasks)
    suite = BoxesSuite()
    assert {suite.oracle_step(SimpleNamespace(task=t))["mark"] for t in tasks} == {0, 1, 2, 3}
    assert all(suite.oracle_step(SimpleNamespace(task=t))["mark"] == COLOURS.index(t.judge["target"]) for t in tasks)
    picked = Counter(t.judge["target"] for t in tasks)
    assert min(picked.values()) > 60, picked  # uniform over the four colours
    assert "pick" not in {t.template for t in suite.tasks("test")}


def test_oracle_episodes_through_the_pool_need_no_browser(settings, monkeypatch):
    """Events on the real broker, screenshots in the real store, one step per episode; Chromium is
    never launched (launching one fails the test)."""
    monkeypatch.setattr("rollout.browser.BrowserWorker.ensure", _no_browser)
    stats = run_rollout(
        settings,
        RolloutRequest(
            suite="boxes",
            policy="oracle",
            workers=2,
            group_size=2,
            episodes=8,
            templates=("colour",),
            run_id="boxes-oracle",
            episode=EpisodeConfig(som=True),
        ),
        show_progress=False,
    )
    assert (stats.episodes, stats.successes, stats.steps) == (8, 8, 8)
    LedgerWriter(settings).sync(idle_exit_s=2.0)
    steps = read_events(settings, "boxes-oracle", "StepRecorded", ["action", "url"]).to_pylist()
    assert len(steps) == 8 and all(s["action"]["kind"] == "click" for s in steps)


async def _no_browser(self):
    raise AssertionError("the boxes suite launched a browser")


class _Says:
    """A policy that answers every observation with the same text (what a model might write)."""

    name, version = "says", 0

    def __init__(self, text: str):
        self.text = text

    async def act(self, obs):
        from schemas.observation import PolicyOutput

        return PolicyOutput(self.text, [1], [2], [-0.5], [0])

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        return None


def _reward(text: str, malformed_reward: float) -> float:
    from rollout.episode import EpisodeContext, run_episode

    async def put(png: bytes) -> str:
        return "0" * 64

    async def nothing() -> None:
        return None

    worker = type("Worker", (), {"worker_id": "w0", "kill": lambda self: None})()  # boxes needs no browser
    ctx = EpisodeContext(
        "r",
        worker,
        _Says(text),
        BoxesSuite(),
        lambda event: None,
        put,
        nothing,
        EpisodeConfig(som=True, malformed_reward=malformed_reward),
    )
    return asyncio.run(run_episode(ctx, make_task("red", 3, "train"), "g")).reward


def test_a_malformed_action_scores_below_a_wrong_click_when_asked():
    click = '{"thought": "t", "memory": {}, "action": {"kind": "click", "mark": %s}}'
    right, wrong, absent = (_reward(click % m, -0.5) for m in ("0", "1", "32"))  # red is mark 0; 32 is on no box
    assert (right, wrong, absent) == (1.0, 0.0, -0.5)
    assert _reward("click the red box", -0.5) == -0.5  # not an action at all
    assert _reward(click % "32", 0.0) == 0.0  # the paper's binary reward by default
