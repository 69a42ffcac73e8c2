"""Boxes: a synthetic visual task with a known optimum, for testing the learning path without a browser.

A 256x128 screen shows four boxes, one of each colour, in a row, in an order and at places drawn from
the task's seed. Each box carries its Set-of-Mark id, which is fixed per colour (red is always 0,
blue 1, ...); the prompt lists the marks left to right without their colours (`[2] button "box"`), so
the instruction's is the only colour word in the text. The instruction names one colour; the first
action ends the episode: a click on that box (by mark or inside it) scores 1, anything else 0. The
optimum is 1.0, a policy that picks a box at random scores 1/BOXES, and every group of a policy in
between has rewards that differ, so the trainer sees dense reward variance.

Everything around the screen is production: the pool, the events on the broker, the ledger, the
trainer's batch builder, losses and torchrun update, the version events and the in-place refresh.
Only the page is drawn here instead of by Chromium, so a learning run costs seconds, not minutes.

Templates:
- `colour`: "Click the blue box.", the colour drawn from the seed. To win, the policy must read the
  instruction's colour: the digit it writes after `"mark": ` has to depend on a word far back in
  the prompt. Learned by RL from a warm start that clones `named` and `pick`
  (`app.learning.READING_DEMOS`, `awrl demo --config colour`); not yet the CI test (bench/RESULTS.md).
- `red`, `blue`, `green`, `black`: "Click the red box." on every layout. The optimum is one action
  (the colour's mark) whatever the layout, which the learning path must find from rewards alone: the
  CI's controlled test, its colour drawn from the run's seed so that it cannot be tuned to one mark.
- `any`: "Click any box." Every box is right, and the oracle picks one at random (seeded by the task).
  Its demonstrations teach the output format and a uniform choice of box, never which box a colour
  means.
- `pick`: "Click any box." like `any`, but the thought names the box the oracle then clicks ("click the
  green box", the box drawn uniformly): demonstrations where the mark follows the thought's colour word.
  Cloned beside `named`, the warm start has a path from a colour word to its mark, and the instruction's
  kind ("any" or a colour) closes it: on `colour` it stays near chance (bench/RESULTS.md measures how
  near), and RL has to open the path where the instruction names the colour.
- `named`: "Click the blue box.", the colour drawn from the seed like `colour`'s, but every box is right
  and the oracle picks one at random; its thought restates the instruction's colour ("click the blue
  box"). A warm start that clones these stays at chance on `colour` (the mark it learned is
  independent of the colour), yet it has read every colour word and learned to copy the instruction's
  into its thought, a few tokens before the mark. Cloning `any` instead, no colour word ever received
  a gradient and `colour` stayed at chance under RL; cloning `named` alone, RL learned `colour` in 3
  runs of 6, and with `pick` beside it in 3 runs of 3 (bench/RESULTS.md).

Splits: `train` seeds 0..TRAIN_SEEDS-1 of every template; `test` seeds from TEST_SEED on (every
template but `any`): layouts and colour orders never trained on.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from rollout.execute import Executed
from rollout.som import draw_marks
from rollout.types import Verdict
from schemas import Action
from schemas.observation import Mark, Observation, Task

PALETTE = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 160, 60), "black": (10, 10, 10)}
COLOURS = list(PALETTE)
"""A colour's box always carries the mark of the colour's index here, wherever the box is drawn."""
BOXES = 4
SIZE = (256, 128)
BOX = 40
TEMPLATES = ("colour", *COLOURS, "any", "pick", "named")
DEMONSTRATION_ONLY = ("any", "pick", "named")
"""Templates whose every box is right: demonstrations only, never in the test split."""
TRAIN_SEEDS = 500
TEST_SEED, TEST_SEEDS = 100_000, 200
URL = "http://127.0.0.1/boxes"


@dataclass(frozen=True)
class Layout:
    colours: list[str]
    """Colour of each box, left to right."""
    marks: list[Mark]


def layout(seed: int) -> Layout:
    """The boxes of a task: colours drawn without replacement, positions jittered within equal slots."""
    rng = random.Random(f"boxes-{seed}")
    colours = rng.sample(COLOURS, BOXES)
    slot = SIZE[0] // BOXES
    marks = [
        Mark(
            id=COLOURS.index(c),
            role="button",
            name="box",
            x=i * slot + rng.randint(2, slot - BOX - 2),
            y=rng.randint(16, SIZE[1] - BOX - 4),
            width=BOX,
            height=BOX,
        )
        for i, c in enumerate(colours)
    ]
    return Layout(colours, marks)


def make_task(template: str, seed: int, split: str) -> Task:
    colours = layout(seed).colours
    named = template if template in PALETTE else random.Random(f"target-{seed}").choice(colours)
    if template in DEMONSTRATION_ONLY:  # the oracle's box, drawn uniformly whatever the instruction says
        target = random.Random(f"any-{seed}").choice(colours)
    else:
        target = named
    instruction = "Click any box." if template in ("any", "pick") else f"Click the {named} box."
    judge = {"target": target, "any": int(template in DEMONSTRATION_ONLY)}
    if template == "pick":  # no colour in the instruction: the thought says the box the oracle picks
        named = target
    return Task(
        task_id=f"boxes-{template}-{seed}",
        suite="boxes",
        site="boxes",
        template=template,
        difficulty="easy",
        instruction=instruction,
        start_path="/boxes",
        seed=seed,
        split=split,
        judge=judge | ({} if template == "any" else {"named": named}),
    )


class BoxesScreen:
    """One episode's screen: draws the layout, records what the agent clicked."""

    url = URL
    viewport = SIZE

    def __init__(self):
        self.page = self  # the handle `BoxesSuite.reset` and `judge` receive
        self.layout: Layout | None = None
        self.clicked: str | None = None
        self.acted = False

    async def settle(self) -> None:
        return None

    async def observe(self, som: bool) -> tuple[bytes, list[Mark]]:
        img = Image.new("RGB", SIZE, (180, 180, 180))
        d = ImageDraw.Draw(img)
        for m, colour in zip(self.layout.marks, self.layout.colours):
            d.rectangle([m.x, m.y, m.x + m.width, m.y + m.height], fill=PALETTE[colour], outline=(90, 90, 90))
        buf = io.BytesIO()
        img.save(buf, format="PNG", compress_level=1)
        png = buf.getvalue()
        return (draw_marks(png, self.layout.marks) if som else png), self.layout.marks

    async def execute(self, action: Action, marks: list[Mark]) -> Executed:
        self.acted = True
        feedback, error = self._do(action, {m.id: m for m in marks})
        return Executed(feedback, error, 0.0, 0.0)

    def _do(self, a: Action, marks: dict[int, Mark]) -> tuple[str, str | None]:
        if a.kind == "invalid":
            return f"invalid action: {a.reason}", "invalid_action"
        if a.kind != "click":
            return f"{a.kind} has no effect here", "no_effect"
        if a.mark is not None:
            box = marks.get(a.mark)
        else:
            box = next((m for m in marks.values() if m.x <= a.x < m.x + m.width and m.y <= a.y < m.y + m.height), None)
        if box is None:
            return (
                (f"no element with mark {a.mark}", "no_such_mark")
                if a.mark is not None
                else (f"no element at ({a.x}, {a.y})", "no_element")
            )
        self.clicked = COLOURS[box.id]
        return f"clicked {box.role} '{box.name}'", None

    async def close(self) -> None:
        return None


