"""What a policy is given and what it returns: tasks, observations, marks, outputs.

Data contracts shared by the rollout pool (which builds observations), the model layer (which renders
them into prompts) and the trainer (which scores recorded outputs). The protocols around them (`Policy`,
`Suite`, `Screen`) are the rollout pool's, in `rollout.types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Difficulty = Literal["easy", "medium", "hard"]
SuiteName = Literal["sites", "miniwob", "boxes"]
Split = Literal["train", "heldout", "test"]
PolicyName = Literal["oracle", "random", "local", "vllm", "demo"]
"""The policy backends a rollout can use (`rollout.run.make_policy`)."""
HORIZONS: dict[str, int] = {"easy": 10, "medium": 20, "hard": 30}
"""Step budget per difficulty (AsyncWebRL, arXiv 2606.05597); running out is an ordinary failure."""


class Task(BaseModel):
    """One task instance, as data. Files of these are validated on load; errors name the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str = Field(min_length=1)
    suite: SuiteName
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
    split: Split = "train"
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
