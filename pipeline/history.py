"""A run's past events as the system holds them now: in the ledger, in the broker's log, in an outbox.

What folds its state from the run's past on start-up (the trainer's resume point, the pool's newest
version, the dispatcher's admission budget) reads this, not the log alone. A broker that lost its log
(Tansu in memory) holds only what came after, and an outbox does not send again what the ledger has
confirmed; every event a producer sent is in at least one of the three. The trainer reads the groups
the log lost from the ledger (`ledger_groups`).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

import pyarrow.compute as pc
from pydantic import ValidationError

from pipeline.bus import EventProducer, outbox_path, topic_name
from pipeline.consumer import EventConsumer, read_log
from pipeline.ledger import read_events
from pipeline.outbox import Outbox
from pipeline.s3 import patiently
from pipeline.settings import StackSettings
from pipeline.topics import Topic
from schemas import Event, GroupCompleted, StepRecorded, decode_event, table_to_events


def sent_events(
    settings: StackSettings, run_id: str, topic: Topic, models: Sequence[type[Event]], client_id: str | None = None
) -> list[Event]:
    """The run's events of `models` (all on `topic`), each once: the ledger's, the log's, and what the
    outbox of the producer `client_id` still holds (sent to a broker that then lost it, and not yet
    in the ledger)."""
    wanted = tuple(models)
    found = {e.event_id: e for e in _ledger_past(settings, run_id, models)}
    found.update((e.event_id, e) for e in read_log(settings, topic) if e.run_id == run_id and isinstance(e, wanted))
    path = outbox_path(settings, client_id) if client_id else None
    if path is not None and path.exists():
        box = Outbox(path)
        try:
            for p in box.pending():
                if p.topic != topic_name(settings, topic):
                    continue
                try:
                    event = decode_event(p.value)
                except ValidationError:  # not an event (a dead letter's copy): not part of the run's past
                    continue
                if event.run_id == run_id and isinstance(event, wanted):
                    found.setdefault(event.event_id, event)
        finally:
            box.close()
    return list(found.values())


def ledger_groups(settings: StackSettings, run_id: str, known: Callable[[str], bool]) -> list[Event]:
    """The run's announced groups in the ledger that `known` does not name, each announcement after its
    steps, announcements in the order they were sent: what a consumer of the log alone never sees
    once a broker lost events the ledger had confirmed (an outbox does not send those again)."""
    completed = table_to_events(read_events(settings, run_id, "GroupCompleted"), GroupCompleted)
    wanted = sorted((c for c in completed if not known(c.group_id)), key=lambda c: c.emitted_at)
    if not wanted:
        return []
    where = pc.field("group_id").isin(sorted({c.group_id for c in wanted}))
    steps = table_to_events(read_events(settings, run_id, "StepRecorded", where=where), StepRecorded)
    return [*steps, *wanted]


def follow_run(
    settings: StackSettings,
    topic: Topic,
    run_id: str,
    models: Sequence[type[Event]],
    on_event: Callable[[Event], None],
    stop: threading.Event,
    producer: EventProducer,
    client_id: str,
) -> None:
    """`_follow` of the run's `models` on `topic`, the ledger's past first; each event once
    (a broker that lost its log is read again from its start, where outboxes resend what it lost)."""
    wanted, seen = tuple(models), set()

    def once(e: Event) -> None:
        if isinstance(e, wanted) and e.event_id not in seen:
            seen.add(e.event_id)
            on_event(e)

    for e in _ledger_past(settings, run_id, models):
        once(e)
    _follow(settings, topic, run_id, once, stop, producer, client_id=client_id)


def _follow(
    settings: StackSettings,
    topic: Topic,
    run_id: str | None,
    on_event,
    stop,
    producer: EventProducer,
    client_id: str = "follower",
) -> None:
    """Call `on_event` for each of the run's events on `topic` (every run's when `run_id` is None), from
    the start of the log, until `stop` (a `threading.Event`) is set. A private consumer group: it sees
    everything and commits nothing. The log alone: what a broker that lost its log no longer holds is
    missing, so `follow_run` (the ledger's past first) is the way to follow a run."""
    consumer = EventConsumer(
        settings, f"{client_id}-{run_id or 'all'}-{uuid.uuid4().hex[:8]}", [topic], producer, client_id=client_id
    )
    try:
        while not stop.is_set():
            for d in consumer.poll(timeout_ms=300):
                if run_id in (None, d.event.run_id):
                    on_event(d.event)
    finally:
        consumer.close()


def _ledger_past(settings: StackSettings, run_id: str, models: Sequence[type[Event]]) -> Iterator[Event]:
    """The run's events of `models` in the ledger (waiting out a store that is down or full)."""
    for model in models:
        table = patiently(
            lambda name=model.__name__: read_events(settings, run_id, name),
            f"reading the run's {model.__name__} events from the ledger",
        )
        yield from table_to_events(table, model)