class BoxesSuite:
    """The `boxes` tasks (`rollout.types.Suite`); no server, no browser."""

    name = "boxes"
    needs_browser = False
    base_url = "http://127.0.0.1"

    def __init__(self):
        train = [make_task(t, s, "train") for t in TEMPLATES for s in range(TRAIN_SEEDS)]
        test = [
            make_task(t, s, "test")
            for t in TEMPLATES
            if t not in DEMONSTRATION_ONLY
            for s in range(TEST_SEED, TEST_SEED + TEST_SEEDS)
        ]
        self._tasks = train + test

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def tasks(self, split: str | None = None) -> list[Task]:
        return [t for t in self._tasks if split is None or t.split == split]

    def new_screen(self) -> BoxesScreen:
        return BoxesScreen()

    async def reset(self, page: BoxesScreen, task: Task) -> str:
        page.layout, page.clicked, page.acted = layout(task.seed), None, False
        return task.instruction

    async def judge(self, page: BoxesScreen, task: Task, answer: str | None, final: bool) -> Verdict | None:
        target = str(task.judge["target"])
        if final:
            return Verdict(False, f"answered instead of clicking the {target} box")
        if not page.acted:
            return None
        if page.clicked is not None and (task.judge.get("any") or page.clicked == target):
            return Verdict(True, f"clicked the {page.clicked} box")
        return Verdict(False, f"clicked {page.clicked or 'no box'}, not the {target} box")

    def oracle_step(self, obs: Observation) -> dict:
        return {"op": "click", "mark": COLOURS.index(str(obs.task.judge["target"])), "thought": thought(obs.task)}


def thought(task: Task) -> str:
    """The oracle's thought restates the instruction's colour, never the box it then picks (in `named` a
    uniform one: naming it would teach the mark to copy a random word, not to read the instruction);
    where the instruction names none, "click a box" (`any`) or the box it picks (`pick`)."""
    named = task.judge.get("named")
    return "click a box" if named is None else f"click the {named} box"
