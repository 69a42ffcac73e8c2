"""Which topic each event goes to, and its partition key.

Rollout events are keyed by `group_id`: Kafka orders records per key, so every step of a trajectory
(and of its group) precedes the group's `GroupCompleted` on one partition. A consumer that sees
`GroupCompleted` has therefore already seen every step of the group, which the trainer's batch builder
relies on. Per-trajectory order follows, since a trajectory belongs to exactly one group.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import EVENT_TYPES, Event


@dataclass(frozen=True)
class Topic:
    name: str
    """Name without the deployment prefix."""
    partitions: int
    """More partitions let more consumers share the load; order holds per key only."""


TASKS = Topic("tasks", 4)
ROLLOUT = Topic("rollout", 8)
TRAINER = Topic("trainer", 1)
DEAD_LETTER = Topic("dead-letter", 1)
ALL_TOPICS = (TASKS, ROLLOUT, TRAINER, DEAD_LETTER)

_ROUTES: dict[type[Event], Topic] = {cls: next(t for t in ALL_TOPICS if t.name == cls.topic) for cls in EVENT_TYPES}


def topic_of(event: Event) -> Topic:
    return _ROUTES[type(event)]


def accepts(topic: Topic, event: Event) -> bool:
    """Whether `event` belongs on `topic` (an event on the wrong topic is dead-lettered)."""
    return event.topic == topic.name  # by name, so subclasses (`schemas.columnar`) route as their class


def partition_key(event: Event) -> bytes:
    key = getattr(event, "group_id", None) or event.run_id
    return key.encode()
