"""Event models (the single source of truth) and the Arrow schemas derived from them."""

from schemas.actions import Action
from schemas.arrow import arrow_schema, events_to_table, table_to_events
from schemas.events import (
    BY_NAME,
    EVENT_TYPES,
    SCHEMA_VERSION,
    EpisodeFinished,
    EpisodeStarted,
    EvaluationCompleted,
    Event,
    GroupCompleted,
    GroupDropped,
    PolicyVersionLoaded,
    PolicyVersionPublished,
    RankMemory,
    RunStarted,
    StepMark,
    StepRecorded,
    StepTimings,
    TaskGroupDispatched,
    UpdateApplied,
    decode_event,
    encode_event,
)

__all__ = [
    "Action", "BY_NAME", "EVENT_TYPES", "SCHEMA_VERSION", "EpisodeFinished", "EpisodeStarted", "EvaluationCompleted",
    "Event", "GroupCompleted", "GroupDropped", "PolicyVersionLoaded", "PolicyVersionPublished", "RankMemory",
    "RunStarted", "StepMark", "StepRecorded", "StepTimings", "TaskGroupDispatched", "UpdateApplied",
    "arrow_schema", "decode_event", "encode_event", "events_to_table", "table_to_events",
]
