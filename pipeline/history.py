"""A run's past events as the system holds them now: in the ledger, in the broker's log, in an outbox.

What folds its state from its own past on start-up (the trainer's resume point) reads this, not the log
alone. A broker that lost its log (Tansu in memory) holds only what came after, and an outbox does not
send again what the ledger has confirmed; every event a producer sent is in at least one of the three.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from pipeline.bus import outbox_path, read_log, topic_name
from pipeline.ledger import read_events
from pipeline.outbox import Outbox
from pipeline.settings import StackSettings
from pipeline.store import patiently
from pipeline.topics import Topic
from schemas import Event, decode_event, table_to_events


def sent_events(settings: StackSettings, run_id: str, topic: Topic, models: Sequence[type[Event]],
                client_id: str | None = None) -> list[Event]:
    """The run's events of `models` (all on `topic`), each once: the ledger's, the log's, and what the
    outbox of the producer `client_id` still holds (sent to a broker that then lost it, and not yet
    in the ledger)."""
    found: dict[str, Event] = {}
    for model in models:
        table = patiently(lambda name=model.__name__: read_events(settings, run_id, name),
                          f"reading the run's {model.__name__} events from the ledger")
        found.update((e.event_id, e) for e in table_to_events(table, model))
    found.update((e.event_id, e) for e in read_log(settings, topic) if e.run_id == run_id and isinstance(e, tuple(models)))
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
                if event.run_id == run_id and isinstance(event, tuple(models)):
                    found.setdefault(event.event_id, event)
        finally:
            box.close()
    return list(found.values())
