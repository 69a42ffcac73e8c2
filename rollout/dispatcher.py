"""The task dispatcher: one process that publishes task groups for the rollout pools to run.

It picks tasks from a suite's training split in a seeded order and publishes `TaskGroupDispatched`
(task, seed, group size G). The trainer issue adds staleness admission: dispatch only while the
groups in flight fit the staleness budget.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

from pipeline.bus import EventProducer
from rollout.types import Task
from schemas import TaskGroupDispatched


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
