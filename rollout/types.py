"""The contracts inside the rollout pool: policies, suites, screens (the data they exchange is in
`schemas.observation`).

Every policy backend (oracle, local transformers VLM, vLLM over HTTP, random) implements `Policy`;
every task suite (our own multi-page sites, MiniWoB++) implements `Suite`. The episode loop in
`rollout.episode` knows only these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from schemas.observation import Mark, Observation, PolicyOutput, Task


@runtime_checkable
class Policy(Protocol):
    """One contract for all backends."""

    name: str
    version: int
    """Policy version currently loaded."""

    async def act(self, obs: Observation) -> PolicyOutput: ...

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        """Load newer weights in place, between steps, without stopping episodes. `checkpoint_sha256`:
        the version event's digest (a sampler that was pushed this version's weights checks it)."""
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
