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

A family's success cannot see its instances (task and seed): on MiniWoB++ one seed of a family is
always solved and another never, so 60-90% of groups are all-equal while every family sits in band.
With `skip_uninformative = N` the curriculum also keeps each instance's last N groups (from this run's
`GroupCompleted` events only: single episodes say nothing about a group) and passes over an instance
whose last N groups all had equal rewards, for `skip_passes` passes over its family; then one group
retries it. A family whose every instance is skipped is not drawn (until its skips run out), and when
that is every family, the skips are ignored for that draw (never starve). Given the same seed and the
same sequence of outcomes and draws, the draws are the same.
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
    skip_uninformative: int = 0
    """Skip an instance (task and seed) whose last this many groups all had equal rewards (all succeeded
    or all failed: dynamic sampling dropped them and would likely drop its next one); 0: off. 2 is a
    safe value: a group of G = 4 at success 0.5 is all-equal 1 time in 8, two in a row 1 in 64."""
    skip_passes: int = 4
    """How long a skip lasts: until the instance's family has been drawn this many times its number of
    instances (each other instance had about that many turns); then one group retries the instance,
    and an all-equal one skips it again. A family whose every instance is skipped is not drawn: its
    clock moves by 1 / (families open) each draw, as if it were drawn as often as an open family."""


@dataclass(frozen=True)
class FamilyState:
    family: str
    episodes: int
    success: float | None
    in_band: bool
    skipped: int = 0
    """Instances of the family skipped now as uninformative (`CurriculumConfig.skip_uninformative`)."""


class Curriculum(Iterator[Task]):
    """An endless task iterator (what `rollout.dispatcher.dispatch` consumes) steered by outcomes.
    Thread-safe: the dispatcher draws while the follower records."""

    def __init__(
        self,
        tasks: list[Task],
        config: CurriculumConfig = CurriculumConfig(),
        seed: int = 0,
        family_of: dict[str, str] | None = None,
    ):
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
        self._instances = {t.task_id for t in tasks}
        self._outcomes: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=config.window))
        self._informative: dict[str, deque[bool]] = defaultdict(lambda: deque(maxlen=config.skip_uninformative))
        """Instance (task id) -> whether each of its last `skip_uninformative` groups had unequal rewards."""
        self._skipped_at: dict[str, float] = {}
        """Instance -> its family's draw count when its last N groups turned out all-equal."""
        self._draws: dict[str, float] = defaultdict(float)
        """Family -> draws so far (the clock a skip expires by; a closed family's moves by 1 / open families)."""
        self._lock = threading.Lock()
        self.drawn_outside_band = 0
        self.passed_over = 0
        """Instances the family streams offered that were skipped as uninformative."""
        self.skips_ignored = 0
        """Draws made ignoring the skips, because every instance was skipped."""

    def record(self, task_id: str, rewards: Iterable[float]) -> None:
        """Outcomes of episodes of `task_id` (unknown task ids are ignored: another suite's)."""
        family = self._family_of.get(task_id)
        if family is not None:
            with self._lock:
                self._outcomes[family].extend(1.0 if r > 0 else 0.0 for r in rewards)

    def record_group(self, task_id: str, rewards: list[float]) -> None:
        """A group of `task_id` completed with `rewards`: its family's outcomes, and (with
        `skip_uninformative`) whether the instance's last groups were all-equal."""
        self.record(task_id, rewards)
        n = self.config.skip_uninformative
        family = self._family_of.get(task_id)
        if n <= 0 or task_id not in self._instances:
            return  # off, or not an instance this curriculum dispatches
        with self._lock:
            seen = self._informative[task_id]
            seen.append(len(set(rewards)) > 1)  # `trainer.advantages.informative`: what dynamic sampling keeps
            if len(seen) == n and not any(seen):
                self._skipped_at[task_id] = self._draws[family]
            else:
                self._skipped_at.pop(task_id, None)

    def on_event(self, event) -> None:
        """Feed from the run's rollout events (`pipeline.history.follow_run`: each once, the ledger's past first)."""
        if isinstance(event, GroupCompleted):
            self.record_group(event.task_id, event.rewards)

    def state(self) -> list[FamilyState]:
        with self._lock:
            skipped = self._skipped()
            return [self._state(f, len(skipped.get(f, ()))) for f in sorted(self._tasks)]

    def _state(self, family: str, skipped: int = 0) -> FamilyState:
        seen = self._outcomes.get(family, ())
        if len(seen) < self.config.min_episodes:
            return FamilyState(family, len(seen), None, True, skipped)
        p = sum(seen) / len(seen)
        return FamilyState(family, len(seen), p, self.config.low <= p <= self.config.high, skipped)

    def _skipped(self) -> dict[str, set[str]]:
        """Family -> its instances skipped now: their last N groups were all-equal, and their family has
        been drawn fewer than `skip_passes` times its size since."""
        now: dict[str, set[str]] = defaultdict(set)
        for task_id, at in self._skipped_at.items():
            family = self._family_of[task_id]
            if self._draws[family] - at < self.config.skip_passes * len(self._tasks[family]):
                now[family].add(task_id)
        return now

    def __next__(self) -> Task:
        with self._lock:
            skipped = self._skipped()
            closed = {f for f in self._tasks if len(skipped.get(f, ())) == len(self._tasks[f])}
            families = [f for f in sorted(self._tasks) if f not in closed]
            if not families:  # every instance skipped: draw as if none were
                families, skipped = sorted(self._tasks), {}
                self.skips_ignored += 1
            band = [f for f in families if self._state(f).in_band]
            if not band or self._rng.random() < self.config.explore:
                family = self._rng.choice(families)
                self.drawn_outside_band += family not in band
            else:
                family = self._rng.choice(band)
            self._draws[family] += 1
            for f in closed - {family}:  # not drawn while closed: its skips run out at an open family's pace
                self._draws[f] += 1 / len(families)
            task = next(self._streams[family])
            while task.task_id in skipped.get(family, ()):  # ends: the family has an instance not skipped
                self.passed_over += 1
                task = next(self._streams[family])
            return task


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
