"""The task dispatcher: one process that publishes task groups for the rollout pools to run.

It picks tasks from a suite's training split in a seeded order (or a `rollout.curriculum`) and
publishes `TaskGroupDispatched` (task, seed, group size G). With an `Admission` (the trainer's
staleness budget, which the application layer passes in) it dispatches only while the groups in
flight fit the bound; `follow_trainer` feeds it from the trainer's events, so the pool pauses when the
trainer falls behind instead of producing groups that would be dropped as stale.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from typing import Protocol

from pipeline.bus import EventProducer
from pipeline.history import follow_run
from pipeline.settings import StackSettings
from pipeline.topics import TRAINER
from schemas import GroupDropped, PolicyVersionPublished, TaskGroupDispatched
from schemas.observation import Task


class Admission(Protocol):
    """May one more group be dispatched? (`trainer.staleness.StalenessBudget` is the implementation.)"""

    @property
    def current_version(self) -> int: ...

    def try_dispatch(self, n: int = 1) -> bool:
        """Reserve `n` groups if the bound allows; the caller dispatches only on True."""
        ...

    def version(self, v: int) -> None:
        """The trainer published version `v`."""
        ...

    def rejected(self, n: int = 1) -> None:
        """The trainer dropped `n` dispatched groups."""
        ...


def task_stream(tasks: list[Task], seed: int = 0) -> Iterator[Task]:
    """Endless seeded shuffle of `tasks`, reshuffled every pass."""
    if not tasks:
        raise ValueError("no tasks to dispatch")
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def dispatch(producer: EventProducer, run_id: str, tasks: Iterator[Task], groups: int, group_size: int,
             version: int = 0) -> list[TaskGroupDispatched]:
    """Publish `groups` task groups and wait for the broker to acknowledge them."""
    events = []
    for _ in range(groups):
        t = next(tasks)
        events.append(TaskGroupDispatched(
            run_id=run_id, group_id=uuid.uuid4().hex, task_id=t.task_id, suite=t.suite, seed=t.seed,
            group_size=group_size, horizon=t.horizon, dispatched_at_version=version,
        ))
    producer.publish_all(events)
    return events


def follow_trainer(settings: StackSettings, run_id: str, budget: Admission, stop: threading.Event,
                   producer: EventProducer) -> None:
    """Feed `budget` from the run's trainer events (its past first, each once) until `stop` is set."""

    def on_event(e) -> None:
        if isinstance(e, PolicyVersionPublished):
            budget.version(e.version)
        else:
            budget.rejected(1)

    follow_run(settings, TRAINER, run_id, [PolicyVersionPublished, GroupDropped], on_event, stop, producer,
               client_id="dispatcher")
