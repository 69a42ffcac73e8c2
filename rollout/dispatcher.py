"""The task dispatcher: one process that publishes task groups for the rollout pools to run.

It picks tasks from a suite's training split in a seeded order (or a `rollout.curriculum`) and
publishes `TaskGroupDispatched` (task, seed, group size G). With an `Admission` (the trainer's
staleness budget, which the application layer passes in) it dispatches only while the groups in
flight fit the bound; `follow_trainer` feeds it from the trainer's events, so the pool pauses when the
trainer falls behind instead of producing groups that would be dropped as stale.

`dispatch_loop` is the dispatcher itself: it keeps a small backlog of groups ahead of a pool (`rollout.run`
starts it beside the pool, in the same process).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kafka.errors import KafkaError

from pipeline.bus import EventProducer
from pipeline.history import follow_run
from pipeline.settings import StackSettings
from pipeline.topics import ROLLOUT, TRAINER
from schemas import GroupCompleted, GroupDropped, PolicyVersionPublished, TaskGroupDispatched
from schemas.observation import Task

if TYPE_CHECKING:  # types only: `rollout.run` imports this module
    from rollout.pool import RolloutPool
    from rollout.run import RolloutRequest

log = logging.getLogger(__name__)


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


@runtime_checkable
class FedByOutcomes(Protocol):
    """A task order steered by the run's outcomes (`rollout.curriculum.Curriculum`, which imports this
    module: a check by shape, not by class). `dispatch_loop` follows the run's `GroupCompleted` events
    into `on_event`."""

    def on_event(self, event) -> None: ...


def task_stream(tasks: list[Task], seed: int = 0) -> Iterator[Task]:
    """Endless seeded shuffle of `tasks`, reshuffled every pass."""
    if not tasks:
        raise ValueError("no tasks to dispatch")
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def dispatch(
    producer: EventProducer, run_id: str, tasks: Iterator[Task], groups: int, group_size: int, version: int = 0
) -> list[TaskGroupDispatched]:
    """Publish `groups` task groups and wait for the broker to acknowledge them."""
    events = []
    for _ in range(groups):
        t = next(tasks)
        events.append(
            TaskGroupDispatched(
                run_id=run_id,
                group_id=uuid.uuid4().hex,
                task_id=t.task_id,
                suite=t.suite,
                seed=t.seed,
                group_size=group_size,
                horizon=t.horizon,
                dispatched_at_version=version,
            )
        )
    producer.publish_all(events)
    return events


def follow_trainer(
    settings: StackSettings, run_id: str, budget: Admission, stop: threading.Event, producer: EventProducer
) -> None:
    """Feed `budget` from the run's trainer events (its past first, each once) until `stop` is set."""

    def on_event(e) -> None:
        if isinstance(e, PolicyVersionPublished):
            budget.version(e.version)
        else:
            budget.rejected(1)

    follow_run(
        settings,
        TRAINER,
        run_id,
        [PolicyVersionPublished, GroupDropped],
        on_event,
        stop,
        producer,
        client_id="dispatcher",
    )


def dispatch_loop(
    settings, pool: RolloutPool, run_id, tasks, req: RolloutRequest, groups, stop, budget: Admission | None
) -> None:
    """Keep a small backlog of groups ahead of the pool (finite runs dispatch exactly `groups`), within
    the staleness budget when one is set."""
    producer = EventProducer(settings, client_id="dispatcher")
    if budget is not None:
        threading.Thread(target=follow_trainer, args=(settings, run_id, budget, stop, producer), daemon=True).start()
    if isinstance(tasks, FedByOutcomes):  # this run's outcomes, from the start of its log
        threading.Thread(
            target=follow_run,
            args=(settings, ROLLOUT, run_id, [GroupCompleted], tasks.on_event, stop, producer, "curriculum"),
            daemon=True,
        ).start()
    backlog = max(2, 2 * req.workers // req.group_size)
    stats = pool.stats
    try:
        while not stop.is_set() and (groups is None or stats.groups_dispatched < groups):
            if stats.groups_dispatched - stats.groups < backlog:
                if budget is None or budget.try_dispatch():
                    version = max(req.min_version, budget.current_version if budget else pool.policy.version)
                    stats.groups_dispatched += _dispatch_one(producer, run_id, tasks, req.group_size, version)
                    continue
                stats.dispatch_paused_s += 0.2
            time.sleep(0.2)
    except BaseException:
        # A pool without its dispatcher would idle forever: stop it, so its supervisor starts it again.
        log.exception("the dispatcher stopped; stopping the pool")
        pool.request_stop()
        raise
    finally:
        producer.close()


def _dispatch_one(producer: EventProducer, run_id: str, tasks, group_size: int, version: int) -> int:
    """Dispatch one task group; 1 if it is on its way (acknowledged, or in the producer's outbox, which
    sends it again after a broker restart), 0 if it was lost (no outbox: the loop dispatches another)."""
    try:
        dispatch(producer, run_id, tasks, 1, group_size, version=version)
    except KafkaError as exc:
        kept = producer.outbox is not None
        log.warning(
            "task group not acknowledged by the broker (%s): %s",
            type(exc).__name__,
            "its outbox sends it again" if kept else "dispatching another",
        )
        return int(kept)
    return 1
