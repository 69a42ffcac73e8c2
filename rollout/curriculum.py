"""A curriculum read from the ledger: RL draws the task families the current policy sometimes solves.

A group whose G episodes all succeed or all fail has zero advantages and teaches nothing (dynamic
sampling drops it), so sampling it spends browser time for no update. The curriculum keeps each
family's (template's) recent outcomes, the last `window` episodes, and dispatches from families whose
success lies in [low, high]:

- at start, from the ledger: the `EpisodeFinished` events of earlier runs of this policy (the learning
  loop passes its warm start's evaluation, i.e. success under version 0);
- then from this run's own `GroupCompleted` events, followed on the bus from the start of its log (a
  restarted dispatcher rebuilds the same state).

Families with fewer than `min_episodes` outcomes count as in band (not yet measured). With
probability `explore` (and whenever no family is in band) any family is drawn, so one that is mastered
or hopeless now is measured again as the policy moves. The windows approximate "under the current
policy": the oldest outcomes fall out as new versions produce new ones.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pipeline.ledger import read_events
from pipeline.settings import StackSettings
from rollout.dispatcher import task_stream
from rollout.types import Suite
from schemas import GroupCompleted
from schemas.observation import Task


@dataclass(frozen=True)
class CurriculumConfig:
    enabled: bool = True
    """Steer the dispatcher by outcomes; off: a seeded shuffle of every task."""
    low: float = 0.1
    """Families succeeding less often than this are drawn only to explore."""
    high: float = 0.9
    """Families succeeding more often than this are drawn only to explore."""
    window: int = 16
    """Recent episodes per family that estimate its success."""
    min_episodes: int = 4
    """Fewer outcomes than this: the family's success is unknown and it counts as in band."""
    explore: float = 0.1
    """Probability of drawing from every family instead of the in-band ones."""


@dataclass(frozen=True)
class FamilyState:
    family: str
    episodes: int
    success: float | None
    in_band: bool


class Curriculum(Iterator[Task]):
    """An endless task iterator (what `rollout.dispatcher.dispatch` consumes) steered by outcomes.
    Thread-safe: the dispatcher draws while the follower records."""

    def __init__(self, tasks: list[Task], config: CurriculumConfig = CurriculumConfig(), seed: int = 0,
                 family_of: dict[str, str] | None = None):
        """`family_of`: task id -> family for outcomes of tasks outside `tasks` (e.g. the test seeds an
        evaluation ran); the families of `tasks` are known already."""
        if not tasks:
            raise ValueError("no tasks to dispatch")
        self.config = config
        self._rng = random.Random(seed)
        self._tasks: dict[str, list[Task]] = defaultdict(list)
        for t in tasks:
            self._tasks[t.template].append(t)
        self._streams = {f: task_stream(ts, seed=self._rng.randrange(2**32)) for f, ts in self._tasks.items()}
        self._family_of = dict(family_of or {}) | {t.task_id: t.template for t in tasks}
        self._outcomes: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=config.window))
        self._lock = threading.Lock()
        self.drawn_outside_band = 0

    def record(self, task_id: str, rewards: Iterable[float]) -> None:
        """Outcomes of episodes of `task_id` (unknown task ids are ignored: another suite's)."""
        family = self._family_of.get(task_id)
        if family is not None:
            with self._lock:
                self._outcomes[family].extend(1.0 if r > 0 else 0.0 for r in rewards)

    def on_event(self, event) -> None:
        """Feed from the run's rollout events (`pipeline.bus.follow`)."""
        if isinstance(event, GroupCompleted):
            self.record(event.task_id, event.rewards)

    def state(self) -> list[FamilyState]:
        with self._lock:
            return [self._state(f) for f in sorted(self._tasks)]

    def _state(self, family: str) -> FamilyState:
        seen = self._outcomes.get(family, ())
        if len(seen) < self.config.min_episodes:
            return FamilyState(family, len(seen), None, True)
        p = sum(seen) / len(seen)
        return FamilyState(family, len(seen), p, self.config.low <= p <= self.config.high)

    def __next__(self) -> Task:
        with self._lock:
            band = [f for f in sorted(self._tasks) if self._state(f).in_band]
            if not band or self._rng.random() < self.config.explore:
                family = self._rng.choice(sorted(self._tasks))
                self.drawn_outside_band += family not in band
            else:
                family = self._rng.choice(band)
            return next(self._streams[family])


def seed_from_ledger(curriculum: Curriculum, settings: StackSettings, run_ids: Iterable[str]) -> int:
    """Record the outcomes the ledger holds for `run_ids` (earlier runs of this policy); their count."""
    n = 0
    for run_id in run_ids:
        for row in read_events(settings, run_id, "EpisodeFinished", ["task_id", "reward"]).to_pylist():
            curriculum.record(row["task_id"], [row["reward"]])
            n += 1
    return n


def family_index(suite: Suite) -> dict[str, str]:
    """Task id -> template over every split of `suite` (outcomes of evaluations on unseen seeds count
    for their template)."""
    return {t.task_id: t.template for t in suite.tasks(None)}
