"""The ledger writer's settings and figures (`pipeline.ledger.LedgerWriter`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.s3 import STORE_PATIENCE_S


@dataclass(frozen=True)
class LedgerConfig:
    max_batch_events: int = 20_000
    """Flush after this many events (bounds memory and re-delivery after a crash)."""
    max_batch_seconds: float = 0.25
    """Flush at least this often. It bounds the writer's lag, i.e. what a restart of the local
    in-memory broker can lose (measured p50 well under 1 s with it; see the fault matrix)."""
    compression: str = "zstd"
    row_group_size: int = 64_000
    consumer_group: str = "ledger"
    dedup_window: int = 200_000
    """Event ids remembered after writing them, for a producer's duplicate (a retry seconds later);
    redelivery after a crash or rebalance is covered by the journal whatever its size."""
    store_patience_s: float = STORE_PATIENCE_S
    """How long a flush waits out an unreachable or full object store (offsets stay uncommitted)."""


@dataclass
class LedgerStats:
    written: int = 0
    """Events written to Parquet."""
    duplicates: int = 0
    """Events skipped because their id was already in the ledger."""
    files: int = 0
    bytes: int = 0
    max_lag_s: float = 0.0
    """Longest time from an event's emission to its file being durable."""
    lags: list[float] = field(default_factory=list)
    store_waited_s: float = 0.0
    """Time paused because the object store was unreachable or full."""
    dead_lettered: int = 0
    """Messages that were no valid event for their topic, moved to the dead-letter topic."""
    rejoins: int = 0
    """Times the partitions' journal could not be read when they were assigned (the group is joined again)."""
