"""The contracts inside the rollout pool: tasks, observations, policies, suites.

Every policy backend (oracle, local transformers VLM, vLLM over HTTP, random) implements `Policy`;
every task suite (our own multi-page sites, MiniWoB++) implements `Suite`. The episode loop in
`rollout.episode` knows only these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

Difficulty = Literal["easy", "medium", "hard"]
HORIZONS: dict[str, int] = {"easy": 10, "medium": 20, "hard": 30}
"""Step budget per difficulty (AsyncWebRL, arXiv 2606.05597); running out is an ordinary failure."""


class Task(BaseModel):
    """One task instance, as data. Files of these are validated on load; errors name the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str = Field(min_length=1)
    suite: Literal["sites", "miniwob", "boxes"]
    site: str = Field(min_length=1)
    """`shop`, `wiki`, `forms`, ... for our sites; the MiniWoB++ task name (e.g. `click-button`)."""
    template: str = Field(min_length=1)
    """Generator template id; the train / held-out split is by template and site."""
    difficulty: Difficulty
    instruction: str
    """Empty for MiniWoB++ (read from the page's utterance at episode start)."""
    start_path: str = Field(pattern=r"^/")
    """Path on the suite's local server where the episode starts."""
    seed: int = 0
    split: Literal["train", "heldout", "test"] = "train"
    """`heldout`: templates never trained on; `test`: unseen seeds of train templates (MiniWoB++'s
    usual protocol: a new utterance, layout and labels from the same generator)."""
    judge: dict[str, str | int | float | list[str]] = Field(default_factory=dict)
    """Rule-judge parameters (suite-specific: expected answer, expected final state, ...)."""
    oracle: list[dict[str, str | int]] = Field(default_factory=list)
    """Scripted solution for the oracle policy: high-level steps resolved against the page."""

    @property
    def horizon(self) -> int:
        return HORIZONS[self.difficulty]


@dataclass(frozen=True)
class Mark:
    """A visible interactive element (Set-of-Mark): numbered, with its box in CSS pixels."""

    id: int
    role: str
    """`button`, `link`, `input`, `select`, `checkbox`, ..."""
    name: str
    """Accessible text: label, text content, placeholder or value."""
    x: int
    y: int
    width: int
    height: int
    selector: str = ""
    """Internal handle used to act on the element; never shown to the model."""

    @property
    def center(self) -> tuple[int, int]:
        return self.x + self.width // 2, self.y + self.height // 2

    def describe(self) -> str:
        return f'[{self.id}] {self.role} "{self.name}"'


@dataclass(frozen=True)
class PastStep:
    """What the model is shown of an earlier step (the text history, OpenWebRL's context)."""

    thought: str
    memory: dict[str, str]
    action: str
    feedback: str


@dataclass(frozen=True)
class Observation:
    instruction: str
    screenshots: list[bytes]
    """The last K screenshots as PNG bytes, oldest first (K=1 by default)."""
    screenshot_sha256: list[str]
    url: str
    feedback: str
    """Text environment feedback for the previous action ("" at step 0)."""
    history: list[PastStep]
    memory: dict[str, str]
    """The memory object carried so far."""
    marks: list[Mark]
    """Interactive elements on the page; shown to the model only in Set-of-Mark mode."""
    som: bool
    """Set-of-Mark mode: marks drawn on the screenshot and listed in the prompt."""
    step: int
    horizon: int
    task: Task | None = None
    """Only the oracle may look at this (for its scripted plan); learned policies must not."""
    viewport: tuple[int, int] = (1280, 720)


@dataclass(frozen=True)
class PolicyOutput:
    response_text: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    """log pi_behave of each response token."""
    token_policy_versions: list[int]
    """Version that produced each token (equal unless weights changed mid-response)."""
    timings: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """One contract for all backends."""

    name: str
    version: int
    """Policy version currently loaded."""

    async def act(self, obs: Observation) -> PolicyOutput: ...

    async def refresh(self, version: int, checkpoint_uri: str) -> None:
        """Load newer weights in place, between steps, without stopping episodes."""
        ...


@dataclass(frozen=True)
class Verdict:
    success: bool
    reason: str


class Screen(Protocol):
    """What an episode acts on: a browser page (`rollout.execute.BrowserScreen`) or a screen that a
    synthetic suite draws itself, with no browser (`rollout.suites.boxes`)."""

    page: object
    """The suite's own handle, passed to `Suite.reset` and `Suite.judge` (a Playwright page for web suites)."""

    @property
    def url(self) -> str: ...

    @property
    def viewport(self) -> tuple[int, int]: ...

    async def settle(self) -> None: ...

    async def observe(self, som: bool) -> tuple[bytes, list[Mark]]:
        """(PNG screenshot, marks); in Set-of-Mark mode the marks are drawn on the screenshot."""

    async def execute(self, action, marks: list[Mark]):
        """Carry out the action; a `rollout.execute.Executed` with the feedback text."""

    async def close(self) -> None: ...


class Suite(Protocol):
    """A family of tasks served from 127.0.0.1 with its own judge."""

    name: str
    base_url: str
    """`http://127.0.0.1:PORT` once started."""
    needs_browser: bool
    """False for a synthetic suite that draws its own screens (`new_screen`): no browser is launched."""

    def new_screen(self) -> Screen:
        """A fresh screen for one episode (synthetic suites only)."""

    def start(self) -> None:
        """Start the local server (idempotent)."""

    def stop(self) -> None: ...

    def tasks(self, split: str | None = None) -> list[Task]: ...

    async def reset(self, page, task: Task) -> str:
        """Open the task's start page in a fresh context's `page`; return the instruction."""

    async def judge(self, page, task: Task, answer: str | None, final: bool) -> Verdict | None:
        """A verdict if the episode is over, else None.

        Called after every step with `final=False` (a page may signal the end itself, as MiniWoB++
        does) and once with `final=True` when the agent answered or stopped (`answer` is the answer
        text, "" for stop); then a Verdict is required.
        """

    def oracle_step(self, obs: Observation) -> dict:
        """The scripted oracle's next plan step for this observation (see `rollout.policy.oracle`)."""
